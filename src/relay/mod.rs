//! The relay background workers: claim a batch with FOR UPDATE ... SKIP LOCKED, publish it, mark
//! the acknowledged rows sent, commit. Publish-then-mark gives at-least-once delivery: a crash
//! between the two republishes the same event_id, never loses it (the guide, "relay").
//!
//! - worker.rs: the loop (wait, wake, reload, back off, run the steps);
//! - batch.rs: one batch, claim → publish → mark; publish.rs, mark.rs its steps;
//! - pipeline.rs: the send-ahead pipeline and the per-feature ordering rule; claim.rs the claim;
//! - housekeeping.rs: worker 0's periodic jobs; low_water.rs the claim's low-water mark;
//! - connection.rs: the sink (sinks/) and its backoff; schema.rs, retries.rs: when to wait;
//! - identity.rs: the identity the events carry, looked at again in every batch;
//! - standby_gate.rs: publish only what the standbys the settings name have confirmed;
//! - error.rs: RelayError; transaction.rs: the worker's own transactions; worker_slot.rs: its shared
//!   memory; fault_points.rs: test builds' entry points.

use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::relay_state::{MAX_SLOTS, RELAY, WorkerState};
use crate::settings;
use worker_slot::{WorkerSlot, update_slot};
use worker::Worker;

mod batch;
mod claim;
mod connection;
mod error;
mod expire;
mod expire_math;
pub(crate) mod fault_points;
mod housekeeping;
mod identity;
mod low_water;
mod mark;
mod pipeline;
mod publish;
mod retries;
mod schema;
mod standby_gate;
pub(crate) mod transaction;
mod worker;
mod worker_slot;

/// The release whose SQL this library runs; the relay waits until the schema is at it.
const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The database this worker connected to, set once at connect.
static WORKER_DATABASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Whose outbox this worker relays, as its events name it.
pub fn source() -> crate::event::Source {
    crate::event::Source {
        database: WORKER_DATABASE.get().cloned().unwrap_or_default(),
        database_id: identity::kept().unwrap_or_default(),
    }
}

/// A relay worker, started by the launcher (launcher.rs) for one slot of shared memory, which names
/// its database and its index. It connects there (the database's per-database settings apply), and
/// leaves at once when the database is paused for a utility command or holds no extension. Every
/// such end is designed, and exits 0: PostgreSQL logs a background worker's non-zero exit ("exited
/// with exit code 1"), and the launcher, not the postmaster, starts relay workers again (they are
/// dynamic workers that never restart). An ERROR that escapes still ends it with exit 1, logged.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn feature_outbox_relay_main(arg: pg_sys::Datum) {
    let slot = unsafe { i32::from_polymorphic_datum(arg, false, pg_sys::INT4OID) }.unwrap_or(-1);
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(slot) = usize::try_from(slot).ok().filter(|s| *s < MAX_SLOTS) else { exit_worker() };
    let attached = {
        let mut shared = RELAY.exclusive();
        let s = shared.slots[slot];
        let open = s.claimed && shared.database(s.database).is_some_and(|d| d.paused == 0);
        let s = &mut shared.slots[slot];
        if open {
            s.pid = unsafe { pg_sys::MyProcPid };
            s.latch = unsafe { pg_sys::MyLatch } as usize;
        } else {
            s.claimed = false;
            s.state = WorkerState::Stopped;
        }
        open.then_some((s.database, s.index as usize, s.workers as usize))
    };
    let Some((database, index, workers)) = attached else { exit_worker() };
    unsafe { pg_sys::before_shmem_exit(Some(release_slot), pg_sys::Datum::from(slot)) };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(database)), None);
    // A catalog read: inside a transaction, for its resource owner.
    let name = BackgroundWorker::transaction(|| unsafe { std::ffi::CStr::from_ptr(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }.to_string_lossy().into_owned());
    let _ = WORKER_DATABASE.set(name.clone());
    // Every name the relay uses is schema-qualified or in pg_catalog; no schema of a user (say, one
    // named after the worker's role) may shadow them. READ COMMITTED whatever the server's default:
    // the claim's layer reads take a snapshot newer than the claim's (claim.rs), and a claim under
    // REPEATABLE READ would fail on every row an edit updated since the batch began.
    BackgroundWorker::transaction(|| {
        let _ = Spi::run(
            "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false),
                    pg_catalog.set_config('default_transaction_isolation', 'read committed', false)",
        );
    });

    Worker::new(WorkerSlot::new(slot, index, workers, &name)).run();
    exit_worker();
}

/// Ends this relay worker as designed, with exit code 0: the postmaster logs nothing for it, and a
/// dynamic worker that never restarts is unregistered either way; the launcher starts it again.
pub fn exit_worker() -> ! {
    exit_process(0)
}

/// Ends this process with `code`. 1 for a background worker the postmaster must start again (the
/// launcher after pg_terminate_backend) or a simulated crash; PostgreSQL logs that line.
/// proc_exit never returns, but the pg18 bindings do not declare it diverging.
#[allow(unreachable_code)]
pub fn exit_process(code: i32) -> ! {
    unsafe { pg_sys::proc_exit(code) };
    unreachable!("proc_exit returned")
}

#[pg_guard]
unsafe extern "C-unwind" fn release_slot(_code: i32, arg: pg_sys::Datum) {
    update_slot(arg.value(), |s| {
        s.pid = 0;
        s.latch = 0;
        s.claimed = false;
        s.state = WorkerState::Stopped;
        s.sink_up = false;
    });
    crate::relay_state::wake_launcher();
}

/// True once SIGTERM arrived. pgrx's `sigterm_received()` clears its flag when read, so a SIGTERM
/// seen by one check (say, mid-drain) would be gone for the next, and the worker would run on
/// through a fast shutdown. The handler also sets PostgreSQL's ShutdownRequestPending, which stays.
pub fn stopping() -> bool {
    BackgroundWorker::sigterm_received() || unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) } != 0
}

/// Re-reads the configuration after a SIGHUP (the signal handler only sets a flag). True if it did.
pub fn reload_if_asked() -> bool {
    let asked = BackgroundWorker::sighup_received();
    if asked {
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
    asked
}

/// feature_outbox.poll_interval: an idle worker's fallback wake-up, and how often a feature passed
/// over is looked at again.
pub fn poll_interval() -> Duration {
    settings::millis(&settings::POLL_INTERVAL_MS)
}
