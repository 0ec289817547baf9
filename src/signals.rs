//! Keeps PostgreSQL's signal handlers on the backend's main thread. A process-directed signal
//! (SIGHUP at a reload, SIGTERM, SIGUSR1) goes to any thread that does not block it, and the
//! handlers pgrx installs call into PostgreSQL (SetLatch), which pgrx refuses off the main thread:
//! the worker aborts and the postmaster resets every backend. Threads inherit the mask of the
//! thread that starts them, so the sinks start theirs with every signal blocked.

/// Runs `f` with every signal blocked on this thread, and restores the mask after, also on panic.
/// Signals that arrive meanwhile stay pending and are handled on this thread once `f` returns.
pub fn blocked<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(libc::sigset_t);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: restores the mask saved below, on the same thread.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
        }
    }
    // SAFETY: sigset_t is plain data, filled by sigfillset and pthread_sigmask before it is read.
    let _restore = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        Restore(old)
    };
    f()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_started_inside_blocked_has_every_signal_blocked_and_the_mask_comes_back() {
        fn hup_blocked() -> bool {
            // SAFETY: reads this thread's mask into a zeroed set.
            unsafe {
                let mut now: libc::sigset_t = std::mem::zeroed();
                libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut now);
                libc::sigismember(&now, libc::SIGHUP) == 1
            }
        }
        assert!(!hup_blocked());
        let inner = super::blocked(|| std::thread::spawn(hup_blocked).join().unwrap());
        assert!(inner, "the thread inherits the blocked mask");
        assert!(!hup_blocked(), "the caller's mask is restored");
    }
}
