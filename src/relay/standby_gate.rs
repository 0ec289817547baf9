//! Standby-confirmed publishing (0.5.0): a batch goes out, and an expire output delivers its tiles,
//! only after the standbys that could be promoted have confirmed WAL past the position at which the
//! batch's rows were read. Editors never wait; only the relay does. Without it, a failover to an
//! asynchronous standby that had not received an edit leaves subscribers holding an event of an
//! edit the new primary does not have, and the new primary's own version N of that feature is
//! then dropped as a duplicate (docs: Failover).
//!
//! Which standbys (settings.rs):
//! - `feature_outbox.standby_slots`: physical replication slots, as PostgreSQL 17's
//!   `synchronized_standby_slots` names them for logical walsenders. A physical slot's
//!   `restart_lsn` is the flush position its standby last confirmed.
//! - `feature_outbox.wait_for_synchronous_standbys`: every standby named in
//!   `synchronous_standby_names`, confirmed by its walsender's `flush_lsn`. Patroni's
//!   `synchronous_mode` promotes only those, and keeps the list current across failovers and
//!   members leaving or joining, so one cluster-wide value follows the membership.
//!
//! A named standby that cannot confirm (a slot missing, logical or invalidated; a synchronous
//! standby not connected) is waited for and said in the workers view and the log, never skipped.
//! `feature_outbox.standby_wait_timeout` lets a team choose availability: past it the batch goes
//! out with a WARNING and is counted as published unconfirmed.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use super::slot::WorkerSlot;
use super::transaction::in_transaction_try;
use super::{reload_if_asked, stopping};
use crate::plans::prepared;
use crate::settings;

/// A WAL position (an LSN), in bytes from the start of WAL.
pub type Lsn = u64;

/// The standbys the settings in effect name; None when the gate is off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Required {
    pub slots: Vec<String>,
    pub synchronous: bool,
}

/// The settings' standbys, or None when neither setting names any (the default: no gate).
pub fn required() -> Option<Required> {
    let slots = parse_slot_list(&settings::string(&settings::STANDBY_SLOTS)).unwrap_or_default();
    let synchronous = settings::WAIT_FOR_SYNCHRONOUS_STANDBYS.get();
    (synchronous || !slots.is_empty()).then_some(Required { slots, synchronous })
}

/// True when a batch must wait for standbys: the hot path skips reading positions otherwise.
pub fn on() -> bool {
    settings::WAIT_FOR_SYNCHRONOUS_STANDBYS.get() || !settings::string(&settings::STANDBY_SLOTS).trim().is_empty()
}

/// A comma-separated list of physical slot names, as PostgreSQL names slots (ReplicationSlot-
/// ValidateName: 1 to 63 of a-z, 0-9 and _). Empty entries around commas are an error; an empty
/// list is the gate off.
pub fn parse_slot_list(text: &str) -> Result<Vec<String>, String> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut names: Vec<String> = Vec::new();
    for name in text.split(',').map(str::trim) {
        if name.is_empty() || name.len() > 63 || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
            return Err(format!(
                "\"{name}\" is not a replication slot name: slot names are 1 to 63 lower-case letters, digits and underscores, separated by commas"
            ));
        }
        if names.iter().any(|n| n == name) {
            return Err(format!("slot \"{name}\" is named twice"));
        }
        names.push(name.to_string());
    }
    Ok(names)
}

