//! This worker's place in shared memory (its worker slot), where the monitoring views read its state
//! and figures. Named apart from PostgreSQL's replication slots, which standby_gate.rs reads.

use super::mark::Published;
use super::standby_gate::Holdup;
use crate::relay_state::{RELAY, Slot, WorkerState, now};

pub fn update_slot(index: usize, f: impl FnOnce(&mut Slot)) {
    f(&mut RELAY.exclusive().slots[index]);
}

/// Who this worker is: its slot, its index among its database's workers and their count.
pub struct WorkerSlot {
    pub slot: usize,
    pub index: usize,
    pub workers: usize,
    /// "feature_outbox relay <index> in <database>", the start of each line it logs.
    pub tag: String,
}

impl WorkerSlot {
    pub fn new(slot: usize, index: usize, workers: usize, database: &str) -> WorkerSlot {
        WorkerSlot { slot, index, workers: workers.max(1), tag: format!("feature_outbox relay {index} in \"{database}\"") }
    }

    pub fn set_state(&self, state: WorkerState) {
        update_slot(self.slot, |s| s.state = state);
    }

    /// The error the workers view shows as the last one, and the backlog view as current.
    pub fn record_error(&self, error: &str) {
        let at = now();
        update_slot(self.slot, |s| s.set_error(error, at));
    }

    /// The sink works: connected, a batch acknowledged, or an idle look found it connected.
    pub fn sink_ok(&self) {
        let at = now();
        update_slot(self.slot, |s| {
            s.sink_up = true;
            s.sink_ok_at = at;
        });
    }

    /// The sink failed at sink level (a connect, a batch, an idle look): one more sink error.
    pub fn sink_failed(&self) {
        update_slot(self.slot, |s| {
            s.sink_up = false;
            s.sink_errors += 1;
        });
    }

    /// A connect that failed: no row was tried, so the attempt counts instead.
    pub fn count_failed_connect(&self) {
        update_slot(self.slot, |s| s.failed_attempts += 1);
    }

    /// Adds a batch's figures, and clears the current error when the batch had none.
    pub fn account(&self, p: &Published) {
        let at = now();
        update_slot(self.slot, |s| {
            s.relayed_rows += p.delivered_by_type.iter().sum::<i64>();
            for (total, n) in s.relayed_by_type.iter_mut().zip(p.delivered_by_type) {
                *total += n;
            }
            s.duplicates += p.duplicates;
            s.failed_attempts += p.failed;
            if p.claimed > 0 {
                s.last_active_at = at;
            }
            // A batch without errors: the sink works, so the backlog shows no current error.
            // (A sink error is recorded by the worker as it backs off; a row error just below.)
            if p.sink_error.is_none() {
                s.error_active = false;
            }
        });
        if let Some(e) = &p.row_error {
            self.record_error(e);
        }
    }

    /// A batch begins to wait for a standby (standby_gate.rs).
    pub fn standby_wait_began(&self) {
        let at = now();
        update_slot(self.slot, |s| {
            s.standby_wait_since = at;
            s.standby_held_batches += 1;
            s.state = WorkerState::WaitingForStandby;
        });
    }

    /// What the waiting batch waits on now.
    pub fn standby_waiting(&self, holdup: &Holdup) {
        update_slot(self.slot, |s| {
            s.set_standby_waiting_on(&holdup.standby);
            s.standby_wait_bytes = holdup.bytes.map_or(-1, |b| b.min(i64::MAX as u64) as i64);
        });
    }

    /// A batch goes out unconfirmed past standby_wait_timeout while the wait goes on; true for the
    /// first of the held period (the one the WARNING names).
    pub fn standby_published_unconfirmed(&self) -> bool {
        let mut first = false;
        update_slot(self.slot, |s| {
            first = s.standby_unconfirmed_in_wait == 0;
            s.standby_unconfirmed_in_wait += 1;
            s.standby_unconfirmed_batches += 1;
            s.state = WorkerState::Publishing;
        });
        first
    }

    /// The current error is no longer current (the worker still shows it as the last one).
    pub fn clear_error(&self) {
        update_slot(self.slot, |s| s.error_active = false);
    }

    /// The wait is over: every required standby has the edits again.
    pub fn standby_wait_ended(&self) {
        update_slot(self.slot, |s| {
            s.standby_wait_since = 0;
            s.standby_wait_bytes = 0;
            s.set_standby_waiting_on("");
            s.standby_unconfirmed_in_wait = 0;
            if s.state == WorkerState::WaitingForStandby {
                s.state = WorkerState::Publishing;
            }
        });
    }
}
