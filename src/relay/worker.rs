//! The relay worker's loop: wait, wake, reload, back off, run the steps. Each decision belongs to
//! a step (schema.rs, connection.rs, batch.rs, housekeeping.rs, retries.rs); this file orders them.

use std::time::Duration;

use pgrx::bgworkers::BackgroundWorker;
use pgrx::prelude::*;

use super::batch::{self, BatchEnd};
use super::connection::Connection;
use super::error::RelayError;
use super::expire::ExpireStep;
use super::housekeeping::{Housekeeping, Phase};
use super::pipeline::Pipeline;
use super::retries::Retries;
use super::schema::SchemaCheck;
use super::worker_slot::WorkerSlot;
use super::standby_gate;
use super::{poll_interval, reload_if_asked, stopping};
use crate::relay_state::WorkerState;

/// What the loop does once a wake-up's work is done.
enum Next {
    /// Sleep on the latch for at most this long; a committing edit sets it (relay_state::wake_all).
    Sleep(Duration),
    /// The sink failed: back off for this long, with no transaction open.
    BackOff(Duration),
    /// SIGTERM arrived.
    Stop,
}

pub struct Worker {
    me: WorkerSlot,
    schema: SchemaCheck,
    connection: Connection,
    pipeline: Pipeline,
    housekeeping: Housekeeping,
    retries: Retries,
    expire: ExpireStep,
}

impl Worker {
    pub fn new(me: WorkerSlot) -> Worker {
        Worker {
            housekeeping: Housekeeping::for_worker(me.index),
            me,
            schema: SchemaCheck::default(),
            connection: Connection::default(),
            pipeline: Pipeline::default(),
            retries: Retries::default(),
            expire: ExpireStep::default(),
        }
    }

    /// Runs until SIGTERM.
    pub fn run(&mut self) {
        loop {
            if stopping() {
                return;
            }
            reload_if_asked();
            match self.wake() {
                Next::Sleep(wait) => {
                    if !BackgroundWorker::wait_latch(Some(wait)) || stopping() {
                        return;
                    }
                }
                Next::BackOff(delay) => {
                    self.me.set_state(WorkerState::BackingOff);
                    if !self.connection.back_off(delay) {
                        return;
                    }
                }
                Next::Stop => return,
            }
        }
    }

    /// One wake-up: check the schema, publish until the backlog is drained, run the jobs due, and
    /// pick the next wake-up.
    fn wake(&mut self) -> Next {
        if !self.schema.ready(&self.me) {
            return Next::Sleep(poll_interval());
        }
        loop {
            // A long backlog must not delay shutdown or a settings reload.
            if stopping() {
                return Next::Stop;
            }
            reload_if_asked();
            self.housekeeping.run_due(Phase::Draining, &self.me);
            let end = self.batch();
            // Tiles between batches too, a chunk per output, so a long drain never starves them.
            self.expire.run_between_batches(&self.me, self.connection.connected());
            match end {
                Ok(BatchEnd::More) => continue,
                Ok(BatchEnd::Drained) => break,
                Err(RelayError::Stopping) => return Next::Stop,
                Err(RelayError::IdentityChanged) => {
                    // Nothing of the batch went out; the schema step decides again at once.
                    self.pipeline.discard();
                    return Next::Sleep(Duration::ZERO);
                }
                Err(RelayError::StandbyBehind(target)) => {
                    // Nothing of the batch went out; what was read ahead is read again after the wait.
                    self.pipeline.discard();
                    if !standby_gate::wait_outside(&self.me, target) {
                        return Next::Stop;
                    }
                }
                Err(RelayError::SinkDown { reason, retry_after }) => {
                    // A batch read ahead waits for no backoff: the claim after it reads it afresh.
                    self.pipeline.discard();
                    let delay = self.connection.down(&self.me, &reason, retry_after);
                    // The outputs that need no sink (a table, a URL) go on while it is down.
                    if !self.expire.drain(&self.me, None) {
                        return Next::Stop;
                    }
                    return Next::BackOff(delay);
                }
                Err(error) => {
                    // A SQL error (e.g. the extension was dropped): record it, retry after the poll interval.
                    self.me.record_error(&error.to_string());
                    warning!("{}: {error}", self.me.tag);
                    return Next::Sleep(poll_interval());
                }
            }
        }
        if !self.expire.drain(&self.me, self.connection.connected()) {
            return Next::Stop;
        }
        self.housekeeping.run_due(Phase::Idle, &self.me);
        self.me.set_state(WorkerState::Idle);
        let poll = poll_interval();
        let wait = self.retries.wait(self.housekeeping.idle_wait(poll), poll);
        Next::Sleep(self.expire.next_try().map_or(wait, |t| wait.min(t.max(Duration::from_millis(10)))))
    }

    /// One batch through the connected sink, and its figures. A sink failure comes back as SinkDown.
    fn batch(&mut self) -> Result<BatchEnd, RelayError> {
        let (sink, fresh) = self.connection.sink(&self.me)?;
        if fresh {
            self.pipeline.discard();
        }
        let (end, published) = batch::run(&self.me, sink, &mut self.pipeline)?;
        self.me.account(&published);
        if published.row_error.is_some() {
            self.retries.row_failed();
        }
        for (id, why, error) in &published.parked {
            log!("{}: outbox row {id} parked {why}: {error}", self.me.tag);
        }
        if let Some(error) = published.sink_error {
            return Err(error);
        }
        if published.claimed > 0 {
            self.connection.worked(&self.me);
        }
        Ok(end)
    }
}
