//! The send-ahead pipeline and the ordering rule it shares with the claim.
//!
//! The rule: a row goes out only when no earlier unpublished row of its (layer, feature) stays
//! behind, that is, every such row goes out before it, in this batch or an earlier one. A row can
//! stay behind because another transaction holds it (SKIP LOCKED skipped it, or the relock of a
//! batch read ahead could not take it). Its feature is then *passed over*: none of its rows go out,
//! and the claims leave it out, until the worker finds that row free (it looks every poll
//! interval). A row waiting for its retry time keeps its feature back in the claim's SQL, and a
//! parked row keeps nothing back (docs, Failures).
//!
//! With a backlog, the next batch is read (without locks) and built while the current one is in
//! flight; JetStream gets its first row of each feature as soon as the current batch is
//! acknowledged, before it is marked (`Batch::send_ahead`); the next transaction locks it again
//! (`Batch::relock`), under the same rule.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use pgrx::pg_sys;
use pgrx::spi::SpiClient;

use super::claim::{self, Claimed, Request};
use super::error::RelayError;
use super::transaction::relayed_at;
use crate::event::{self, Row};
use crate::plans::prepared;
use crate::sinks::{InFlight, Outcome, Sink};
use crate::subxact;

/// A feature: its layer and feature_id.
type Feature = (String, i64);

/// The ordering rule over `rows` (in id order). `blocker(i)` names the row that keeps row i back:
/// itself when this transaction could not lock it, or an earlier row of its feature that the claim
/// did not take; None when nothing does. A row goes out when nothing keeps it back and no earlier
/// row of its feature in `rows` stays behind. Returns which rows go out, and each feature passed
/// over with the row that holds it.
pub fn in_order(rows: &[Row], blocker: impl Fn(usize) -> Option<i64>) -> (Vec<bool>, Vec<(Feature, i64)>) {
    let mut behind: HashSet<(&str, i64)> = HashSet::new();
    let mut passed = Vec::new();
    let kept = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let feature = (r.layer.as_str(), r.feature_id);
            if behind.contains(&feature) {
                return false;
            }
            match blocker(i) {
                None => true,
                Some(held) => {
                    behind.insert(feature);
                    passed.push(((r.layer.clone(), r.feature_id), held));
                    false
                }
            }
        })
        .collect();
    (kept, passed)
}

/// Each row's place among its feature's rows in the batch (0 for the first).
pub fn rounds(rows: &[Row]) -> Vec<usize> {
    let mut seen: HashMap<(&str, i64), usize> = HashMap::new();
    rows.iter()
        .map(|r| {
            let n = seen.entry((r.layer.as_str(), r.feature_id)).or_insert(0);
            *n += 1;
            *n - 1
        })
        .collect()
}

/// A claimed batch with each row's event built (or why it could not be), at `relayed_at`.
#[derive(Default)]
pub struct Batch {
    pub rows: Vec<Row>,
    pub events: Vec<Result<Vec<u8>, String>>,
    pub relayed_at: String,
    /// The first row of each feature, sent ahead by the transaction before, with their outcomes to
    /// come (`send_ahead`).
    pub ahead: Option<Ahead>,
}

/// The rows of a batch sent ahead, by outbox id, and their outcomes to come.
pub struct Ahead {
    pub ids: Vec<i64>,
    pub in_flight: InFlight,
}

impl Batch {
    /// Builds each row's event. A row whose event cannot be built (a geometry GeoJSON cannot carry,
    /// a layer that cannot be read) fails alone, row-level.
    pub fn new(rows: Vec<Row>, relayed_at: String) -> Batch {
        let source = super::source();
        let events = rows
            .iter()
            .map(|row| match &row.read_error {
                Some(e) => Err(e.clone()),
                None => event::to_json(&source, row, &relayed_at).map_err(|e| format!("cannot build the event: {e}")),
            })
            .collect();
        Batch { rows, events, relayed_at, ahead: None }
    }

    /// This batch, read ahead, without the rows of features whose event in `rows` was not delivered.
    pub fn after(mut self, rows: &[Row], outcomes: &[Outcome]) -> Batch {
        let held: HashSet<(&str, i64)> = rows
            .iter()
            .zip(outcomes)
            .filter(|(_, o)| !matches!(o, Outcome::Delivered { .. }))
            .map(|(r, _)| (r.layer.as_str(), r.feature_id))
            .collect();
        if !held.is_empty() {
            let kept: Vec<bool> = self.rows.iter().map(|r| !held.contains(&(r.layer.as_str(), r.feature_id))).collect();
            self.keep(&kept);
        }
        self
    }

