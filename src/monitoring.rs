//! Monitoring from shared memory: per-worker figures for `feature_outbox.workers`, and the relay
//! columns of `feature_outbox.backlog` and `feature_outbox.metrics()` (see sql/monitoring.sql).

use pgrx::prelude::*;

use crate::databases::{self, Served};
use crate::relay_state::{Presence, RELAY, Slot, WorkerState, ready, this_database};
use crate::settings;

pub fn timestamp(ts: pgrx::pg_sys::TimestampTz) -> Option<TimestampWithTimeZone> {
    (ts != 0).then(|| TimestampWithTimeZone::try_from(ts).ok()).flatten()
}

/// The name of the database this session is connected to.
fn current_database() -> String {
    unsafe { std::ffi::CStr::from_ptr(pgrx::pg_sys::get_database_name(pgrx::pg_sys::MyDatabaseId)) }.to_string_lossy().into_owned()
}

/// The configured workers' slots (index order; a worker not running shows as stopped) when the
/// relay serves the current database, else why none does. Also the launcher's error for it.
fn slots_here() -> Result<(Vec<(usize, Slot)>, Option<(String, pgrx::pg_sys::TimestampTz)>), String> {
    if !ready() {
        return Err("feature_outbox is not in shared_preload_libraries: no relay worker runs, nothing is published".into());
    }
    let here = current_database();
    if !Served::now().includes(&here) {
        let served = settings::string(&settings::DATABASE);
        return Err(format!("no relay worker serves database \"{here}\": feature_outbox.database is \"{served}\""));
    }
    let count = settings::RELAY_WORKERS.get().max(0) as usize;
    if count == 0 {
        return Err("feature_outbox.relay_workers is 0: nothing is published".into());
    }
    let database = this_database();
    let shared = RELAY.share();
    let slots = (0..count)
        .map(|i| {
            let slot = shared.slots.iter().find(|s| s.database == database && s.index as usize == i && s.claimed);
            let slot = slot.or_else(|| shared.slots.iter().find(|s| s.database == database && s.index as usize == i));
            (i, slot.copied().map(|s| if s.claimed { s } else { Slot { pid: 0, state: WorkerState::Stopped, ..s } }).unwrap_or_default())
        })
        .collect();
    let launcher_error = shared.database(database).and_then(|d| d.error().map(|e| (e, d.error_at)));
    Ok((slots, launcher_error))
}

/// True while this server is a standby (in recovery). The launcher and the relay workers start only
/// when recovery ends (BgWorkerStartTime::RecoveryFinished), so on a standby none runs, none is
/// missing, and no sink is down: the relay starts at promotion.
fn standby() -> bool {
    unsafe { pgrx::pg_sys::RecoveryInProgress() }
}

/// What a standby's relay columns say (backlog.relay_held_reason, relay_databases.state).
const STANDBY: &str = "standby";
const STANDBY_REASON: &str = "this server is a standby (in recovery): its relay starts when it is promoted, within one poll interval";

/// The slot whose error is current (its worker has not worked without one since) and newest.
fn newest_error<'a>(slots: impl Iterator<Item = &'a Slot>) -> Option<&'a Slot> {
    slots.filter(|s| s.error_active && s.last_error_at != 0).max_by_key(|s| s.last_error_at)
}

/// True when the server preloaded the library (shared_preload_libraries), so relay workers can run.
/// From the library's own state, never from a setting's text: a placeholder setting looks the same
/// whether or not the library was preloaded.
#[pg_extern(stable, parallel_safe)]
fn _relay_preloaded() -> bool {
    ready()
}

/// One row per relay worker serving this database: its state and counters since server start, and
/// its sink's health (0.4.0): up as last seen (a connect, a batch, an idle worker's look at its
/// connection each poll interval; for HTTP the last request), sink-level errors since server start,
/// and when the sink last worked.
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
        name!(sink_up, Option<bool>),
        name!(sink_errors, i64),
        name!(sink_last_success_at, Option<TimestampWithTimeZone>),
    ),
> {
    // On a standby no worker runs yet: each configured one shows as "standby", its sink unknown
    // (NULL), not down.
    let standby = standby();
    let rows = slots_here()
        .map(|(slots, _)| slots)
        .unwrap_or_default()
        .into_iter()
        .map(|(i, s)| {
            (
                i as i32,
                (s.pid != 0).then_some(s.pid),
                if standby { STANDBY.to_string() } else { s.state.label().to_string() },
                s.relayed_rows,
                s.duplicates,
                s.failed_attempts,
                timestamp(s.last_active_at),
                s.error_text(),
                timestamp(s.last_error_at),
                (!standby).then_some(s.pid != 0 && s.sink_up),
                s.sink_errors,
                timestamp(s.sink_ok_at),
            )
        })
        .collect::<Vec<_>>();
    TableIterator::new(rows)
}

