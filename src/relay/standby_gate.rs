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
//! - `feature_outbox.wait_for_synchronous_standbys`: the synchronous standbys PostgreSQL picks from
//!   `synchronous_standby_names` (FIRST n by priority, ANY n by quorum), confirmed by their
//!   walsenders' `flush_lsn`: a batch goes out once a synchronous commit of its edits would have
//!   returned. Patroni's `synchronous_mode` promotes only such a standby and keeps the list current
//!   across failovers and members leaving or joining, so one cluster-wide value follows the
//!   membership.
//!
//! A named standby that cannot confirm (a slot missing, logical or invalidated; fewer synchronous
//! standbys connected than synchronous_standby_names asks for) is waited for and said in the
//! workers view and the log, never skipped.
//! `feature_outbox.standby_wait_timeout` lets a team choose availability: past it the batch goes
//! out with a WARNING and is counted as published unconfirmed.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use pgrx::bgworkers::BackgroundWorker;
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use super::worker_slot::WorkerSlot;
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
    /// feature_outbox.standby_slots holds something that is no list of slot names (a typo in
    /// postgresql.conf, which the setting's check accepts there): the gate stays closed and says
    /// why, rather than fall open as a setting rejected at startup would (its default, none).
    pub malformed: Option<String>,
}

/// The settings' standbys, or None when neither setting names any (the default: no gate).
pub fn required() -> Option<Required> {
    let (slots, malformed) = match parse_slot_list(&settings::string(&settings::STANDBY_SLOTS)) {
        Ok(slots) => (slots, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    let synchronous = settings::WAIT_FOR_SYNCHRONOUS_STANDBYS.get();
    (synchronous || !slots.is_empty() || malformed.is_some()).then_some(Required { slots, synchronous, malformed })
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

/// How many synchronous standbys `synchronous_standby_names` asks for, and how PostgreSQL picks
/// them (syncrep_gram.y): `FIRST n (...)`, `n (...)` and a plain list (one) by priority, `ANY n
/// (...)` by quorum. None for an empty value: no synchronous standby.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncRule {
    First(usize),
    Any(usize),
}

pub fn sync_rule(value: &str) -> Option<SyncRule> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    let Some(open) = value.find('(') else { return Some(SyncRule::First(1)) };
    let mut words = value[..open].split_whitespace();
    let (any, count) = match (words.next(), words.next()) {
        (Some(w), Some(n)) if w.eq_ignore_ascii_case("any") => (true, n),
        (Some(w), Some(n)) if w.eq_ignore_ascii_case("first") => (false, n),
        (Some(n), None) => (false, n),
        _ => (false, "1"),
    };
    let n = count.parse::<usize>().unwrap_or(1).max(1);
    Some(if any { SyncRule::Any(n) } else { SyncRule::First(n) })
}

/// A walsender as pg_stat_replication shows it: its standby's application_name, the position
/// it has flushed, and PostgreSQL's own verdict on it (`sync`, `quorum`, `potential`, `async`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Walsender {
    pub name: String,
    pub flushed: Lsn,
    pub sync_state: String,
}

/// The decision for wait_for_synchronous_standbys, pure: whether `target` is flushed where a
/// synchronous commit would have waited for it. PostgreSQL's rule (SyncRepGetSyncRecPtr): under
/// FIRST n the n standbys it marks `sync` must all have it; under ANY n, n of those it marks
/// `quorum`. Fewer of them connected than asked for: nothing is confirmed (a synchronous commit
/// would wait too). An HA manager that promotes only a synchronous standby (Patroni's
/// synchronous_mode) thus never promotes one without the batch's edits.
pub fn synchronous_holdup(target: Lsn, rule: Option<SyncRule>, walsenders: &[Walsender]) -> Option<Holdup> {
    let rule = rule?;
    let (n, state, how) = match rule {
        SyncRule::First(n) => (n, "sync", "FIRST"),
        SyncRule::Any(n) => (n, "quorum", "ANY"),
    };
    let mut chosen: Vec<&Walsender> = walsenders.iter().filter(|w| w.sync_state == state).collect();
    let names = |ws: &[&Walsender]| ws.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ");
    if chosen.len() < n {
        return Some(Holdup {
            standby: format!("synchronous standbys ({how} {n})"),
            bytes: None,
            problem: Some(format!(
                "synchronous_standby_names asks for {n} synchronous standbys ({how}) and {} {} connected{}",
                chosen.len(),
                if chosen.len() == 1 { "is" } else { "are" },
                if chosen.is_empty() { String::new() } else { format!(" ({})", names(&chosen)) }
            )),
        });
    }
    // The position n of them have: under FIRST every chosen one counts; under ANY the n-th best.
    chosen.sort_by(|a, b| b.flushed.cmp(&a.flushed));
    let deciding = match rule {
        SyncRule::First(_) => chosen[chosen.len() - 1],
        SyncRule::Any(_) => chosen[n - 1],
    };
    (deciding.flushed < target).then(|| Holdup {
        standby: format!("standby {}", deciding.name),
        bytes: Some(target - deciding.flushed),
        problem: None,
    })
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
// The walsenders of physical standbys (a logical client, which PostgreSQL may count as synchronous,
// is no standby that could be promoted): what each has flushed and PostgreSQL's own synchronous
// verdict on it, read in one scan so that the three arrays line up, with synchronous_standby_names.
const SYNCHRONOUS_SQL: &str = "
SELECT pg_catalog.current_setting('synchronous_standby_names'),
       pg_catalog.array_agg(s.application_name ORDER BY s.pid),
       pg_catalog.array_agg((s.flush_lsn - '0/0'::pg_catalog.pg_lsn)::int8 ORDER BY s.pid),
       pg_catalog.array_agg(s.sync_state ORDER BY s.pid)
  FROM pg_catalog.pg_stat_replication s
 WHERE s.flush_lsn IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots r WHERE r.active_pid = s.pid AND r.slot_type = 'logical')";
