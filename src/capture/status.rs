//! What SQL sees of capture: the wake-up capture_layer sends, and the worker's figures for the
//! capture view (sql/capture.sql).

use pgrx::prelude::*;

use crate::relay_state::{RELAY, ready, this_database, wake_launcher};

/// Called by capture_layer and uncapture_layer after their commit: this database wants a capture
/// worker (the launcher starts one), and a running one looks again at once.
#[pg_extern(volatile, parallel_unsafe)]
fn _capture_wake() {
    if !ready() {
        return;
    }
    let latch = {
        let mut shared = RELAY.exclusive();
        let Some(d) = shared.database_mut(this_database()) else { return };
        d.capture.wanted = true;
        d.capture.latch
    };
    if latch != 0 {
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
    wake_launcher();
}

/// One row: this database's capture worker as it last reported (NULLs without the preload).
#[pg_extern(stable, parallel_safe)]
fn _capture_status() -> TableIterator<
    'static,
    (
        name!(pid, Option<i32>),
        name!(state, Option<String>),
        name!(events, Option<i64>),
        name!(refused, Option<i64>),
        name!(caught_up_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    let capture = ready().then(|| RELAY.share().database(this_database()).map(|d| d.capture)).flatten();
    let at = crate::monitoring::timestamp;
    let row = match capture {
        Some(c) => (
            (c.pid != 0).then_some(c.pid),
            Some(if c.pid != 0 { c.state.to_string() } else { "stopped".to_string() }),
            Some(c.events),
            Some(c.refused),
            at(c.caught_up_at),
            c.last_error(),
            at(c.last_error_at),
        ),
        None => (None, None, None, None, None, None, None),
    };
    TableIterator::new(std::iter::once(row))
}

/// capture_layer and uncapture_layer COMMIT inside: in a transaction block they cannot, and say so
/// before they change anything (25001) rather than with PostgreSQL's "invalid transaction
/// termination" after.
#[pg_extern(volatile, parallel_unsafe)]
fn _capture_outside_transaction(procedure: &str) {
    if unsafe { pg_sys::IsTransactionBlock() } {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_ACTIVE_SQL_TRANSACTION,
            format!("{procedure} cannot run inside a transaction block"),
            "It commits a publication before it creates the replication slot. CALL it on its own."
        );
    }
}
