//! The capture worker: attach, connect, then rounds of look → read → write → advance until SIGTERM
//! or until no layer is captured. Each step's SQL is in slot.rs and sql/capture.sql; this file
//! orders them and keeps the figures the capture view shows.

use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::classify::{Classifier, Committed, Tables};
use super::pgoutput;
use super::slot::{self, SlotState};
use crate::event_origin::{self, Origin};
use crate::relay::{exit_worker, reload_if_asked, stopping};
use crate::relay_state::{Capture, RELAY, now, this_database};

/// How long an idle worker waits before it reads the slot again: the "within a second"
/// with room to spare, at a cost of one empty peek per round.
const POLL: Duration = Duration::from_millis(100);
/// After an error, or while the slot is missing.
const RETRY: Duration = Duration::from_secs(1);
/// Messages per read. PostgreSQL stops only at a commit, so one large transaction is read whole
/// (its rows' keys only: the publication lists the key columns: tens of bytes a message). Each read
/// and each advance decodes again from the slot's restart position: after a bulk write the worker
/// reads back ~2 messages per event it wrote, and at 2,000 a read that took 9-10 s of CPU after
/// 100,000 events, against 1 s now (bench/capture_bench.py).
const CHUNK_MESSAGES: i32 = 20000;
/// Past this much WAL between the slot's restart position and the flushed end, the worker writes a
/// running-transactions record (at most five a second), so that each read decodes less again.
const RETAINED_SNAPSHOT: u64 = 4 << 20;
const SNAPSHOT_EVERY: Duration = Duration::from_millis(200);
/// Rows per transaction of the worker: each is locked until it commits, so an editor of one of
/// them waits at most about this many rows' work.
const ROWS_PER_TRANSACTION: usize = 500;

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn feature_outbox_capture_main(arg: pg_sys::Datum) {
    let database = unsafe { i64::from_polymorphic_datum(arg, false, pg_sys::INT8OID) }.unwrap_or(0) as u32;
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let attached = {
        let mut shared = RELAY.exclusive();
        match shared.database_mut(database) {
            Some(d) if d.capture.claimed && d.capture.pid == 0 && d.paused == 0 => {
                d.capture.pid = unsafe { pg_sys::MyProcPid };
                d.capture.latch = unsafe { pg_sys::MyLatch } as usize;
                d.capture.state = "starting";
                // Lag counts from the first start after a server start: restarts keep it.
                if d.capture.caught_up_at == 0 {
                    d.capture.caught_up_at = now();
                }
                true
            }
            Some(d) => {
                if d.capture.pid == 0 {
                    d.capture.claimed = false;
                }
                false
            }
            None => false,
        }
    };
    if !attached {
        exit_worker();
    }
    unsafe { pg_sys::before_shmem_exit(Some(detach), pg_sys::Datum::from(database)) };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(database)), None);
    // As the relay workers: no user schema may shadow a name, and READ COMMITTED whatever the
    // server's default (each row is read again under its lock).
    BackgroundWorker::transaction(|| {
        let _ = Spi::run(
            "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false),
                    pg_catalog.set_config('default_transaction_isolation', 'read committed', false)",
        );
    });
    Worker::default().run();
    exit_worker();
}

#[pg_guard]
unsafe extern "C-unwind" fn detach(_code: i32, arg: pg_sys::Datum) {
    if let Some(d) = RELAY.exclusive().database_mut(arg.value() as u32) {
        d.capture.pid = 0;
        d.capture.latch = 0;
        d.capture.claimed = false;
        d.capture.state = "stopped";
    }
    crate::relay_state::wake_launcher();
}

/// What a round decided.
enum Next {
    /// More is waiting: read again at once.
    Again,
    Sleep(Duration),
    /// No layer is captured (the slot is dropped), or the extension is gone.
    Exit,
}

#[derive(Default)]
struct Worker {
    /// Bound to the replication origin (once per process).
    bound: bool,
    /// The end of the last decoded transaction whose events committed (the origin's position).
    written_to: u64,
    /// Where the slot was last advanced to: with no WAL flushed since, there is nothing to read.
    advanced_to: u64,
    /// The end of its last events' transaction not yet known to be on the standbys (0: none).
    events_end: u64,
    /// When it last wrote a running-transactions record (slot::log_snapshot).
    snapshot_at: Option<std::time::Instant>,
    classifier: Classifier,
    /// The last error logged, so that a repeating one is logged once.
    logged: Option<String>,
}

/// Runs `f` in a transaction of its own; an ERROR comes back as its message.
fn transaction<R>(f: impl FnOnce() -> Result<R, pgrx::spi::Error>) -> Result<R, String> {
    match crate::relay::transaction::in_transaction(f) {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(e.to_string()),
    }
}

fn update(f: impl FnOnce(&mut Capture)) {
    if let Some(d) = RELAY.exclusive().database_mut(this_database()) {
        f(&mut d.capture);
    }
}