/// One row per relay worker serving this database: the standby gate's figures (0.5.0,
/// relay/standby_gate.rs). While a batch waits: the standby it waits on ("slot <name>" or "standby
/// <application_name>"), the bytes of WAL it lacks (NULL when it cannot confirm at all: its slot
/// is missing, logical or invalidated, or it is not connected), and for how long. Batches (and tile
/// chunks) that waited, and those published unconfirmed past feature_outbox.standby_wait_timeout,
/// since server start. A standby's workers show none of it (NULL).
#[pg_extern(stable, parallel_safe)]
fn _relay_standby_gate() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(standby_waiting_on, Option<String>),
        name!(standby_wait_bytes, Option<i64>),
        name!(standby_wait_seconds, Option<f64>),
        name!(standby_held_batches, Option<i64>),
        name!(standby_unconfirmed_batches, Option<i64>),
    ),
> {
    let standby = standby();
    let now = crate::relay_state::now();
    let rows = slots_here()
        .map(|(slots, _)| slots)
        .unwrap_or_default()
        .into_iter()
        .map(|(i, s)| {
            let waiting = s.standby_waiting_on().filter(|_| !standby && s.pid != 0);
            let waited = waiting.is_some().then(|| (now - s.standby_wait_since).max(0) as f64 / 1e6);
            let bytes = waiting.as_ref().and_then(|_| (s.standby_wait_bytes >= 0).then_some(s.standby_wait_bytes));
            (
                i as i32,
                waiting,
                bytes,
                waited,
                (!standby).then_some(s.standby_held_batches),
                (!standby).then_some(s.standby_unconfirmed_batches),
            )
        })
        .collect::<Vec<_>>();
    TableIterator::new(rows)
}

/// Why this database's rows wait for resolve_copy() (a worker holds it as a copy of another
/// database, sql/identity.sql), or NULL when no worker does. From shared memory: the backlog view
/// and metrics() read it without writing.
#[pg_extern(stable, parallel_safe)]
fn _relay_held() -> Option<String> {
    let (slots, _) = slots_here().ok()?;
    if standby() {
        return Some(STANDBY_REASON.into());
    }
    slots.iter().find(|(_, s)| s.pid != 0 && s.state == WorkerState::Held).map(|(_, s)| s.error_text().unwrap_or_default())
}

