//! Monitoring from shared memory: per-worker figures for `feature_outbox.workers`, and the relay
//! columns of `feature_outbox.backlog` and `feature_outbox.metrics()` (see sql/monitoring.sql).

use pgrx::prelude::*;

use crate::relay_state::{RELAY, Slot, WorkerState, ready};
use crate::settings;

fn timestamp(ts: pgrx::pg_sys::TimestampTz) -> Option<TimestampWithTimeZone> {
    (ts != 0).then(|| TimestampWithTimeZone::try_from(ts).ok()).flatten()
}

/// Slots of the configured workers when the relay serves the current database, else why none does.
fn slots_here() -> Result<Vec<(usize, Slot)>, String> {
    if !ready() {
        return Err("feature_outbox is not in shared_preload_libraries: no relay worker runs, nothing is published".into());
    }
    let here = unsafe { std::ffi::CStr::from_ptr(pgrx::pg_sys::get_database_name(pgrx::pg_sys::MyDatabaseId)) };
    let here = here.to_string_lossy();
    let served = settings::string(&settings::DATABASE);
    if here != served {
        return Err(format!("no relay worker serves database \"{here}\": feature_outbox.database is \"{served}\""));
    }
    let count = settings::RELAY_WORKERS.get().max(0) as usize;
    if count == 0 {
        return Err("feature_outbox.relay_workers is 0: nothing is published".into());
    }
    Ok(RELAY.share().slots.iter().copied().take(count).enumerate().collect())
}

/// True when the server preloaded the library (shared_preload_libraries), so relay workers can run.
/// From the library's own state, never from a setting's text: a placeholder setting looks the same
/// whether or not the library was preloaded.
#[pg_extern(stable, parallel_safe)]
fn _relay_preloaded() -> bool {
    ready()
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
        .unwrap_or_default()
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

/// Relay totals for this database: workers running, last activity, the current error (none once the
/// worker works again; also why no worker serves this database), rows relayed by type.
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
    let (slots, unserved) = match slots_here() {
        Ok(slots) => (slots, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    let running = slots.iter().filter(|(_, s)| s.pid != 0 && s.state != WorkerState::WaitingForDatabase).count() as i32;
    let last_active = slots.iter().map(|(_, s)| s.last_active_at).max().unwrap_or(0);
    let current = slots.iter().filter(|(_, s)| s.error_active && s.last_error_at != 0).max_by_key(|(_, s)| s.last_error_at);
    // Workers the postmaster could not start (max_worker_processes) or that are restarting leave no
    // error of their own: say how many are missing.
    let missing = (running < slots.len() as i32).then(|| {
        format!(
            "{running} of {} relay workers are running; the others are starting, or could not be registered (max_worker_processes = {}; see the server log)",
            slots.len(),
            unsafe { pgrx::pg_sys::max_worker_processes }
        )
    });
    let (error, error_at) = match (unserved, current, missing) {
        (Some(why), _, _) => (Some(why), None),
        (None, Some((_, s)), _) => (s.error_text(), timestamp(s.last_error_at)),
        (None, None, missing) => (missing, None),
    };
    let by_type = |t: usize| slots.iter().map(|(_, s)| s.relayed_by_type[t]).sum::<i64>();
    TableIterator::once((
        running,
        timestamp(last_active),
        error,
        error_at,
        by_type(0),
        by_type(1),
        by_type(2),
    ))
}

/// Rows of `event_type` relayed for this database since server start, by every worker. For the
/// types `_relay_status` has no column for (updated, new in 0.2.0), whose signature stays as the
/// 0.1.0 script declared it.
#[pg_extern(stable, parallel_safe)]
fn _relay_relayed(event_type: &str) -> i64 {
    let Some(t) = crate::relay_state::EVENT_TYPES.iter().position(|e| *e == event_type) else { return 0 };
    slots_here().map(|slots| slots.iter().map(|(_, s)| s.relayed_by_type[t]).sum::<i64>()).unwrap_or(0)
}