/// The standby names in a `synchronous_standby_names` value, in PostgreSQL's grammar
/// (syncrep_gram.y): `name [, ...]`, `[FIRST] num (name [, ...])` or `ANY num (name [, ...])`, a
/// name plain or double-quoted, `*` for any standby. Every named standby is required: one listed as
/// a potential synchronous standby can become synchronous, and so be promoted. Empty: none.
pub fn synchronous_names(value: &str) -> Vec<String> {
    let value = value.trim();
    // The list in parentheses, when the value has a method or a count before it.
    let list = match (value.find('('), value.rfind(')')) {
        (Some(open), Some(close)) if close > open => &value[open + 1..close],
        _ => value,
    };
    let mut names = Vec::new();
    let mut chars = list.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        let Some(&first) = chars.peek() else { break };
        let mut name = String::new();
        if first == '"' {
            chars.next();
            while let Some(c) = chars.next() {
                if c == '"' {
                    if chars.peek() == Some(&'"') {
                        chars.next();
                        name.push('"');
                        continue;
                    }
                    break;
                }
                name.push(c);
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    break;
                }
                name.push(c);
                chars.next();
            }
        }
        names.push(name);
    }
    names
}

/// What a named standby has confirmed, as read now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Standby {
    /// "slot <name>" or "standby <application_name>": how the workers view names it.
    pub name: String,
    /// Its confirmed position, or why it cannot confirm any.
    pub confirmed: Result<Lsn, String>,
}

/// Why a batch read at `target` cannot go out yet: the standby furthest behind (one that cannot
/// confirm at all comes first), how many bytes it lacks (None when it cannot confirm), and the
/// reason when it cannot. None when every standby confirmed `target`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holdup {
    pub standby: String,
    pub bytes: Option<u64>,
    pub problem: Option<String>,
}

/// The decision, pure: which standby holds a batch read at `target` back, if any.
pub fn holdup(target: Lsn, standbys: &[Standby]) -> Option<Holdup> {
    if let Some(s) = standbys.iter().find(|s| s.confirmed.is_err()) {
        return Some(Holdup { standby: s.name.clone(), bytes: None, problem: s.confirmed.clone().err() });
    }
    standbys
        .iter()
        .filter_map(|s| s.confirmed.as_ref().ok().filter(|lsn| **lsn < target).map(|lsn| (s, target - lsn)))
        .max_by_key(|(_, bytes)| *bytes)
        .map(|(s, bytes)| Holdup { standby: s.name.clone(), bytes: Some(bytes), problem: None })
}

// Each named slot, found or not. A physical slot's restart_lsn is its standby's confirmed flush
// position; an invalidated one has none (wal_status 'lost').
const SLOTS_SQL: &str = "
SELECT n.name, r.slot_type, (r.restart_lsn - '0/0'::pg_catalog.pg_lsn)::int8, r.wal_status
  FROM pg_catalog.unnest($1::text[]) WITH ORDINALITY n(name, i)
  LEFT JOIN pg_catalog.pg_replication_slots r ON r.slot_name = n.name
 ORDER BY n.i";
// The walsenders of physical standbys and what each has flushed, with synchronous_standby_names.
const SYNCHRONOUS_SQL: &str = "
SELECT pg_catalog.current_setting('synchronous_standby_names'),
       (SELECT pg_catalog.array_agg(s.application_name ORDER BY s.pid)
          FROM pg_catalog.pg_stat_replication s WHERE s.flush_lsn IS NOT NULL),
       (SELECT pg_catalog.array_agg((s.flush_lsn - '0/0'::pg_catalog.pg_lsn)::int8 ORDER BY s.pid)
          FROM pg_catalog.pg_stat_replication s WHERE s.flush_lsn IS NOT NULL)";
const POSITION_SQL: &str = "SELECT (pg_catalog.pg_current_wal_insert_lsn() - '0/0'::pg_catalog.pg_lsn)::int8";

/// The position a batch was read at: the end of WAL inserted so far, past every commit the batch's
/// snapshot sees (a commit record is inserted before its transaction becomes visible). Read after
/// the batch's statements. None when the gate is off.
pub fn read_position(client: &SpiClient<'_>) -> Result<Option<Lsn>, RelayError> {
    if !on() {
        return Ok(None);
    }
    let plan = prepared(client, POSITION_SQL, &[], false);
    Ok(client.select(&*plan, None, &[])?.first().get_one::<i64>()?.map(|l| l as Lsn))
}