    /// Keeps the rows, and their events, whose entry in `kept` is true.
    fn keep(&mut self, kept: &[bool]) {
        let mut k = kept.iter().copied();
        self.events.retain(|_| k.next().unwrap_or(false));
        let mut k = kept.iter().copied();
        self.rows.retain(|_| k.next().unwrap_or(false));
    }

    /// The rows sent ahead: the first of each feature whose event was built.
    fn firsts(&self) -> Vec<usize> {
        let round = rounds(&self.rows);
        (0..self.rows.len()).filter(|&i| round[i] == 0 && self.events[i].is_ok()).collect()
    }

    /// Sends this batch read ahead's first row of each feature now, before the batch before it is
    /// marked and committed, where the sink can (JetStream). Called only once every row of that
    /// batch was acknowledged or had its feature left out (`after`), so a feature's events still go
    /// out in order. A row sent ahead that the next transaction cannot lock is sent but not marked,
    /// and its feature is passed over (`relock`); the row goes out again once free, and JetStream
    /// drops the copy by its Nats-Msg-Id.
    pub fn send_ahead(&mut self, sink: &mut dyn Sink) {
        let first = self.firsts();
        if first.is_empty() {
            return;
        }
        let bodies: Vec<&[u8]> = first.iter().map(|&i| self.events[i].as_deref().unwrap_or_default()).collect();
        let in_flight = if first.len() == self.rows.len() {
            sink.send_ahead(&self.rows, &bodies, &self.relayed_at)
        } else {
            let rows: Vec<Row> = first.iter().map(|&i| self.rows[i].clone()).collect();
            sink.send_ahead(&rows, &bodies, &self.relayed_at)
        };
        let ids = first.iter().map(|&i| self.rows[i].id).collect();
        self.ahead = in_flight.map(|in_flight| Ahead { ids, in_flight });
    }

    /// Locks this batch read ahead, in the transaction that marks it (the one that read it took no
    /// locks), and keeps the rows the ordering rule lets go: those still unpublished and locked here,
    /// and behind no row of their feature that is not.
    fn relock(mut self, client: &mut SpiClient<'_>, passed_over: &mut PassedOver) -> Result<Batch, RelayError> {
        let locked = unpublished(client, self.rows.iter().map(|r| r.id).collect(), true)?;
        let (kept, passed) = in_order(&self.rows, |i| (!locked.contains(&self.rows[i].id)).then_some(self.rows[i].id));
        passed_over.add(passed);
        self.keep(&kept);
        Ok(self)
    }
}

/// The features passed over, with the row of each that another transaction held (or published)
/// when the worker last looked.
#[derive(Default)]
pub struct PassedOver {
    features: HashMap<Feature, i64>,
    /// When the worker last looked at their rows (or passed the first one over).
    since: Option<Instant>,
}

impl PassedOver {
    fn add(&mut self, passed: Vec<(Feature, i64)>) {
        for (feature, id) in passed {
            self.features.entry(feature).or_insert(id);
        }
    }

    /// The features the claims leave out.
    fn list(&self) -> Vec<Feature> {
        self.features.keys().cloned().collect()
    }

    /// A poll interval since the last look: look whether their rows are free now.
    fn look_due(&self, poll: std::time::Duration) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= poll)
    }

    /// Keeps the features whose row is still held by another transaction. The rows that are free
    /// are locked by this one, and claimed with its batch.
    fn look(&mut self, client: &mut SpiClient<'_>) -> Result<(), RelayError> {
        let ids: Vec<i64> = self.features.values().copied().collect();
        let free = unpublished(client, ids.clone(), true)?;
        let held: HashSet<i64> = unpublished(client, ids, false)?.difference(&free).copied().collect();
        self.features.retain(|_, id| held.contains(id));
        Ok(())
    }

    /// After a transaction: the next look is due a poll interval after this one, or after the first
    /// feature passed over.
    fn settle(&mut self, looked: bool) {
        if self.features.is_empty() {
            self.since = None;
        } else if looked || self.since.is_none() {
            self.since = Some(Instant::now());
        }
    }
}

/// Of the outbox rows `ids`, those neither published nor parked; with `lock`, only those this
/// transaction could lock (FOR UPDATE SKIP LOCKED), which it then holds. Read-write either way, for
/// a snapshot taken now: one the transaction began with would miss a row published since.
fn unpublished(client: &mut SpiClient<'_>, ids: Vec<i64>, lock: bool) -> Result<HashSet<i64>, RelayError> {
    const UNPUBLISHED: &str = "SELECT id FROM feature_outbox.outbox WHERE id = ANY($1) AND published_at IS NULL AND parked_at IS NULL";
    static LOCKED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!("{UNPUBLISHED} FOR UPDATE SKIP LOCKED"));
    let plan = prepared(client, if lock { &LOCKED } else { UNPUBLISHED }, &[pg_sys::INT8ARRAYOID], true);
    let rows = client.update(&*plan, None, &[ids.into()])?;
    Ok(rows.filter_map(|r| r.get::<i64>(1).ok().flatten()).collect())
}

