//! Monitoring from shared memory: per-worker figures for `feature_outbox.workers`, and the relay
//! columns of `feature_outbox.backlog` and `feature_outbox.metrics()` (see sql/monitoring.sql).

use pgrx::prelude::*;

use crate::relay_state::{RELAY, Slot, WorkerState, ready};
use crate::settings;

fn timestamp(ts: pgrx::pg_sys::TimestampTz) -> Option<TimestampWithTimeZone> {
    (ts != 0).then(|| TimestampWithTimeZone::try_from(ts).ok()).flatten()
}

/// Slots of the configured workers, when the relay serves the current database.
fn slots_here() -> Vec<(usize, Slot)> {
    if !ready() {
        return Vec::new();
    }
    let here = unsafe { std::ffi::CStr::from_ptr(pgrx::pg_sys::get_database_name(pgrx::pg_sys::MyDatabaseId)) };
    if here.to_string_lossy() != settings::string(&settings::DATABASE) {
        return Vec::new();
    }
    let count = settings::RELAY_WORKERS.get().max(0) as usize;
    RELAY.share().slots.iter().copied().take(count).enumerate().collect()
}

/// One row per relay worker serving this database: its state and counters since server start.
#[pg_extern(stable, parallel_safe)]
fn _relay_workers() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(relayed_rows, i64),
        name!(duplicate_acks, i64),
        name!(failed_attempts, i64),
        name!(last_active_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    let rows = slots_here()
        .into_iter()
        .map(|(i, s)| {
            (
                i as i32,
                (s.pid != 0).then_some(s.pid),
                s.state.label().to_string(),
                s.relayed_rows,
                s.duplicates,
                s.failed_attempts,
                timestamp(s.last_active_at),
                s.error_text(),
                timestamp(s.last_error_at),
            )
        })
        .collect::<Vec<_>>();
    TableIterator::new(rows)
}

/// Relay totals for this database: workers running, last activity and error, rows relayed by type.
#[pg_extern(stable, parallel_safe)]
fn _relay_status() -> TableIterator<
    'static,
    (
        name!(relay_workers_running, i32),
        name!(relay_last_active_at, Option<TimestampWithTimeZone>),
        name!(relay_last_error, Option<String>),
        name!(relay_last_error_at, Option<TimestampWithTimeZone>),
        name!(relayed_created, i64),
        name!(relayed_moved, i64),
        name!(relayed_retired, i64),
    ),
> {
    let slots = slots_here();
    let running = slots.iter().filter(|(_, s)| s.pid != 0 && s.state != WorkerState::WaitingForDatabase).count() as i32;
    let last_active = slots.iter().map(|(_, s)| s.last_active_at).max().unwrap_or(0);
    let last_error = slots.iter().max_by_key(|(_, s)| s.last_error_at).filter(|(_, s)| s.last_error_at != 0);
    let by_type = |t: usize| slots.iter().map(|(_, s)| s.relayed_by_type[t]).sum::<i64>();
    TableIterator::once((
        running,
        timestamp(last_active),
        last_error.and_then(|(_, s)| s.error_text()),
        last_error.and_then(|(_, s)| timestamp(s.last_error_at)),
        by_type(0),
        by_type(1),
        by_type(2),
    ))
}