/// What each required standby has confirmed now.
fn read_standbys(client: &SpiClient<'_>, required: &Required) -> Result<Vec<Standby>, RelayError> {
    let mut standbys = Vec::new();
    if !required.slots.is_empty() {
        let plan = prepared(client, SLOTS_SQL, &[pg_sys::TEXTARRAYOID], false);
        for row in client.select(&*plan, None, &[required.slots.clone().into()])? {
            let name = row.get::<String>(1)?.unwrap_or_default();
            let kind = row.get::<String>(2)?;
            let restart = row.get::<i64>(3)?;
            let status = row.get::<String>(4)?.unwrap_or_default();
            let confirmed = match (kind.as_deref(), restart) {
                (None, _) => Err(format!("replication slot \"{name}\" does not exist")),
                (Some("logical"), _) => Err(format!("replication slot \"{name}\" is a logical slot; feature_outbox.standby_slots names physical slots")),
                (_, None) if status == "lost" => Err(format!("replication slot \"{name}\" is invalidated (wal_status lost); its standby must be rebuilt, or the slot taken out of feature_outbox.standby_slots")),
                (_, None) => Err(format!("replication slot \"{name}\" has no confirmed position yet (no standby has streamed from it)")),
                (_, Some(lsn)) => Ok(lsn as Lsn),
            };
            standbys.push(Standby { name: format!("slot {name}"), confirmed });
        }
    }
    if required.synchronous {
        let plan = prepared(client, SYNCHRONOUS_SQL, &[], false);
        let row = client.select(&*plan, None, &[])?.first();
        let names = synchronous_names(&row.get::<String>(1)?.unwrap_or_default());
        let connected: Vec<String> = row.get::<Vec<String>>(2)?.unwrap_or_default();
        let flushed: Vec<i64> = row.get::<Vec<i64>>(3)?.unwrap_or_default();
        let walsenders: Vec<(&String, Lsn)> = connected.iter().zip(flushed.iter().map(|l| *l as Lsn)).collect();
        for name in names {
            if name == "*" {
                // Any standby may be synchronous: every connected one is required.
                standbys.extend(walsenders.iter().map(|(n, lsn)| Standby { name: format!("standby {n}"), confirmed: Ok(*lsn) }));
                continue;
            }
            // PostgreSQL matches these names case-insensitively (SyncRepGetCandidateStandbys). With
            // two walsenders of one name, the one behind counts.
            let lsn = walsenders.iter().filter(|(n, _)| n.eq_ignore_ascii_case(&name)).map(|(_, l)| *l).min();
            let confirmed = lsn.ok_or_else(|| format!("standby \"{name}\" in synchronous_standby_names is not connected"));
            standbys.push(Standby { name: format!("standby {name}"), confirmed });
        }
    }
    Ok(standbys)
}

/// Whether every required standby has confirmed `target` now, without waiting: for a batch read
/// ahead, sent ahead only when it has (else it goes out later, in its own transaction, through
/// `wait`).
pub fn confirmed(client: &SpiClient<'_>, target: Option<Lsn>) -> bool {
    let (Some(target), Some(required)) = (target, required()) else { return true };
    read_standbys(client, &required).is_ok_and(|s| holdup(target, &s).is_none())
}

/// How long a batch waits for its standbys inside its transaction, holding its row locks and
/// transaction id. A streaming standby confirms within a millisecond or two of the flush; one that
/// does not within this is behind, and the batch is let go and waited for outside any transaction
/// (`wait_outside`): a transaction left open for the length of a standby's outage would hold back
/// VACUUM and every CREATE INDEX CONCURRENTLY and logical slot creation in the database.
const IN_TRANSACTION: Duration = Duration::from_millis(100);

/// The gate's memory across batches: since when publishing has been held (for
/// standby_wait_timeout, which counts across the retries of a batch), and what was last said of a
/// standby that cannot confirm, so that a long wait logs it once.
struct Held {
    since: Option<Instant>,
    said: Option<String>,
}