/// The batch a transaction sends, and whether the backlog may hold more than it shows.
pub struct Taken {
    pub batch: Batch,
    /// Rows were left out (lost to a relock, or kept back by the ordering rule): claim again
    /// before calling the backlog drained.
    pub claim_again: bool,
}

/// The pipeline's state between transactions.
#[derive(Default)]
pub struct Pipeline {
    /// The next batch, read and built while the last one was in flight.
    next: Option<Batch>,
    passed_over: PassedOver,
    /// Whether this worker logged that it pipelines (once per process).
    logged: bool,
    /// This transaction looked at the rows of the features passed over.
    looked: bool,
}

impl Pipeline {
    /// Drops the batch read ahead: the sink changed or failed, and it may have been sent ahead to
    /// the old one. It is claimed afresh.
    pub fn discard(&mut self) {
        self.next = None;
    }

    /// In the transaction: the batch to send. The one read ahead, locked now, or else a fresh claim.
    pub fn take(&mut self, client: &mut SpiClient<'_>, limit: i64, index: usize, workers: usize) -> Result<Taken, RelayError> {
        self.looked = self.passed_over.look_due(super::poll_interval());
        if self.looked {
            // Claimed afresh, with locks, after the look: a row held elsewhere may be free now.
            self.next = None;
            self.passed_over.look(client)?;
        }
        let read_ahead = self.next.is_some();
        if let Some(next) = self.next.take() {
            let batch = next.relock(client, &mut self.passed_over)?;
            if !batch.rows.is_empty() {
                return Ok(Taken { batch, claim_again: true });
            }
        }
        let (batch, left_out) = self.claim(client, &Request { limit, index, workers, passed_over: &self.passed_over.list() })?;
        Ok(Taken { batch, claim_again: read_ahead || left_out })
    }

    /// A fresh claim under the ordering rule: the rows kept back pass their features over. True
    /// when it left rows out.
    pub fn claim(&mut self, client: &mut SpiClient<'_>, request: &Request<'_>) -> Result<(Batch, bool), RelayError> {
        let Claimed { mut rows, before } = claim::claim(client, request, None)?;
        let (kept, passed) = in_order(&rows, |i| before[i]);
        let left_out = !passed.is_empty();
        self.passed_over.add(passed);
        let mut k = kept.iter().copied();
        rows.retain(|_| k.next().unwrap_or(false));
        claim::read_content(client, &mut rows)?;
        if rows.is_empty() {
            return Ok((Batch::default(), left_out));
        }
        Ok((Batch::new(rows, relayed_at(client)?), left_out))
    }

    /// Reads and builds the batch after `current` while it is in flight: from the low-water mark,
    /// without `current`'s rows and without locks, in a subtransaction, so that a failed read
    /// ahead does not cost `current` its mark.
    pub fn read_ahead(&self, client: &mut SpiClient<'_>, limit: i64, index: usize, workers: usize, current: &Batch) -> Result<Option<Batch>, RelayError> {
        let held: HashSet<i64> = current.rows.iter().map(|r| r.id).collect();
        let request = Request { limit, index, workers, passed_over: &self.passed_over.list() };
        subxact::run(|| {
            let mut rows = claim::claim(client, &request, Some(&held))?.rows;
            claim::read_content(client, &mut rows)?;
            if rows.is_empty() { Ok(None) } else { Ok(Some(Batch::new(rows, relayed_at(client)?))) }
        })
        .unwrap_or_else(|f| Err(f.into()))
    }

    /// After the transaction committed: keeps `next` for the next one. True the first time it
    /// pipelines (the worker logs it once).
    pub fn keep_next(&mut self, next: Option<Batch>) -> bool {
        self.passed_over.settle(self.looked);
        self.looked = false;
        let first = next.is_some() && !self.logged;
        self.logged |= first;
        self.next = next;
        first
    }