const POSITION_SQL: &str = "SELECT (pg_catalog.pg_current_wal_insert_lsn() - '0/0'::pg_catalog.pg_lsn)::int8";

/// The position a batch was read at: the end of WAL inserted so far, past every commit the batch's
/// snapshot sees (a commit record is inserted before its transaction becomes visible). Read after
/// the batch's statements. None when the gate is off.
pub fn read_position(client: &SpiClient<'_>) -> Result<Option<Lsn>, RelayError> {
    if required().is_none() {
        return Ok(None);
    }
    let plan = prepared(client, POSITION_SQL, &[], false);
    Ok(client.select(&*plan, None, &[])?.first().get_one::<i64>()?.map(|l| l as Lsn))
}

/// What each named slot's standby has confirmed now.
fn read_slots(client: &SpiClient<'_>, slots: &[String]) -> Result<Vec<Standby>, RelayError> {
    let mut standbys = Vec::new();
    let plan = prepared(client, SLOTS_SQL, &[pg_sys::TEXTARRAYOID], false);
    for row in client.select(&*plan, None, &[slots.to_vec().into()])? {
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
    Ok(standbys)
}

/// synchronous_standby_names' rule and the walsenders now, when wait_for_synchronous_standbys is on.
fn read_walsenders(client: &SpiClient<'_>) -> Result<(Option<SyncRule>, Vec<Walsender>), RelayError> {
    let plan = prepared(client, SYNCHRONOUS_SQL, &[], false);
    let row = client.select(&*plan, None, &[])?.first();
    let rule = sync_rule(&row.get::<String>(1)?.unwrap_or_default());
    let names: Vec<String> = row.get::<Vec<String>>(2)?.unwrap_or_default();
    let flushed: Vec<i64> = row.get::<Vec<i64>>(3)?.unwrap_or_default();
    let states: Vec<String> = row.get::<Vec<String>>(4)?.unwrap_or_default();
    let walsenders = names
        .into_iter()
        .zip(flushed)
        .zip(states)
        .map(|((name, flushed), sync_state)| Walsender { name, flushed: flushed as Lsn, sync_state })
        .collect();
    Ok((rule, walsenders))
}

/// Which standby holds a batch read at `target` back now, if any, under the settings' rules.
fn holdup_now(client: &SpiClient<'_>, required: &Required, target: Lsn) -> Result<Option<Holdup>, RelayError> {
    if let Some(why) = &required.malformed {
        return Ok(Some(Holdup {
            standby: "feature_outbox.standby_slots".into(),
            bytes: None,
            problem: Some(format!("feature_outbox.standby_slots is not a list of slot names, so no standby can confirm: {why}")),
        }));
    }
    if !required.slots.is_empty()
        && let Some(h) = holdup(target, &read_slots(client, &required.slots)?)
    {
        return Ok(Some(h));
    }
    if required.synchronous {
        let (rule, walsenders) = read_walsenders(client)?;
        return Ok(synchronous_holdup(target, rule, &walsenders));
    }
    Ok(None)
}

/// Whether every required standby has confirmed `target` now, without waiting: for a batch read
/// ahead, sent ahead only when it has (else it goes out later, in its own transaction, through
/// `check`).
pub fn confirmed(client: &SpiClient<'_>, target: Option<Lsn>) -> bool {
    let (Some(target), Some(required)) = (target, required()) else { return true };
    holdup_now(client, &required, target).is_ok_and(|h| h.is_none())
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

/// Which standby holds `target` back now; None when every required standby has it, or the
/// settings name none now.
fn look(client: &SpiClient<'_>, target: Lsn) -> Result<Option<Holdup>, RelayError> {
    match required() {
        Some(required) => holdup_now(client, &required, target),
        None => Ok(None),
    }
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
        let Some(holdup) = look(client, target)? else {
            released(me);
            return Ok(());
        };
        if past_timeout() {
            // Availability chosen: until the standby confirms again every batch goes out at once,
            // each counted; the WARNING comes once per held period, not per batch.
            holding(me, &holdup);
            if me.standby_published_unconfirmed() {
                let behind = holdup.problem.clone().unwrap_or_else(|| format!("{} bytes behind", holdup.bytes.unwrap_or(0)));
                warning!(
                    "{}: publishing {what}, and what follows until it confirms again, unconfirmed by {} ({behind}) after feature_outbox.standby_wait_timeout ({} ms): a failover to that standby now would leave subscribers with events of edits it does not have",
                    me.tag,
                    holdup.standby,
                    settings::millis(&settings::STANDBY_WAIT_TIMEOUT_MS).as_millis()
                );
            }
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
            Ok(None) => return true,
            Ok(Some(h)) => holding(me, &h),
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

/// Publishing goes on: every required standby confirmed the batch.
fn released(me: &WorkerSlot) {
    let was_held = HELD.with(|h| h.borrow_mut().since.take().is_some());
    if was_held {
        me.standby_wait_ended();
        HELD.with(|h| {
            if h.borrow_mut().said.take().is_some() {
                me.clear_error();
            }
        });
        log!("{}: every standby the settings name has the edits again; publishing", me.tag);
    }
}

/// Logs and records a standby that cannot confirm, once while it lasts. Once it can confirm again
/// (its slot is back, it reconnected) and is merely behind, that is logged and the error cleared.
fn say(me: &WorkerSlot, problem: Option<&str>) {
    HELD.with(|h| {
        let mut h = h.borrow_mut();
        if h.said.as_deref() == problem {
            return;
        }
        match (problem, &h.said) {
            (Some(p), _) => {
                let text = format!("waiting for standby: {p}");
                log!("{}: {text}; publishing waits for it (feature_outbox.standby_slots, wait_for_synchronous_standbys)", me.tag);
                me.record_error(&text);
            }
            (None, Some(_)) => {
                log!("{}: the standbys the settings name can confirm again; publishing waits for them to catch up", me.tag);
                me.clear_error();
            }
            (None, None) => {}
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
    fn synchronous_rules_follow_postgres_grammar() {
        assert_eq!(sync_rule(""), None);
        assert_eq!(sync_rule("\"node-2\""), Some(SyncRule::First(1)));
        assert_eq!(sync_rule("a, b"), Some(SyncRule::First(1)));
        assert_eq!(sync_rule("FIRST 2 (a, \"B c\", d)"), Some(SyncRule::First(2)));
        assert_eq!(sync_rule("2 (a,b,c)"), Some(SyncRule::First(2)));
        assert_eq!(sync_rule("any 1 (\"a-2\",\"a-3\",\"a-1\")"), Some(SyncRule::Any(1)));
        assert_eq!(sync_rule("*"), Some(SyncRule::First(1)));
    }

    fn walsender(name: &str, flushed: Lsn, sync_state: &str) -> Walsender {
        Walsender { name: name.into(), flushed, sync_state: sync_state.into() }
    }

    #[test]
    fn under_first_every_synchronous_standby_must_have_the_batch() {
        let ws = [walsender("n2", 90, "sync"), walsender("n3", 10, "async")];
        let h = synchronous_holdup(100, Some(SyncRule::First(1)), &ws).unwrap();
        assert_eq!((h.standby.as_str(), h.bytes), ("standby n2", Some(10)));
        // An asynchronous standby far behind holds nothing back.
        assert_eq!(synchronous_holdup(80, Some(SyncRule::First(1)), &ws), None);
        assert_eq!(synchronous_holdup(100, None, &ws), None);
    }

    #[test]
    fn under_any_the_quorum_decides() {
        let ws = [walsender("a-2", 150, "quorum"), walsender("a-3", 40, "quorum")];
        assert_eq!(synchronous_holdup(100, Some(SyncRule::Any(1)), &ws), None);
        let h = synchronous_holdup(100, Some(SyncRule::Any(2)), &ws).unwrap();
        assert_eq!((h.standby.as_str(), h.bytes), ("standby a-3", Some(60)));
    }

    #[test]
    fn too_few_synchronous_standbys_connected_confirms_nothing() {
        // Patroni names a member that is gone, or CloudNativePG lists the primary itself.
        let h = synchronous_holdup(1, Some(SyncRule::First(1)), &[walsender("n3", 500, "async")]).unwrap();
        assert_eq!(h.bytes, None);
        assert_eq!(h.problem.as_deref(), Some("synchronous_standby_names asks for 1 synchronous standbys (FIRST) and 0 are connected"));
        assert!(synchronous_holdup(1, Some(SyncRule::Any(2)), &[walsender("a-2", 5, "quorum")]).is_some());
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