thread_local! {
    static HELD: RefCell<Held> = const { RefCell::new(Held { since: None, said: None }) };
}

/// How long to sleep between looks: short at first (a local standby confirms within a
/// millisecond of the flush), longer as the wait goes on.
fn pause(waited: Duration) -> Duration {
    if waited < Duration::from_millis(50) {
        Duration::from_micros(500)
    } else if waited < Duration::from_secs(2) {
        Duration::from_millis(5)
    } else {
        Duration::from_millis(50)
    }
}

/// What one look found.
enum Look {
    /// Every required standby has `target`, or the settings name none now.
    Confirmed,
    Behind(Holdup),
}

fn look(client: &SpiClient<'_>, target: Lsn) -> Result<Look, RelayError> {
    let Some(required) = required() else { return Ok(Look::Confirmed) };
    Ok(match holdup(target, &read_standbys(client, &required)?) {
        None => Look::Confirmed,
        Some(h) => Look::Behind(h),
    })
}

/// In the batch's transaction, before anything of it goes out: Ok when every required standby has
/// confirmed `target` (the batch's position from `read_position`) within IN_TRANSACTION, or when
/// publishing has been held past standby_wait_timeout (then with a WARNING, counted as published
/// unconfirmed). Err(StandbyBehind) otherwise: the caller lets the batch go (nothing of it was
/// sent) and calls `wait_outside`. Flushes WAL up to `target` first: under synchronous_commit =
/// off the edits' WAL may still be in memory, and a walsender sends only flushed WAL.
pub fn check(me: &WorkerSlot, client: &SpiClient<'_>, target: Option<Lsn>, what: &str) -> Result<(), RelayError> {
    let Some(target) = target else { return Ok(()) };
    unsafe { pg_sys::XLogFlush(target as pg_sys::XLogRecPtr) };
    let started = Instant::now();
    loop {
        let holdup = match look(client, target)? {
            Look::Confirmed => {
                released(me, false);
                return Ok(());
            }
            Look::Behind(h) => h,
        };
        if past_timeout() {
            let behind = holdup.problem.clone().unwrap_or_else(|| format!("{} bytes behind", holdup.bytes.unwrap_or(0)));
            warning!(
                "{}: publishing {what} unconfirmed by {} ({behind}) after feature_outbox.standby_wait_timeout ({} ms): a failover to that standby now would leave subscribers with events of edits it does not have",
                me.tag,
                holdup.standby,
                settings::millis(&settings::STANDBY_WAIT_TIMEOUT_MS).as_millis()
            );
            released(me, true);
            return Ok(());
        }
        if started.elapsed() >= IN_TRANSACTION {
            holding(me, &holdup);
            return Err(RelayError::StandbyBehind(target));
        }
        if !BackgroundWorker::wait_latch(Some(pause(started.elapsed()))) || stopping() {
            return Err(RelayError::Stopping);
        }
    }
}

/// Outside any transaction: waits until every required standby has confirmed `target`, the
/// settings name none, or standby_wait_timeout has passed since publishing was first held (the
/// next batch then goes out unconfirmed). Each look is a short read-only transaction of its own.
/// False on SIGTERM.
pub fn wait_outside(me: &WorkerSlot, target: Lsn) -> bool {
    let started = Instant::now();
    loop {
        match in_transaction_try(|| Spi::connect(|client| look(&client, target))) {
            Ok(Look::Confirmed) => return true,
            Ok(Look::Behind(h)) => holding(me, &h),
            Err(e) => {
                // The extension dropped meanwhile, say: the next batch finds out.
                warning!("{}: looking at the standbys failed: {e}", me.tag);
                return true;
            }
        }
        if past_timeout() {
            return true;
        }
        if !BackgroundWorker::wait_latch(Some(pause(started.elapsed()))) || stopping() {
            return false;
        }
        reload_if_asked();
    }
}