/// The relay workers this server runs for this database as a primary: feature_outbox.relay_workers
/// when the relay serves it, else 0 (not preloaded, not named in feature_outbox.database). 0.5.0:
/// beside outbox_relay_workers_running, "fewer than configured" needs no number in the rule.
#[pg_extern(stable, parallel_safe)]
fn _relay_workers_configured() -> i32 {
    slots_here().map(|(slots, _)| slots.len() as i32).unwrap_or(0)
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
    let (slots, launcher_error, unserved) = match slots_here() {
        Ok((slots, launcher_error)) => (slots, launcher_error, None),
        Err(why) => (Vec::new(), None, Some(why)),
    };
    let running = slots.iter().filter(|(_, s)| s.pid != 0).count() as i32;
    let last_active = slots.iter().map(|(_, s)| s.last_active_at).max().unwrap_or(0);
    let current = newest_error(slots.iter().map(|(_, s)| s));
    // Workers the postmaster could not start (max_worker_processes) or that are restarting leave no
    // error of their own: say how many are missing.
    let missing = (running < slots.len() as i32).then(|| {
        format!(
            "{running} of {} relay workers are running; the others are starting, or could not be registered (max_worker_processes = {}; see the server log)",
            slots.len(),
            unsafe { pgrx::pg_sys::max_worker_processes }
        )
    });
    let missing = missing.filter(|_| !standby());
    let (error, error_at) = match (unserved, launcher_error, current, missing) {
        (Some(why), ..) => (Some(why), None),
        (None, Some((error, at)), ..) => (Some(error), timestamp(at)),
        (None, None, Some(s), _) => (s.error_text(), timestamp(s.last_error_at)),
        (None, None, None, missing) => (missing, None),
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
    slots_here().map(|(slots, _)| slots.iter().map(|(_, s)| s.relayed_by_type[t]).sum::<i64>()).unwrap_or(0)
}

/// One row per database the relay serves or is told to serve, cluster-wide, from shared memory: a
/// session of one database cannot read another's outbox, so `unpublished` is what that database's
/// worker 0 last counted (at `unpublished_at`), and a database named in feature_outbox.database
/// that does not exist shows as waiting for it.
#[pg_extern(stable, parallel_safe)]
fn _relay_databases() -> TableIterator<
    'static,
    (
        name!(database, String),
        name!(state, String),
        name!(relay_workers, Option<i32>),
        name!(workers_running, i32),
        name!(worker_states, Vec<String>),
        name!(unpublished, Option<i64>),
        name!(unpublished_at, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(last_error_at, Option<TimestampWithTimeZone>),
    ),
> {
    if !ready() {
        return TableIterator::new(Vec::new());
    }
    let configured = settings::RELAY_WORKERS.get().max(0);
    let mut rows = if standby() { standby_databases(configured) } else { primary_databases(configured) };
    if let Served::Named(names) = Served::now() {
        let known: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        let catalog = databases::scan();
        for name in names.into_iter().filter(|n| !known.contains(n)) {
            let state = match catalog.iter().find(|d| d.name == name) {
                None => "waiting for database",
                Some(d) if d.is_template => "not served: a template",
                Some(d) if !d.allows_connections => "not served: allows no connections",
                Some(_) if standby() => STANDBY,
                Some(_) => "probing",
            };
            rows.push((name, state.into(), Some(0), 0, Vec::new(), None, None, None, None));
        }
    }
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    TableIterator::new(rows)
}

type DatabaseRow = (String, String, Option<i32>, i32, Vec<String>, Option<i64>, Option<TimestampWithTimeZone>, Option<String>, Option<TimestampWithTimeZone>);

/// A primary's relay_databases: each database the launcher keeps in shared memory.
fn primary_databases(configured: i32) -> Vec<DatabaseRow> {
    let shared = *RELAY.share();
    let mut rows = Vec::new();
    for d in shared.databases.iter().filter(|d| d.oid != 0) {
        let mut slots: Vec<&Slot> = shared.slots.iter().filter(|s| s.serves(d.oid)).collect();
        slots.sort_by_key(|s| s.index);
        let running = slots.iter().filter(|s| s.pid != 0).count() as i32;
        let states: Vec<String> = slots.iter().map(|s| s.state.label().to_string()).collect();
        let state = match (d.paused_for(), d.presence) {
            (Some(command), _) => format!("paused for {command}"),
            (None, Presence::Absent) => "no extension".into(),
            // Its first worker (the probe, when presence is unknown) could not start.
            (None, _) if d.error().is_some() => "no worker slot".into(),
            (None, Presence::Unknown | Presence::Probing) => "probing".into(),
            (None, Presence::Present) if slots.iter().any(|s| s.state == WorkerState::WaitingForUpdate) => WorkerState::WaitingForUpdate.label().into(),
            (None, Presence::Present) if slots.iter().any(|s| s.state == WorkerState::Held) => WorkerState::Held.label().into(),
            (None, Presence::Present) if running == 0 => "starting".into(),
            (None, Presence::Present) => "relaying".into(),
        };
        // The launcher's error first (a worker it could not start), else the newest current one.
        let current = newest_error(slots.iter().copied());
        let (error, error_at) = match (d.error(), current) {
            (Some(e), _) => (Some(e), timestamp(d.error_at)),
            (None, Some(s)) => (s.error_text(), timestamp(s.last_error_at)),
            (None, None) => (None, None),
        };
        rows.push((
            d.name(),
            state,
            Some(if d.presence == Presence::Present { configured } else { 0 }),
            running,
            states,
            (d.unpublished_at != 0).then_some(d.unpublished),
            timestamp(d.unpublished_at),
            error,
            error_at,
        ));
    }
    rows
}

/// A standby's relay_databases: every database the relay would serve after promotion, from the
/// catalog (shared memory holds none, no launcher having run), each in state "standby". Whether a
/// database has the extension can be read only connected to it: this one's workers are the
/// configured ones, another's relay_workers is NULL (unknown until promotion probes it).
fn standby_databases(configured: i32) -> Vec<DatabaseRow> {
    if configured == 0 {
        return Vec::new(); // as on a primary: relay_workers = 0 serves no database
    }
    let here = current_database();
    let served = Served::now();
    databases::scan()
        .into_iter()
        .filter(|d| d.served_by(&served))
        .map(|d| {
            let (workers, states) = if d.name == here { (Some(configured), vec![STANDBY.to_string(); configured as usize]) } else { (None, Vec::new()) };
            (d.name, STANDBY.into(), workers, 0, states, None, None, None, None)
        })
        .collect()
}