impl Worker {
    fn run(&mut self) {
        loop {
            if stopping() {
                return;
            }
            reload_if_asked();
            let next = match self.round() {
                Ok(next) => {
                    self.logged = None;
                    next
                }
                Err(error) => {
                    self.failed(&error);
                    Next::Sleep(RETRY)
                }
            };
            match next {
                Next::Again => {}
                Next::Sleep(wait) => {
                    if !BackgroundWorker::wait_latch(Some(wait)) || stopping() {
                        return;
                    }
                }
                Next::Exit => return,
            }
        }
    }

    fn failed(&mut self, error: &str) {
        update(|c| {
            c.set_error(Some(error));
            c.state = "retrying";
        });
        if self.logged.as_deref() != Some(error) {
            warning!("feature_outbox capture: {error}");
            self.logged = Some(error.to_string());
        }
    }

    /// One round: look, read a chunk, write its events, advance the slot.
    fn round(&mut self) -> Result<Next, String> {
        let look = match transaction(slot::look) {
            Ok(look) => look,
            // DROP EXTENSION committed between its statements: look again.
            Err(_) if transaction(slot::look).is_ok_and(|l| !l.extension) => transaction(slot::look)?,
            Err(e) => return Err(e),
        };
        if !look.extension || look.layers.is_empty() {
            return self.stop(look.extension);
        }
        match look.slot {
            SlotState::Ready => {}
            SlotState::Missing => {
                let names: Vec<&str> = look.layers.values().map(|t| t.layer.as_str()).collect();
                return Err(format!(
                    "layers {} are captured, but replication slot {} does not exist (a restored copy, or a slot dropped by hand); CALL feature_outbox.capture_layer(layer) captures again from then, and drift(layer) shows what was written meanwhile",
                    names.join(", "),
                    slot::name()
                ));
            }
            SlotState::Lost => {
                return Err(format!(
                    "replication slot {} was invalidated (max_slot_wal_keep_size): changes were lost; uncapture_layer and capture_layer each layer, then CALL resync(layer)",
                    slot::name()
                ));
            }
        }
        if look.retained > RETAINED_SNAPSHOT && self.snapshot_at.is_none_or(|t| t.elapsed() >= SNAPSHOT_EVERY) {
            transaction(|| {
                slot::log_snapshot();
                Ok(())
            })?;
            self.snapshot_at = Some(std::time::Instant::now());
        }
        if !self.bound {
            self.written_to = transaction(|| {
                slot::origin_session()?;
                slot::origin_progress()
            })?;
            self.bound = true;
        }
        update(|c| c.state = "reading");
        let upto = transaction(|| Ok(slot::read_end()))?;
        // No WAL since: an idle database costs no decoding. A failover slot's read waits, inside
        // PostgreSQL, until the standbys in synchronized_standby_slots have what it decodes:
        // waited for here first, where a shutdown is heard without ending the worker.
        let messages = if upto == 0 || upto == self.advanced_to {
            Vec::new()
        } else if !self.wait_for_standbys(upto) {
            return Ok(Next::Exit);
        } else {
            match slot::hearing_sigterm(|| transaction(|| slot::peek(upto, CHUNK_MESSAGES))) {
                Some(read) => read?,
                None => return Ok(Next::Exit),
            }
        };
        let partial = messages.len() >= CHUNK_MESSAGES as usize;
        let tables = Tables { layers: look.layers, outbox: look.outbox, own_origin: slot::name() };
        self.classifier = Classifier::default();
        let mut committed = Vec::new();
        // The end of the chunk's last transaction, the worker's own included: a full chunk of only
        // its own version bumps must still move the slot on, or the next round reads it again.
        let mut last_end = 0;
        for data in &messages {
            let message = pgoutput::decode(data).map_err(|e| format!("cannot decode pgoutput's message: {e}"))?;
            if let pgoutput::Message::Commit { end_lsn, .. } = &message {
                last_end = *end_lsn;
            }
            if let Some(c) = self.classifier.feed(message, &tables)? {
                committed.push(c);
            }
        }
        // Everything up to `upto` was read, unless the chunk was full: then up to its last commit.
        let consumed_to = if partial { last_end } else { upto };
        let fresh: Vec<Committed> = committed.into_iter().filter(|c| c.end_lsn > self.written_to).collect();
        if !fresh.is_empty() {
            update(|c| c.state = "writing");
            self.write(fresh)?;
        }
        if stopping() {
            // Left part-way through the chunk: the slot stays, the next worker reads it again.
            return Ok(Next::Exit);
        }
        if self.events_end > 0 {
            if !self.wait_for_standbys(self.events_end) {
                return Ok(Next::Exit);
            }
            self.events_end = 0;
        }
        if consumed_to > 0 && consumed_to != self.advanced_to {
            transaction(|| slot::advance(consumed_to))?;
            self.advanced_to = consumed_to;
        }
        update(|c| {
            c.state = "idle";
            c.set_error(None);
            if !partial {
                c.caught_up_at = now();
            }
        });
        Ok(if partial { Next::Again } else { Next::Sleep(POLL) })
    }