fn past_timeout() -> bool {
    let timeout = settings::millis(&settings::STANDBY_WAIT_TIMEOUT_MS);
    !timeout.is_zero() && HELD.with(|h| h.borrow().since.is_some_and(|t| t.elapsed() >= timeout))
}

/// Publishing is held by `holdup`: the worker's state and figures say so, and a standby that
/// cannot confirm is logged and recorded once while it lasts.
fn holding(me: &WorkerSlot, holdup: &Holdup) {
    let first = HELD.with(|h| {
        let mut h = h.borrow_mut();
        let first = h.since.is_none();
        h.since.get_or_insert_with(Instant::now);
        first
    });
    if first {
        me.standby_wait_began();
    }
    me.standby_waiting(holdup);
    say(me, holdup.problem.as_deref());
}

/// Publishing goes on: confirmed, or `unconfirmed` past standby_wait_timeout.
fn released(me: &WorkerSlot, unconfirmed: bool) {
    let was_held = HELD.with(|h| h.borrow_mut().since.take().is_some());
    if was_held || unconfirmed {
        me.standby_wait_ended(unconfirmed);
    }
    say(me, None);
}

/// Logs and records a standby that cannot confirm, once while it lasts; and once that it can again.
fn say(me: &WorkerSlot, problem: Option<&str>) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.said.as_deref() == problem {
            return;
        }
        match problem {
            Some(p) => {
                let text = format!("waiting for standby: {p}");
                log!("{}: {text}; publishing waits for it (feature_outbox.standby_slots, wait_for_synchronous_standbys)", me.tag);
                me.record_error(&text);
            }
            None => log!("{}: every standby the settings name confirms again; publishing", me.tag),
        }
        h.said = problem.map(str::to_string);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str, confirmed: Result<Lsn, &str>) -> Standby {
        Standby { name: name.into(), confirmed: confirmed.map_err(str::to_string) }
    }

    #[test]
    fn slot_lists_take_postgres_slot_names_only() {
        assert_eq!(parse_slot_list(""), Ok(vec![]));
        assert_eq!(parse_slot_list("  "), Ok(vec![]));
        assert_eq!(parse_slot_list("node_b, node_c"), Ok(vec!["node_b".to_string(), "node_c".to_string()]));
        for bad in ["Node_B", "a,,b", "a,", "a-b", "a b", &"x".repeat(64), "a,a", "*"] {
            assert!(parse_slot_list(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn synchronous_names_follow_postgres_grammar() {
        assert_eq!(synchronous_names(""), Vec::<String>::new());
        assert_eq!(synchronous_names("node2"), vec!["node2"]);
        assert_eq!(synchronous_names("\"node2\""), vec!["node2"]);
        assert_eq!(synchronous_names("a, b"), vec!["a", "b"]);
        assert_eq!(synchronous_names("FIRST 1 (a, \"B c\")"), vec!["a", "B c"]);
        assert_eq!(synchronous_names("2 (a,b,c)"), vec!["a", "b", "c"]);
        assert_eq!(synchronous_names("ANY 1 (\"x\"\"y\", z)"), vec!["x\"y", "z"]);
        assert_eq!(synchronous_names("*"), vec!["*"]);
    }

    #[test]
    fn the_standby_furthest_behind_holds_a_batch() {
        assert_eq!(holdup(100, &[]), None);
        assert_eq!(holdup(100, &[slot("a", Ok(100)), slot("b", Ok(150))]), None);
        let h = holdup(100, &[slot("a", Ok(90)), slot("b", Ok(40)), slot("c", Ok(200))]).unwrap();
        assert_eq!((h.standby.as_str(), h.bytes, h.problem), ("b", Some(60), None));
    }

    #[test]
    fn a_standby_that_cannot_confirm_holds_a_batch_and_is_named() {
        let h = holdup(100, &[slot("a", Ok(10)), slot("b", Err("gone"))]).unwrap();
        assert_eq!((h.standby.as_str(), h.bytes, h.problem.as_deref()), ("b", None, Some("gone")));
    }
}