    /// A batch is read ahead: the backlog is not drained.
    pub fn has_next(&self) -> bool {
        self.next.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::row;

    fn rows(spec: &[(i64, &str, i64)]) -> Vec<Row> {
        spec.iter().map(|&(id, layer, feature_id)| Row { id, layer: layer.into(), feature_id, ..row() }).collect()
    }

    fn ids(rows: &[Row], kept: &[bool]) -> Vec<i64> {
        rows.iter().zip(kept).filter(|(_, k)| **k).map(|(r, _)| r.id).collect()
    }

    #[test]
    fn a_row_held_elsewhere_keeps_back_its_features_later_rows_and_no_other() {
        // Feature 1's row 10 is not claimed (held by another transaction): rows 11 and 13 would
        // overtake it. Feature 2 and feature 1 of another layer flow.
        let r = rows(&[(9, "a", 1), (11, "a", 1), (12, "a", 2), (13, "a", 1), (14, "b", 1)]);
        let before = [None, Some(10), None, Some(10), None];
        let (kept, passed) = in_order(&r, |i| before[i]);
        assert_eq!(ids(&r, &kept), [9, 12, 14]);
        assert_eq!(passed, [(("a".to_string(), 1), 10)]);
    }

    #[test]
    fn a_row_that_cannot_be_locked_keeps_back_the_rows_behind_it() {
        let r = rows(&[(1, "a", 1), (2, "a", 2), (3, "a", 1), (4, "a", 2), (5, "a", 3)]);
        let locked: HashSet<i64> = [1, 2, 3, 5].into();
        let (kept, passed) = in_order(&r, |i| (!locked.contains(&r[i].id)).then_some(r[i].id));
        // Row 4 is held: feature 2 passes over on it. Row 2, before it, goes.
        assert_eq!(ids(&r, &kept), [1, 2, 3, 5]);
        assert_eq!(passed, [(("a".to_string(), 2), 4)]);
        // Its first row held, a feature passes over on that row, and all its rows stay.
        let locked: HashSet<i64> = [2, 3, 4, 5].into();
        let (kept, passed) = in_order(&r, |i| (!locked.contains(&r[i].id)).then_some(r[i].id));
        assert_eq!(ids(&r, &kept), [2, 4, 5]);
        assert_eq!(passed, [(("a".to_string(), 1), 1)]);
    }

    #[test]
    fn nothing_held_keeps_every_row() {
        let r = rows(&[(1, "a", 1), (2, "a", 1), (3, "a", 1)]);
        let (kept, passed) = in_order(&r, |_| None);
        assert_eq!(kept, [true, true, true]);
        assert!(passed.is_empty());
    }

    #[test]
    fn a_feature_passed_over_keeps_the_first_row_that_held_it() {
        let mut p = PassedOver::default();
        p.add(vec![(("a".into(), 1), 10)]);
        p.add(vec![(("a".into(), 1), 12), (("a".into(), 2), 20)]);
        assert_eq!(p.features[&("a".to_string(), 1)], 10);
        let mut list = p.list();
        list.sort();
        assert_eq!(list, [("a".to_string(), 1), ("a".to_string(), 2)]);
        p.settle(false);
        assert!(p.since.is_some() && !p.look_due(std::time::Duration::from_secs(60)));
        p.features.clear();
        p.settle(true);
        assert!(p.since.is_none());
    }

    #[test]
    fn rounds_number_each_features_rows_in_order() {
        let r = rows(&[(1, "a", 1), (2, "a", 2), (3, "a", 1), (4, "b", 1), (5, "a", 1)]);
        assert_eq!(rounds(&r), [0, 0, 1, 0, 2]);
    }

    fn batch(r: Vec<Row>) -> Batch {
        let events = r.iter().map(|r| Ok(r.id.to_string().into_bytes())).collect();
        Batch { rows: r, events, relayed_at: "t".into(), ahead: None }
    }

    #[test]
    fn a_batch_read_ahead_loses_the_features_whose_event_before_was_not_delivered() {
        let sent = rows(&[(1, "a", 1), (2, "a", 2), (3, "a", 3)]);
        let outcomes = [Outcome::Delivered { duplicate: false }, Outcome::RowFailed("422".into()), Outcome::NotTried];
        let next = batch(rows(&[(4, "a", 1), (5, "a", 2), (6, "a", 3), (7, "a", 4), (8, "a", 2)])).after(&sent, &outcomes);
        assert_eq!(next.rows.iter().map(|r| r.id).collect::<Vec<_>>(), [4, 7]);
        assert_eq!(next.events.len(), 2);
    }

    #[test]
    fn only_each_features_first_built_row_is_sent_ahead() {
        let mut b = batch(rows(&[(1, "a", 1), (2, "a", 1), (3, "a", 2), (4, "a", 3), (5, "a", 3)]));
        b.events[3] = Err("cannot build the event".into());
        assert_eq!(b.firsts(), [0, 2]);
    }
}