    /// Waits until the standbys in `synchronized_standby_slots` have WAL up to `lsn` (see
    /// slot::standbys_have), rechecking every POLL; every 10 s a listed slot that is missing,
    /// invalidated or not connected is named in a WARNING. False: SIGTERM came first, and the slot
    /// stays where it was.
    fn wait_for_standbys(&self, lsn: u64) -> bool {
        let since = std::time::Instant::now();
        let mut said = std::time::Duration::ZERO;
        loop {
            let late = since.elapsed();
            let elevel = if late >= said + Duration::from_secs(10) { pg_sys::WARNING } else { pg_sys::DEBUG1 };
            if elevel == pg_sys::WARNING {
                said = late;
            }
            if slot::standbys_have(lsn, elevel) {
                return true;
            }
            if !BackgroundWorker::wait_latch(Some(POLL)) || stopping() {
                return false;
            }
            reload_if_asked();
        }
    }

    /// Writes the events of `committed` in transactions of about ROWS_PER_TRANSACTION rows. A
    /// transaction that completes a decoded one records its end as the origin's position. Returns
    /// early, between two transactions, once SIGTERM arrived.
    fn write(&mut self, committed: Vec<Committed>) -> Result<(), String> {
        let mut pending = Pending::default();
        for c in committed {
            for layer in &c.truncated {
                pending.work.push(Work::Truncated(layer.clone()));
            }
            for (layer, keys) in c.rows {
                for piece in keys.chunks(ROWS_PER_TRANSACTION) {
                    if pending.rows + piece.len() > ROWS_PER_TRANSACTION && pending.rows > 0 {
                        self.commit(std::mem::take(&mut pending))?;
                        // SIGTERM (pg_terminate_backend, a fast shutdown, DROP DATABASE) is only a
                        // flag: without this a 100,000-row change held the worker for minutes.
                        if stopping() {
                            return Ok(());
                        }
                    }
                    pending.rows += piece.len();
                    let after: Vec<String> = piece.iter().filter(|k| c.after_edit.contains(&(layer.clone(), (*k).clone()))).cloned().collect();
                    pending.work.push(Work::Rows(layer.clone(), piece.to_vec(), after));
                }
            }
            pending.done = Some((c.end_lsn, c.commit_time_us));
        }
        if !pending.work.is_empty() || pending.done.is_some() {
            self.commit(pending)?;
        }
        Ok(())
    }

    fn commit(&mut self, pending: Pending) -> Result<(), String> {
        let done = pending.done;
        let counts = transaction(|| {
            event_origin::with(Origin::Captured, || {
                let mut counts = [0i64; 3];
                for work in &pending.work {
                    let got = match work {
                        Work::Rows(layer, keys, after) => Spi::get_one_with_args::<Vec<Option<i64>>>(
                            "SELECT feature_outbox._capture_rows($1, $2, $3)",
                            &[layer.as_str().into(), keys.clone().into(), after.clone().into()],
                        )?,
                        Work::Truncated(layer) => {
                            Spi::get_one_with_args::<Vec<Option<i64>>>("SELECT feature_outbox._capture_truncated($1)", &[layer.as_str().into()])?
                        }
                    };
                    for (i, n) in got.unwrap_or_default().into_iter().take(3).enumerate() {
                        counts[i] += n.unwrap_or(0);
                    }
                }
                if let Some((lsn, at)) = done {
                    slot::origin_written(lsn, at)?;
                }
                Ok(counts)
            })
        })?;
        self.events_end = slot::last_commit_end();
        if let Some((lsn, _)) = done {
            self.written_to = self.written_to.max(lsn);
            crate::relay::fault_points::crash_if_capture_requested();
        }
        update(|c| {
            c.events += counts[0];
            c.refused += counts[2];
        });
        Ok(())
    }

    /// No layer is captured, or the extension is gone: drop the slot and the origin, and leave.
    /// `wanted` is cleared first, so that a capture_layer committing meanwhile starts a new worker.
    fn stop(&mut self, extension: bool) -> Result<Next, String> {
        update(|c| c.wanted = false);
        match transaction(|| slot::drop_all(extension)) {
            Ok(true) => Ok(Next::Exit),
            Ok(false) => {
                update(|c| c.wanted = true);
                Ok(Next::Again)
            }
            Err(e) => {
                update(|c| c.wanted = true);
                Err(e)
            }
        }
    }
}

/// Work for one of the worker's transactions.
#[derive(Default)]
struct Pending {
    work: Vec<Work>,
    rows: usize,
    /// The end and commit time of the last decoded transaction it completes.
    done: Option<(u64, i64)>,
}

enum Work {
    /// A layer, the keys of its changed rows, and those of them written after the application's
    /// edit in their transaction (classify.rs, `after_edit`).
    Rows(String, Vec<String>, Vec<String>),
    Truncated(String),
}
