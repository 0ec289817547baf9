//! Where an outbox row's event comes from (`outbox.origin`): the column's default,
//! `_event_origin()` (sql/origin.sql), reads this backend's current origin, so every path that
//! writes the outbox (edit_feature, record_edit, backfill, resync, the capture worker) records it
//! without naming the column.
//!
//! A per-backend static rather than a setting: a SQL caller can change a setting, never this, so an
//! application cannot pass its own writes off as captured or resynced. Only Rust sets it, through
//! [`with`], around the writes it makes: `_resync_chunk`'s entry (src/edit/entry.rs) and the capture
//! worker. The default is a plain C function reading one byte: no SPI, no catalog look-up, nothing
//! an edit pays for beyond the palloc of its text.

use std::sync::atomic::{AtomicU8, Ordering};

use pgrx::pg_sys;
use pgrx::prelude::*;

/// Where an event comes from, as `outbox.origin` stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Origin {
    /// Written by the extension's functions at the application's call: edit_feature, record_edit,
    /// backfill.
    Application = 0,
    /// Written by the capture worker for a write it decoded from the WAL (made outside those functions).
    Captured = 1,
    /// Written by resync() for a row drift() found without its event.
    Resync = 2,
}

impl Origin {
    /// The value `outbox.origin` stores, which its CHECK constraint lists.
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Application => "application",
            Origin::Captured => "captured",
            Origin::Resync => "resync",
        }
    }

    fn from_u8(v: u8) -> Origin {
        match v {
            1 => Origin::Captured,
            2 => Origin::Resync,
            _ => Origin::Application,
        }
    }
}

/// This backend's current origin. One backend is one process and runs one statement at a time, so
/// the atomic only makes the static safe Rust; no other thread reads it.
static CURRENT: AtomicU8 = AtomicU8::new(Origin::Application as u8);

/// The origin the outbox rows written now get.
pub fn current() -> Origin {
    Origin::from_u8(CURRENT.load(Ordering::Relaxed))
}

/// Runs `f` with `origin` as the current origin, then puts back the one before (so calls nest).
///
/// It is put back by a guard's `drop`, which also runs when `f` fails: a PostgreSQL ERROR raised
/// under `f` (through SPI or any `pg_sys` call) reaches Rust as a panic at pgrx's FFI boundary and
/// unwinds through this frame before the outermost `#[pg_guard]` turns it back into the ERROR (and
/// a caught one, `PgTryBuilder`, unwinds through it too). So the next statement of the session, or
/// the worker's next transaction, never writes under an origin left over from a failed one. This
/// holds because every way out of `f` is an unwind (`panic = "unwind"`, Cargo.toml); a longjmp
/// straight over Rust frames would skip it, and pgrx allows none. FATAL ends the process.
pub fn with<T>(origin: Origin, f: impl FnOnce() -> T) -> T {
    struct Restore(u8);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.store(self.0, Ordering::Relaxed);
        }
    }
    let _restore = Restore(CURRENT.swap(origin as u8, Ordering::Relaxed));
    f()
}

#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_feature_outbox_event_origin() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `_event_origin()`, the default of `outbox.origin`: the current origin as text. Declared in
/// sql/origin.sql; a plain C function, not a `#[pg_extern]`, so that its declaration lives in that
/// file beside the `SET DEFAULT` that needs it.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn feature_outbox_event_origin(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    match current().as_str().into_datum() {
        Some(text) => text,
        None => unsafe { pgrx::fcinfo::pg_return_null(fcinfo) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_nests_and_puts_back_the_origin_even_after_a_panic() {
        assert_eq!(current(), Origin::Application);
        with(Origin::Captured, || {
            assert_eq!(current(), Origin::Captured);
            with(Origin::Resync, || assert_eq!(current(), Origin::Resync));
            assert_eq!(current(), Origin::Captured);
        });
        assert_eq!(current(), Origin::Application);
        // pgrx turns a PostgreSQL ERROR into a panic that unwinds through `with`.
        let failed = std::panic::catch_unwind(|| with(Origin::Resync, || panic!("ERROR: deadlock detected")));
        assert!(failed.is_err());
        assert_eq!(current(), Origin::Application);
    }

    #[test]
    fn every_origin_reads_back_from_its_byte() {
        for o in [Origin::Application, Origin::Captured, Origin::Resync] {
            assert_eq!(Origin::from_u8(o as u8), o);
        }
    }
}
