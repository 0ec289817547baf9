//! One batch, in one transaction: take it (the batch read ahead, locked now, or a fresh claim),
//! publish it while reading the next one ahead, mark it, commit.

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::error::RelayError;
use super::fault_points::crash_if_requested;
use super::identity;
use super::mark::{Published, mark};
use super::pipeline::{Pipeline, Taken};
use super::publish::publish;
use super::worker_slot::WorkerSlot;
use super::standby_gate;
use super::transaction::in_transaction_try;
use crate::relay_state::WorkerState;
use crate::settings;
use crate::sinks::{Outcome, Sink};

pub enum BatchEnd {
    /// A full batch went out, or rows were left out: claim again at once.
    More,
    Drained,
}

/// One transaction: take, publish, mark. The batch's figures come back for the worker to account.
pub fn run(me: &WorkerSlot, sink: &mut dyn Sink, pipeline: &mut Pipeline) -> Result<(BatchEnd, Published), RelayError> {
    let limit = settings::BATCH_SIZE.get() as i64;
    let (index, workers) = (me.index, me.workers);
    let mut claim_again = false;
    let (published, next) = in_transaction_try(|| {
        Spi::connect_mut(|client| {
            let Taken { mut batch, claim_again: again } = pipeline.take(client, limit, index, workers)?;
            claim_again = again;
            // Rows a restore brought are read only after the original's identity rows (pg_dump
            // orders their data so): looked at after the read, they are never relayed as this
            // database's own. Also when none waits, so that the views say held within a poll
            // interval, and the tile step stops with the relay.
            identity::unchanged(client)?;
            if batch.rows.is_empty() {
                return Ok((Published::default(), None));
            }
            me.set_state(WorkerState::Publishing);
            // Nothing goes out before the standbys the settings name have the batch's edits
            // (standby_gate.rs): a standby that lags lets the batch go, to be waited for outside
            // this transaction and claimed again.
            standby_gate::check(me, client, standby_gate::read_position(client)?, &format!("a batch of {} rows", batch.rows.len()))?;
            // Claim, read and encode the next batch while this one is in flight (JetStream's
            // PubAcks, HTTP's requests). It is read from the low-water mark, without this batch's
            // rows and without locks (claim.rs), and locked by the next transaction. A feature's
            // events stay in order: a sink that sends ahead gets it once this batch is acknowledged,
            // before this batch's mark (pipeline.rs); the others in the next transaction.
            let full = batch.rows.len() as i64 >= limit;
            let mut next = Ok(None);
            let mut next_read_at = None;
            let ahead = batch.ahead.take();
            let outcomes = publish(sink, &batch, ahead, || {
                if full {
                    next = pipeline.read_ahead(client, limit, index, workers, &batch);
                    next_read_at = standby_gate::read_position(client).unwrap_or(Some(u64::MAX));
                }
            });
            let next = next.unwrap_or_else(|e| {
                warning!("{}: claiming the next batch ahead failed, claiming it after this one: {e}", me.tag);
                None
            });
            crash_if_requested(&outcomes);
            // After a sink failure nothing goes on; a feature whose event here was not delivered
            // keeps its next rows back (they are claimed again, in order, later).
            let sink_failed = outcomes.iter().any(|o| matches!(o, Outcome::SinkFailed { .. }));
            let mut next = if sink_failed { None } else { next.map(|n| n.after(&batch.rows, &outcomes)) };
            // The next batch goes out now where the sink can send ahead, and the sink takes it in
            // while this one is marked and committed.
            // The standbys must have the batch read ahead too; if they do not yet, it goes out
            // in its own transaction, which waits for them.
            if let Some(next) = next.as_mut()
                && standby_gate::confirmed(client, next_read_at)
                && identity::unchanged(client).is_ok()
            {
                next.send_ahead(sink);
            }
            Ok((mark(client, &batch.rows, &outcomes)?, next))
        })
    })?;
    if pipeline.keep_next(next) {
        log!("{}: a backlog: claiming each next batch while the last one is in flight", me.tag);
    }
    unsafe { pg_sys::pgstat_report_stat(false) };
    let more = published.claimed as i64 >= limit || published.not_tried > 0 || pipeline.has_next() || claim_again;
    Ok((if more { BatchEnd::More } else { BatchEnd::Drained }, published))
}
