//! The relay background workers: claim a batch with FOR UPDATE ... SKIP LOCKED, publish it, mark
//! the acknowledged rows sent, commit. Publish-then-mark gives at-least-once delivery: a crash
//! between the two republishes the same event_id, never loses it (the guide, "relay").

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::backoff;
use crate::low_water::LowWater;
use crate::plans::prepared;
use crate::claim::claim;
use crate::event::{self, Row};
use crate::relay_state::{MAX_SLOTS, Presence, RELAY, WorkerState, now, this_database};
use crate::settings;
use crate::subxact;
use crate::sinks::nats::{NatsSink, Pending};
use crate::sinks::{Outcome, Sink, SinkConfig};

/// The release whose SQL this library runs; the relay waits until the schema is at it.
const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");
const RETENTION_EVERY: Duration = Duration::from_secs(60);
/// How soon an idle worker 0 looks at the low-water mark again while a candidate waits.
const LOW_WATER_LOOK: Duration = Duration::from_millis(150);
/// How often worker 0 counts its database's unpublished rows for relay_databases, at most.
const COUNT_EVERY: Duration = Duration::from_secs(1);
/// A count that took t waits COUNT_SHARE x t before the next: counting a deep backlog every second
/// took 10 % of a draining worker's CPU (perf, 100,000 rows), now at most 1/COUNT_SHARE.
const COUNT_SHARE: u32 = 50;
/// Counting stops here: the figure is for a view, and a deep backlog must not slow its drain.
const COUNT_CAP: i64 = 1_000_000;
const RETENTION_CHUNK: i64 = 5000;
/// How often a worker backing off after failed NATS connects looks whether a server answers.
const SINK_PROBE_EVERY: Duration = Duration::from_millis(500);
const SINK_PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// Retention's scan starts this long before the newest publish time it deleted. A row's published_at
/// is taken by the mark statement, just before its transaction commits, so no row published earlier
/// than that can become visible after a run's scan has passed it.
const RETENTION_FLOOR_MARGIN_S: f64 = 600.0;

/// The database this worker connected to, set once at connect.
static WORKER_DATABASE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A relay worker, started by the launcher (launcher.rs) for one slot of shared memory, which names
/// its database and its index. It connects there (the database's per-database settings apply), and
/// leaves at once when the database is paused for a utility command or holds no extension.
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn feature_outbox_relay_main(arg: pg_sys::Datum) {
    let slot = unsafe { i32::from_polymorphic_datum(arg, false, pg_sys::INT4OID) }.unwrap_or(-1);
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    let Some(slot) = usize::try_from(slot).ok().filter(|s| *s < MAX_SLOTS) else { exit_worker() };
    let attached = {
        let mut shared = RELAY.exclusive();
        let s = shared.slots[slot];
        let open = s.claimed && shared.database(s.database).is_some_and(|d| d.paused == 0);
        let s = &mut shared.slots[slot];
        if open {
            s.pid = unsafe { pg_sys::MyProcPid };
            s.latch = unsafe { pg_sys::MyLatch } as usize;
        } else {
            s.claimed = false;
            s.state = WorkerState::Stopped;
        }
        open.then_some((s.database, s.index as usize, s.workers as usize))
    };
    let Some((database, index, workers)) = attached else { exit_worker() };
    unsafe { pg_sys::before_shmem_exit(Some(release_slot), pg_sys::Datum::from(slot)) };
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(database)), None);
    // A catalog read: inside a transaction, for its resource owner.
    let name = BackgroundWorker::transaction(|| unsafe { std::ffi::CStr::from_ptr(pg_sys::get_database_name(pg_sys::MyDatabaseId)) }.to_string_lossy().into_owned());
    let _ = WORKER_DATABASE.set(name.clone());
    // Every name the relay uses is schema-qualified or in pg_catalog; no schema of a user (say, one
    // named after the worker's role) may shadow them. READ COMMITTED whatever the server's default:
    // the claim's layer reads take a snapshot newer than the claim's (claim.rs), and a claim under
    // REPEATABLE READ would fail on every row an edit updated since the batch began.
    BackgroundWorker::transaction(|| {
        let _ = Spi::run(
            "SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false),
                    pg_catalog.set_config('default_transaction_isolation', 'read committed', false)",
        );
    });

    Relay::new(slot, index, workers, &name).run();
    // Exit 1 even on SIGTERM: a dynamic worker is never restarted by the postmaster either way, and
    // exit 1 is the code the postmaster takes for a worker's normal end. The launcher restarts it.
    exit_worker();
}

/// Ends this worker process with exit code 1: for the postmaster an ordinary end of a background
/// worker. proc_exit never returns, but the pg18 bindings do not declare it diverging.
#[allow(unreachable_code)]
pub fn exit_worker() -> ! {
    unsafe { pg_sys::proc_exit(1) };
    unreachable!("proc_exit returned")
}

#[pg_guard]
unsafe extern "C-unwind" fn release_slot(_code: i32, arg: pg_sys::Datum) {
    update_slot(arg.value(), |s| {
        s.pid = 0;
        s.latch = 0;
        s.claimed = false;
        s.state = WorkerState::Stopped;
    });
    crate::relay_state::wake_launcher();
}

pub fn update_slot(index: usize, f: impl FnOnce(&mut crate::relay_state::Slot)) {
    f(&mut RELAY.exclusive().slots[index]);
}

/// True once SIGTERM arrived. pgrx's `sigterm_received()` clears its flag when read, so a SIGTERM
/// seen by one check (say, mid-drain) would be gone for the next, and the worker would run on
/// through a fast shutdown. The handler also sets PostgreSQL's ShutdownRequestPending, which stays.
pub fn stopping() -> bool {
    BackgroundWorker::sigterm_received() || unsafe { std::ptr::read_volatile(&raw const pg_sys::ShutdownRequestPending) } != 0
}

/// Re-reads the configuration after a SIGHUP (the signal handler only sets a flag). True if it did.
pub fn reload_if_asked() -> bool {
    let asked = BackgroundWorker::sighup_received();
    if asked {
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
    asked
}

fn poll_interval() -> Duration {
    settings::millis(&settings::POLL_INTERVAL_MS)
}

/// Sleeps for `d` on the latch, ignoring commit wake-ups, until `d` passed or `stop()` holds after a
/// settings reload. False when SIGTERM arrived.
fn sleep_for(d: Duration, stop: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + d;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        if !BackgroundWorker::wait_latch(Some(left)) || stopping() {
            return false;
        }
        if reload_if_asked() && stop() {
            return true;
        }
    }
}

enum Drain {
    /// The backlog is empty, or every remaining row waits for its per-row retry time: sleep on the
    /// latch for at most this long.
    Idle(Duration),
    /// The sink failed: back off for this long with no transaction open.
    SinkDown(Duration),
}

struct Relay {
    /// This worker's slot in shared memory, its index among its database's workers, their count.
    slot: usize,
    index: usize,
    workers: usize,
    /// "feature_outbox relay <index> in <database>", the start of each line it logs.
    tag: String,
    counted_at: Option<Instant>,
    /// How long the last count took.
    count_took: Duration,
    sink: Option<(SinkConfig, Sink)>,
    sink_failures: u32,
    /// The last try failed to connect (no server answered), rather than to publish.
    connect_failed: bool,
    sink_down_logged: bool,
    /// The reason the worker last logged for waiting, so each is logged once.
    waiting_logged: Option<String>,
    last_retention: Option<Instant>,
    /// The stream-limits difference last logged, so a reconnect does not log it again.
    limits_logged: Option<String>,
    /// Worker 0 keeps the claim's low-water mark.
    low_water: LowWater,
    /// The next batch, read and encoded while the last one was in flight (on JetStream, sent ahead).
    prefetched: Option<Built>,
    /// Features passed over, with the row of each that a read ahead found and could not lock
    /// (another transaction holds it, or published it). Their rows are left out of every batch, or
    /// a later row read ahead without locks would overtake the one held. Every poll interval the
    /// worker looks again, and keeps only the features whose row is still held and unpublished.
    passed_over: HashMap<(String, i64), i64>,
    passed_over_since: Option<Instant>,
    /// Whether this worker logged that it pipelines (once per process).
    pipelined_logged: bool,
    /// A row-level failure since the last look for rows waiting for their retry time found none.
    retries_pending: bool,
    due_checked_at: Option<Instant>,
    /// The newest publish time (epoch seconds) retention has deleted, since this worker started.
    retention_floor: Option<f64>,
}

impl Relay {
    fn new(slot: usize, index: usize, workers: usize, database: &str) -> Self {
        Relay {
            slot,
            index,
            workers: workers.max(1),
            tag: format!("feature_outbox relay {index} in \"{database}\""),
            counted_at: None,
            count_took: Duration::ZERO,
            sink: None,
            sink_failures: 0,
            connect_failed: false,
            sink_down_logged: false,
            waiting_logged: None,
            last_retention: None,
            limits_logged: None,
            low_water: LowWater::default(),
            prefetched: None,
            passed_over: HashMap::new(),
            passed_over_since: None,
            pipelined_logged: false,
            retries_pending: true,
            due_checked_at: None,
            retention_floor: None,
        }
    }

    fn run(&mut self) {
        loop {
            if stopping() {
                return;
            }
            reload_if_asked();
            let wait = match self.step() {
                Drain::Idle(wait) => wait,
                Drain::SinkDown(delay) => {
                    self.set_state(WorkerState::BackingOff);
                    if !self.back_off(delay) {
                        return;
                    }
                    continue;
                }
            };
            // Idle: sleep on the latch; a committing edit_feature sets it (relay_state::wake_all).
            if !BackgroundWorker::wait_latch(Some(wait)) || stopping() {
                return;
            }
        }
    }

    /// Sleeps out a sink backoff of `delay`. A changed sink setting (say, a corrected endpoint) ends
    /// it at once. After failed connects to NATS, a server that went from refusing connections to
    /// accepting them ends it within SINK_PROBE_EVERY: the delay grew through the outage, and the
    /// server is back now. (One that answers all along, refusing the credentials, say, does not.)
    /// False on SIGTERM.
    fn back_off(&self, delay: Duration) -> bool {
        let config = Self::sink_config();
        let probe = self.connect_failed && matches!(config.scheme().as_str(), "nats" | "tls");
        let deadline = Instant::now() + delay;
        let mut was_down = probe && !crate::sinks::nats::answers(&config.endpoint, SINK_PROBE_TIMEOUT);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            let slice = if probe { left.min(SINK_PROBE_EVERY) } else { left };
            if !sleep_for(slice, || Self::sink_config() != config) {
                return false;
            }
            if Self::sink_config() != config {
                return true;
            }
            if probe {
                let up = crate::sinks::nats::answers(&config.endpoint, SINK_PROBE_TIMEOUT);
                if up && was_down {
                    return true;
                }
                was_down |= !up;
            }
        }
    }

    fn set_state(&self, state: WorkerState) {
        update_slot(self.slot, |s| s.state = state);
    }

    fn record_error(&self, error: &str) {
        let at = now();
        update_slot(self.slot, |s| s.set_error(error, at));
    }

    /// One wake-up: check the extension, publish until the backlog is drained, then retention.
    fn step(&mut self) -> Drain {
        match self.schema_ready() {
            Ok(()) => self.waiting_logged = None,
            Err(wait) => return wait,
        }
        loop {
            // A long backlog must not delay shutdown or a settings reload.
            if stopping() {
                return Drain::Idle(Duration::ZERO);
            }
            reload_if_asked();
            if self.index == 0 {
                self.count_unpublished();
            }
            match self.batch() {
                Ok(BatchEnd::More) => continue,
                Ok(BatchEnd::Drained) => break,
                Ok(BatchEnd::SinkDown(error, retry_after)) => return self.sink_down(&error, retry_after),
                Err(error) => {
                    // A SQL error (e.g. the extension was dropped): record it and retry after the poll interval.
                    self.record_error(&error);
                    warning!("{}: {error}", self.tag);
                    return Drain::Idle(poll_interval());
                }
            }
        }
        if self.index == 0 {
            self.retention();
            self.advance_low_water();
            self.count_unpublished();
        }
        self.set_state(WorkerState::Idle);
        let mut poll = poll_interval();
        if self.index == 0 && self.low_water.pending() {
            // Look at the mark again soon, so it passes the last relayed rows without new edits.
            poll = poll.min(LOW_WATER_LOOK);
        }
        // Rows waiting for a per-row retry exist only after a row-level failure: look for the
        // earliest after one, and once per poll interval (a restart, another worker's rows).
        if !self.retries_pending && self.due_checked_at.is_some_and(|t| t.elapsed() < poll_interval()) {
            return Drain::Idle(poll);
        }
        self.due_checked_at = Some(Instant::now());
        // Wake up for the earliest per-row retry if that comes before the poll interval.
        let due = in_transaction(|| {
            kept_one::<f64>(
                "SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8 FROM feature_outbox.outbox
                  WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at IS NOT NULL
                    AND id >= feature_outbox._relay_low_water()",
            )
        });
        self.retries_pending = !matches!(due, Ok(Ok(None)));
        match due {
            // A row may have come due since the claim: then look again almost at once.
            Ok(Ok(Some(secs))) => Drain::Idle(poll.min(Duration::from_secs_f64(secs.max(0.001)))),
            _ => Drain::Idle(poll),
        }
    }

    /// Ok when this database holds the extension at the library's own version. Otherwise the worker
    /// waits in a visible state, logged once per change of reason: the SQL it runs belongs to this
    /// library's release, and an older schema (new files installed, ALTER EXTENSION UPDATE not yet
    /// run) must not be claimed or marked by it. Every upgrade script ends by waking the workers at
    /// commit, so they resume at once. Without the extension the worker leaves the database.
    fn schema_ready(&mut self) -> Result<(), Drain> {
        let database = this_database();
        let installed = loop {
            let asked = RELAY.share().database(database).map_or(0, |d| d.looks_asked);
            let installed = in_transaction(|| {
                // One row always: get_one fails on none.
                kept_one::<String>("SELECT (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'feature_outbox')")
            })
            .and_then(|r| r);
            let mut shared = RELAY.exclusive();
            let Some(d) = shared.database_mut(database) else { break installed };
            match &installed {
                Ok(Some(_)) => d.presence = Presence::Present,
                // A CREATE EXTENSION committed while this look ran: a new transaction sees it.
                Ok(None) if d.looks_asked != asked => continue,
                Ok(None) => {
                    // No extension here: leave, so that the database holds no worker. Its CREATE
                    // EXTENSION asks the launcher for a new look (utility_hook.rs). A first look
                    // that finds none is the common case under `*`, and not logged.
                    let was = std::mem::replace(&mut d.presence, Presence::Absent);
                    drop(shared);
                    if was != Presence::Probing {
                        log!("{}: extension feature_outbox is not in this database (any more); leaving it", self.tag);
                    }
                    exit_worker();
                }
                Err(_) => {}
            }
            break installed;
        };
        // The reason is also recorded as the last error, where the backlog view shows it.
        let (state, reason) = match installed {
            Ok(Some(v)) if v == LIBRARY_VERSION => return Ok(()),
            Ok(Some(v)) => (
                WorkerState::WaitingForUpdate,
                format!("the schema is at version {v} and the library at {LIBRARY_VERSION}; waiting for ALTER EXTENSION feature_outbox UPDATE"),
            ),
            Ok(None) => exit_worker(), // no entry: the launcher forgot this database
            Err(e) => (WorkerState::Idle, format!("cannot read pg_extension: {e}")),
        };
        if self.waiting_logged.as_deref() != Some(reason.as_str()) {
            log!("{}: {reason}", self.tag);
            self.record_error(&reason);
            self.waiting_logged = Some(reason);
        }
        self.set_state(state);
        Err(Drain::Idle(poll_interval()))
    }

    fn sink_down(&mut self, error: &str, retry_after: Option<Duration>) -> Drain {
        self.sink = None; // reconnect from scratch next time
        self.prefetched = None;
        self.sink_failures += 1;
        self.record_error(error);
        if !self.sink_down_logged {
            log!("{}: sink down, backing off: {error}", self.tag);
            self.sink_down_logged = true;
        }
        let delay = backoff::delay(
            self.sink_failures,
            settings::millis(&settings::RETRY_BACKOFF_MIN_MS),
            settings::millis(&settings::RETRY_BACKOFF_MAX_MS),
            retry_after,
            rand::random::<f64>(),
        );
        Drain::SinkDown(delay)
    }

    fn sink_config() -> SinkConfig {
        let optional = |s: String| (!s.is_empty()).then_some(s);
        SinkConfig {
            endpoint: settings::string(&settings::ENDPOINT),
            publish_timeout: settings::millis(&settings::PUBLISH_TIMEOUT_MS),
            tls_ca_file: optional(settings::string(&settings::TLS_CA_FILE)),
            nats_credentials_file: optional(settings::string(&settings::NATS_CREDENTIALS_FILE)),
            nats_nkey_file: optional(settings::string(&settings::NATS_NKEY_FILE)),
            http_secret: optional(settings::string(&settings::HTTP_SECRET)),
            http_secret_file: optional(settings::string(&settings::HTTP_SECRET_FILE)),
            subject_prefix: settings::string(&settings::NATS_SUBJECT_PREFIX),
            legacy_subjects: settings::SUBJECT_FORMAT.get() == settings::SubjectFormat::Legacy,
            subject_resolutions: settings::subject_resolutions(),
            stream: settings::string(&settings::NATS_STREAM),
            duplicate_window: Duration::from_secs(settings::NATS_DUPLICATE_WINDOW_S.get() as u64),
            replicas: settings::NATS_REPLICAS.get() as usize,
            max_age: Duration::from_secs(settings::NATS_MAX_AGE_S.get().max(0) as u64),
            object_bucket: settings::string(&settings::NATS_OBJECT_BUCKET),
            http_max_body: settings::HTTP_MAX_BODY_KB.get().max(1) as usize * 1024,
            envelope: settings::ENVELOPE.get(),
            database: WORKER_DATABASE.get().cloned().unwrap_or_default(),
            http_concurrency: settings::HTTP_CONCURRENCY.get().max(1) as usize,
            http_batch: settings::HTTP_BATCH.get().max(1) as usize,
        }
    }

    /// The connected sink for the current settings, (re)connecting when they changed.
    fn sink(&mut self) -> Result<&mut Sink, String> {
        let config = Self::sink_config();
        if config.endpoint.is_empty() {
            return Err("feature_outbox.endpoint is not set; nothing is published".into());
        }
        if self.sink.as_ref().is_none_or(|(c, _)| *c != config) {
            self.sink = None;
            // A batch claimed ahead may have been sent ahead to the old sink: it is claimed afresh.
            self.prefetched = None;
            let sink = Sink::connect(&config, &self.tag)?;
            if let Sink::Nats(nats) = &sink
                && nats.limits_differ.is_some()
                && nats.limits_differ != self.limits_logged
            {
                log!("{}: {}", self.tag, nats.limits_differ.as_deref().unwrap_or_default());
                self.limits_logged = nats.limits_differ.clone();
            }
            self.sink = Some((config, sink));
        }
        Ok(&mut self.sink.as_mut().expect("just connected").1)
    }

    /// One transaction: claim, publish, mark. Ok(More) when a full batch went out.
    fn batch(&mut self) -> Result<BatchEnd, String> {
        // Connect outside the transaction, so a slow connect never holds row locks.
        if let Err(e) = self.sink() {
            // A batch claimed ahead waits for no backoff: the claim after it reads it afresh.
            self.prefetched = None;
            // No row was tried: count the connect attempt (a failed batch counts its rows instead).
            update_slot(self.slot, |s| s.failed_attempts += 1);
            self.connect_failed = true;
            return Ok(BatchEnd::SinkDown(e, None));
        }
        self.connect_failed = false;
        if self.index == 0 {
            // Before the claim, so a mark that moved is used at once.
            self.advance_low_water();
        }
        let look_again = self.passed_over_since.is_some_and(|t| t.elapsed() >= poll_interval());
        if look_again {
            // Claimed afresh, with locks, after the look: a row held elsewhere may be free now.
            self.prefetched = None;
        }
        let limit = settings::BATCH_SIZE.get() as i64;
        let (slot, index, workers) = (self.slot, self.index, self.workers);
        let tag = &self.tag;
        let prefetched = self.prefetched.take();
        // A batch read ahead may have lost rows to its lock (they were locked elsewhere, or left out
        // for their feature's order): then a full backlog can leave a short batch. Claim once more
        // before calling the backlog drained.
        let read_ahead = prefetched.is_some();
        // Rows of features passed over were left out of a full claim: claim again as well.
        let mut left_out = false;
        let passed_over = &mut self.passed_over;
        let sink = &mut self.sink.as_mut().expect("connected above").1;
        let (result, next) = in_transaction(|| {
            Spi::connect_mut(|client| -> Result<(Published, Option<Built>), String> {
                if look_again {
                    let held = still_held(client, passed_over.values().copied().collect())?;
                    passed_over.retain(|_, id| held.contains(id));
                }
                let batch = match prefetched {
                    Some(p) => p.relock(client, passed_over)?,
                    None => Built::default(),
                };
                let mut batch = if batch.rows.is_empty() {
                    // Rows of features passed over stay unmarked, and their locks go with this transaction.
                    let claimed = claim(client, limit, index, workers, &HashSet::new())?;
                    let n = claimed.len();
                    let rows = without(claimed, passed_over);
                    left_out = rows.len() < n;
                    if rows.is_empty() {
                        return Ok((Published::default(), None));
                    }
                    Built::new(rows, relayed_at(client)?)
                } else {
                    batch
                };
                update_slot(slot, |s| s.state = WorkerState::Publishing);
                // Claim, read and encode the next batch while this one is in flight (JetStream's
                // PubAcks, HTTP's requests). It is read from the low-water mark, without this batch's
                // rows and without locks (claim.rs), and locked by the next transaction. A feature's
                // events stay in order: JetStream gets it once this batch is acknowledged, before
                // this batch's mark (send_ahead); HTTP in the next transaction.
                let mut next: Result<Option<Built>, String> = Ok(None);
                let full = batch.rows.len() as i64 >= limit;
                let outcomes = publish(sink, &batch.rows, &batch.events, &batch.relayed_at, batch.ahead.take(), || {
                    if full {
                        // In a subtransaction: a failed claim ahead must not cost this batch its mark.
                        let held: HashSet<i64> = batch.rows.iter().map(|r| r.id).collect();
                        next = subxact::run(|| {
                            claim(client, limit, index, workers, &held).map(|rows| without(rows, passed_over)).and_then(|rows| {
                                if rows.is_empty() { Ok(None) } else { Ok(Some(Built::new(rows, relayed_at(client)?))) }
                            })
                        })
                        .unwrap_or_else(|f| Err(f.message));
                    }
                });
                let next = next.unwrap_or_else(|e| {
                    warning!("{tag}: claiming the next batch ahead failed, claiming it after this one: {e}");
                    None
                });
                crash_if_requested(&outcomes);
                // After a sink failure nothing goes on; a feature whose event here was not delivered
                // keeps its next rows back (they are claimed again, in order, later).
                let sink_failed = outcomes.iter().any(|o| matches!(o, Outcome::SinkFailed { .. }));
                let mut next = if sink_failed { None } else { next.map(|n| n.after(&batch.rows, &outcomes)) };
                // JetStream: the next batch goes out now, and the server takes it in while this one
                // is marked and committed (the worker would otherwise wait for its PubAcks later).
                if let (Some(next), Sink::Nats(nats)) = (next.as_mut(), &mut *sink) {
                    next.send_ahead(nats);
                }
                let published = mark(client, &batch.rows, &outcomes)?;
                Ok((published, next))
            })
        })
        .and_then(|r| r)?;
        if self.passed_over.is_empty() {
            self.passed_over_since = None;
        } else if look_again || self.passed_over_since.is_none() {
            self.passed_over_since = Some(Instant::now());
        }
        if next.is_some() && !self.pipelined_logged {
            log!("{}: a backlog: claiming each next batch while the last one is in flight", self.tag);
            self.pipelined_logged = true;
        }
        self.prefetched = next;
        unsafe { pg_sys::pgstat_report_stat(false) };
        self.account(&result);
        Ok(match result.sink_error {
            Some((error, retry_after)) => BatchEnd::SinkDown(error, retry_after),
            None if result.claimed as i64 >= limit || result.not_tried > 0 || self.prefetched.is_some() || read_ahead || left_out => BatchEnd::More,
            None => BatchEnd::Drained,
        })
    }

    fn account(&mut self, p: &Published) {
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
            // (A sink error is recorded by the caller; a row error just below, which sets it again.)
            if p.sink_error.is_none() {
                s.error_active = false;
            }
        });
        if let Some(e) = &p.row_error {
            self.record_error(e);
            self.retries_pending = true;
        }
        for (id, why, error) in &p.parked {
            log!("{}: outbox row {id} parked {why}: {error}", self.tag);
        }
        if p.sink_error.is_none() && p.claimed > 0 {
            if self.sink_down_logged {
                log!("{}: sink back, publishing again", self.tag);
            }
            self.sink_down_logged = false;
            self.sink_failures = 0;
        }
    }

    /// Worker 0: counts this database's unpublished rows (neither published nor parked) for
    /// relay_databases, which cannot connect to each database: at most every COUNT_EVERY, and in at
    /// most 1/COUNT_SHARE of its time.
    fn count_unpublished(&mut self) {
        if self.counted_at.is_some_and(|t| t.elapsed() < COUNT_EVERY.max(self.count_took * COUNT_SHARE)) {
            return;
        }
        let started = Instant::now();
        self.counted_at = Some(started);
        let counted = in_transaction(|| {
            kept_one::<i64>(&format!(
                "SELECT count(*) FROM (SELECT FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL
                    AND id >= feature_outbox._relay_low_water() LIMIT {COUNT_CAP}) AS unpublished"
            ))
        })
        .and_then(|r| r);
        self.count_took = started.elapsed();
        if let Ok(Some(n)) = counted {
            let at = now();
            if let Some(d) = RELAY.exclusive().database_mut(this_database()) {
                d.unpublished = n;
                d.unpublished_at = at;
            }
        }
    }

    /// One look at the claim's low-water mark (worker 0), in its own short transaction.
    fn advance_low_water(&mut self) {
        let low_water = &mut self.low_water;
        if low_water.too_soon() {
            // No transaction for nothing: a wake-up a millisecond after the last look costs none.
            // Never advance() here: the time can run out between the two looks at the clock, and
            // advance() then reads the catalog outside a transaction (a segfault, seen in make bench).
            low_water.owe();
            return;
        }
        if let Err(e) = in_transaction(|| low_water.advance()).and_then(|r| r) {
            warning!("{}: low-water mark: {e}", self.tag);
        }
    }

    /// Deletes published rows older than feature_outbox.retention, in bounded chunks, each in its
    /// own short transaction (never inside a publish transaction).
    fn retention(&mut self) {
        let retention = settings::RETENTION_S.get();
        // Every minute, or twice per retention period when that is shorter.
        let every = RETENTION_EVERY.min(Duration::from_secs(retention.max(0) as u64) / 2);
        if retention <= 0 || self.last_retention.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last_retention = Some(Instant::now());
        loop {
            // From the newest publish time deleted before, less a margin: the dead entries of rows
            // deleted earlier, which a long transaction keeps from VACUUM, are not walked again.
            let floor = self.retention_floor.map_or(f64::NEG_INFINITY, |f| f - RETENTION_FLOOR_MARGIN_S);
            let deleted = in_transaction(|| {
                Spi::connect_mut(|c| {
                    let rows = c
                        .update(
                            "WITH gone AS (
                                 DELETE FROM feature_outbox.outbox WHERE id IN (
                                     SELECT id FROM feature_outbox.outbox
                                      WHERE published_at IS NOT NULL AND published_at >= to_timestamp($3)
                                        AND published_at < now() - make_interval(secs => $1)
                                      ORDER BY published_at
                                      LIMIT $2 FOR UPDATE SKIP LOCKED)
                                 RETURNING published_at)
                             SELECT count(*), extract(epoch FROM max(published_at))::float8 FROM gone",
                            None,
                            &[(retention as f64).into(), RETENTION_CHUNK.into(), floor.into()],
                        )
                        .map_err(|e| e.to_string())?;
                    let row = rows.first();
                    let n = row.get::<i64>(1).map_err(|e| e.to_string())?.unwrap_or(0);
                    let newest = row.get::<f64>(2).map_err(|e| e.to_string())?;
                    Ok::<_, String>((n, newest))
                })
            });
            match deleted {
                Ok(Ok((n, newest))) => {
                    if let Some(t) = newest {
                        self.retention_floor = Some(self.retention_floor.map_or(t, |f| f.max(t)));
                    }
                    if n < RETENTION_CHUNK {
                        break;
                    }
                }
                Ok(Err(e)) | Err(e) => {
                    self.record_error(&format!("retention: {e}"));
                    break;
                }
            }
        }
    }
}

enum BatchEnd {
    More,
    Drained,
    SinkDown(String, Option<Duration>),
}

#[derive(Default)]
struct Published {
    claimed: usize,
    not_tried: usize,
    delivered_by_type: [i64; 5],
    duplicates: i64,
    failed: i64,
    parked: Vec<(i64, &'static str, String)>,
    row_error: Option<String>,
    sink_error: Option<(String, Option<Duration>)>,
}

/// Runs `f` in its own transaction; an ERROR (or panic) aborts the transaction and comes back as
/// Err instead of ending the worker, which BackgroundWorker::transaction would do.
fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    // Everything `f` touches is either rolled back with the transaction or plain Rust state that
    // stays consistent when a batch fails part-way.
    let f = std::panic::AssertUnwindSafe(f);
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    PgTryBuilder::new(move || {
        let f = f; // capture the whole AssertUnwindSafe, not just its field
        let r = (f.0)();
        unsafe {
            pg_sys::PopActiveSnapshot();
            pg_sys::CommitTransactionCommand();
        }
        Ok(r)
    })
    .catch_others(|e| {
        let message = match &e {
            pg_sys::panic::CaughtError::PostgresError(r) | pg_sys::panic::CaughtError::ErrorReport(r) => r.message().to_string(),
            pg_sys::panic::CaughtError::RustPanic { ereport, .. } => ereport.message().to_string(),
        };
        unsafe { pg_sys::AbortCurrentTransaction() };
        Err(message)
    })
    .execute()
}

/// The one value of a read-only statement without parameters, through its kept plan.
fn kept_one<T: FromDatum + IntoDatum>(sql: &str) -> Result<Option<T>, String> {
    Spi::connect(|client| {
        let plan = prepared(client, sql, &[], false);
        client.select(&*plan, None, &[]).and_then(|t| t.first().get_one::<T>()).map_err(|e| e.to_string())
    })
}

fn relayed_at(client: &mut SpiClient<'_>) -> Result<String, String> {
    let plan = prepared(client, "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')", &[], false);
    client
        .select(&*plan, None, &[])
        .and_then(|t| t.first().get_one::<String>())
        .map_err(|e| e.to_string())
        .map(Option::unwrap_or_default)
}

/// A claimed batch with each row's event built (or why it could not be), at `relayed_at`.
#[derive(Default)]
struct Built {
    rows: Vec<Row>,
    events: Vec<Result<Vec<u8>, String>>,
    relayed_at: String,
    /// JetStream: the first row of each feature, sent ahead by the transaction before, with their
    /// PubAcks to come (`send_ahead`).
    ahead: Option<Ahead>,
}

/// The rows of a batch sent ahead, by outbox id, and their PubAcks to come.
struct Ahead {
    ids: Vec<i64>,
    pending: Pending,
}

impl Built {
    /// Builds each row's event. A row whose event cannot be built (a geometry GeoJSON cannot carry,
    /// a layer that cannot be read) fails alone, row-level.
    fn new(rows: Vec<Row>, relayed_at: String) -> Built {
        let events = rows
            .iter()
            .map(|row| match &row.read_error {
                Some(e) => Err(e.clone()),
                None => event::to_json(row, &relayed_at).map_err(|e| format!("cannot build the event: {e}")),
            })
            .collect();
        Built { rows, events, relayed_at, ahead: None }
    }

    /// This prefetched batch without the rows of features whose event in `rows` was not delivered.
    fn after(mut self, rows: &[Row], outcomes: &[Outcome]) -> Built {
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

    /// Sends this prefetched batch's first row of each feature to JetStream now, before the batch
    /// before it is marked and committed, so that the server takes them in while the worker marks,
    /// commits and locks them again. Called only once every row of that batch was acknowledged or
    /// had its feature left out (`after`), so a feature's events still go out in order. A row sent
    /// ahead that the next transaction cannot lock (another transaction holds it) is sent but not
    /// marked, and its feature is passed over (`relock`); the row goes out again once free, and
    /// JetStream drops the copy by its Nats-Msg-Id.
    fn send_ahead(&mut self, nats: &mut NatsSink) {
        let round = rounds(&self.rows);
        let first: Vec<usize> = (0..self.rows.len()).filter(|&i| round[i] == 0 && self.events[i].is_ok()).collect();
        if first.is_empty() {
            return;
        }
        let bodies: Vec<&[u8]> = first.iter().map(|&i| self.events[i].as_deref().unwrap_or_default()).collect();
        let pending = if first.len() == self.rows.len() {
            nats.begin(&self.rows, &bodies, &self.relayed_at)
        } else {
            let rows: Vec<Row> = first.iter().map(|&i| self.rows[i].clone()).collect();
            nats.begin(&rows, &bodies, &self.relayed_at)
        };
        let ids = first.iter().map(|&i| self.rows[i].id).collect();
        self.ahead = Some(Ahead { ids, pending });
    }

    /// Locks this prefetched batch's rows, in the transaction that marks them (the one that read
    /// them ahead took no locks), keeping those still unpublished and not locked elsewhere.
    /// The features of the rows it leaves out go into `passed_over`.
    fn relock(mut self, client: &mut SpiClient<'_>, passed_over: &mut HashMap<(String, i64), i64>) -> Result<Built, String> {
        let locked = unpublished(client, self.rows.iter().map(|r| r.id).collect(), true)?;
        // A row no longer to be sent takes its feature's later rows with it (their order).
        let mut dropped: HashSet<(&str, i64)> = HashSet::new();
        let kept: Vec<bool> = self
            .rows
            .iter()
            .map(|r| {
                let feature = (r.layer.as_str(), r.feature_id);
                let keep = locked.contains(&r.id) && !dropped.contains(&feature);
                if !keep && dropped.insert(feature) {
                    passed_over.entry((r.layer.clone(), r.feature_id)).or_insert(r.id);
                }
                keep
            })
            .collect();
        self.keep(&kept);
        Ok(self)
    }
}

/// `rows` without those of the features in `passed_over`.
fn without(mut rows: Vec<Row>, passed_over: &HashMap<(String, i64), i64>) -> Vec<Row> {
    if !passed_over.is_empty() {
        rows.retain(|r| !passed_over.contains_key(&(r.layer.clone(), r.feature_id)));
    }
    rows
}

/// Of the outbox rows `ids`, those neither published nor parked; with `lock`, only those this
/// transaction could lock (FOR UPDATE SKIP LOCKED), which it then holds. Read-write either way, for
/// a snapshot taken now: one the transaction began with would miss a row published since.
fn unpublished(client: &mut SpiClient<'_>, ids: Vec<i64>, lock: bool) -> Result<HashSet<i64>, String> {
    const UNPUBLISHED: &str = "SELECT id FROM feature_outbox.outbox WHERE id = ANY($1) AND published_at IS NULL AND parked_at IS NULL";
    static LOCKED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!("{UNPUBLISHED} FOR UPDATE SKIP LOCKED"));
    let plan = prepared(client, if lock { &LOCKED } else { UNPUBLISHED }, &[pg_sys::INT8ARRAYOID], true);
    let rows = client.update(&*plan, None, &[ids.into()]).map_err(|e| e.to_string())?;
    Ok(rows.filter_map(|r| r.get::<i64>(1).ok().flatten()).collect())
}

/// Of the outbox rows `ids`, those still unpublished and held by another transaction. The others
/// that are unpublished are locked by this one, and claimed with its batch.
fn still_held(client: &mut SpiClient<'_>, ids: Vec<i64>) -> Result<HashSet<i64>, String> {
    let free = unpublished(client, ids.clone(), true)?;
    Ok(unpublished(client, ids, false)?.difference(&free).copied().collect())
}

/// Publishes the rows whose events were built, a feature's rows in id order: round k sends the k-th
/// row of each feature in the batch, and only when its feature's row of round k - 1 was delivered.
/// A row whose event could not be built fails alone and never blocks other features; its feature's
/// later rows wait (NotTried). `meanwhile` runs while round 0 is in flight: on JetStream while its
/// PubAcks come back, on HTTP while its requests are out.
fn publish(sink: &mut Sink, rows: &[Row], events: &[Result<Vec<u8>, String>], relayed_at: &str, ahead: Option<Ahead>, meanwhile: impl FnOnce()) -> Vec<Outcome> {
    let round = rounds(rows);
    let mut meanwhile = Some(meanwhile);
    // Rows sent ahead (JetStream): their outcomes come from their PubAcks, awaited after `meanwhile`.
    let mut ahead_outcomes: HashMap<i64, Outcome> = HashMap::new();
    if let (Sink::Nats(nats), Some(Ahead { ids, pending })) = (&mut *sink, ahead) {
        if let Some(f) = meanwhile.take() {
            f();
        }
        ahead_outcomes = ids.into_iter().zip(nats.finish(pending)).collect();
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; rows.len()];
    let mut blocked: HashSet<(&str, i64)> = HashSet::new();
    for k in 0..=round.iter().copied().max().unwrap_or(0) {
        let (mut send, mut bodies) = (Vec::new(), Vec::new());
        for (i, row) in rows.iter().enumerate().filter(|(i, _)| round[*i] == k) {
            if blocked.contains(&(row.layer.as_str(), row.feature_id)) {
                outcomes[i] = Some(Outcome::NotTried);
                continue;
            }
            if let Some(outcome) = ahead_outcomes.remove(&row.id) {
                outcomes[i] = Some(outcome);
                continue;
            }
            match &events[i] {
                Ok(body) => {
                    send.push(i);
                    bodies.push(body.as_slice());
                }
                Err(error) => outcomes[i] = Some(Outcome::RowFailed(error.clone())),
            }
        }
        if !send.is_empty() {
            // Usually round 0 is the whole batch: one call, no copies.
            let subset: Vec<Row>;
            let sent_rows = if send.len() == rows.len() {
                rows
            } else {
                subset = send.iter().map(|&i| rows[i].clone()).collect();
                &subset
            };
            let sent = match (&mut *sink, meanwhile.take()) {
                (Sink::Nats(nats), Some(f)) => {
                    let pending = nats.begin(sent_rows, &bodies, relayed_at);
                    f();
                    nats.finish(pending)
                }
                (Sink::Http(http), Some(f)) => http.publish_while(sent_rows, &bodies, f),
                (sink, _) => sink.publish(sent_rows, &bodies, relayed_at),
            };
            for (&i, outcome) in send.iter().zip(sent) {
                outcomes[i] = Some(outcome);
            }
        }
        for (i, row) in rows.iter().enumerate().filter(|(i, _)| round[*i] == k) {
            if !matches!(outcomes[i], Some(Outcome::Delivered { .. })) {
                blocked.insert((row.layer.as_str(), row.feature_id));
            }
        }
    }
    outcomes.into_iter().map(|o| o.unwrap_or(Outcome::NotTried)).collect()
}

/// Each row's place among its feature's rows in the batch (0 for the first).
fn rounds(rows: &[Row]) -> Vec<usize> {
    let mut seen: HashMap<(&str, i64), usize> = HashMap::new();
    rows.iter()
        .map(|r| {
            let n = seen.entry((r.layer.as_str(), r.feature_id)).or_insert(0);
            *n += 1;
            *n - 1
        })
        .collect()
}

/// Marks delivered rows sent and records failures, in the claiming transaction.
fn mark(client: &mut SpiClient<'_>, rows: &[Row], outcomes: &[Outcome]) -> Result<Published, String> {
    let mut p = Published { claimed: rows.len(), ..Default::default() };
    let mut delivered = Vec::new();
    let max_attempts = settings::MAX_ATTEMPTS.get();
    let (floor, cap) = (settings::millis(&settings::RETRY_BACKOFF_MIN_MS), settings::millis(&settings::RETRY_BACKOFF_MAX_MS));
    for (row, outcome) in rows.iter().zip(outcomes) {
        let (error, permanent, park_now) = match outcome {
            Outcome::Delivered { duplicate } => {
                delivered.push(row.id);
                if let Some(i) = crate::relay_state::EVENT_TYPES.iter().position(|t| *t == row.event_type) {
                    p.delivered_by_type[i] += 1;
                }
                p.duplicates += *duplicate as i64;
                continue;
            }
            Outcome::NotTried => {
                p.not_tried += 1;
                continue;
            }
            Outcome::SinkFailed { error, retry_after } => {
                p.sink_error.get_or_insert((error.clone(), *retry_after));
                (error, false, false)
            }
            Outcome::RowFailed(error) | Outcome::Undeliverable(error) => {
                p.row_error = Some(format!("outbox row {}: {error}", row.id));
                (error, true, matches!(outcome, Outcome::Undeliverable(_)))
            }
        };
        p.failed += 1;
        // Only row-level failures count towards parking and get a per-row retry time; a sink outage
        // is handled by the worker's backoff and never parks a row.
        let row_failures = row.row_failures + permanent as i32;
        let park = park_now || (permanent && max_attempts > 0 && row_failures >= max_attempts);
        let retry_ms = permanent.then(|| backoff::delay(row_failures as u32, floor, cap, None, rand::random::<f64>()).as_millis() as f64);
        client
            .update(
                "UPDATE feature_outbox.outbox
                    SET attempts = attempts + 1, row_failures = row_failures + $5::int, last_error = $2, last_attempt_at = now(),
                        next_attempt_at = CASE WHEN $4 OR $3::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $3 / 1000) END,
                        parked_at = CASE WHEN $4 THEN now() END
                  WHERE id = $1",
                None,
                &[row.id.into(), error.as_str().into(), retry_ms.into(), park.into(), (permanent as i32).into()],
            )
            .map_err(|e| e.to_string())?;
        if park {
            let why = if park_now { "at once (no retry can deliver it under the current settings)" } else { "after feature_outbox.max_attempts failures" };
            p.parked.push((row.id, why, error.clone()));
        }
    }
    if !delivered.is_empty() {
        let plan = prepared(client, "UPDATE feature_outbox.outbox SET published_at = clock_timestamp() WHERE id = ANY($1)", &[pg_sys::INT8ARRAYOID], true);
        client.update(&*plan, None, &[delivered.into()]).map_err(|e| e.to_string())?;
    }
    Ok(p)
}

/// Fault injection, compiled into test builds only: exit between the sink's acknowledgement and
/// the commit that marks the rows, as a crash would. The rows stay unpublished and are republished.
#[cfg(feature = "fault-injection")]
fn crash_if_requested(outcomes: &[Outcome]) {
    if !outcomes.iter().any(|o| matches!(o, Outcome::Delivered { .. })) {
        return;
    }
    let requested = std::mem::take(&mut RELAY.exclusive().crash_after_next_publish);
    if requested {
        log!("feature_outbox relay: fault injection: exiting after publish, before marking rows sent");
        exit_worker();
    }
}

#[cfg(not(feature = "fault-injection"))]
fn crash_if_requested(_outcomes: &[Outcome]) {}

/// Test builds only: the next relay batch that gets acknowledgements exits before marking them.
/// Declared by the test harness (as a superuser, outside the extension), never by the install
/// script, so test and release builds generate the same SQL.
#[cfg(feature = "fault-injection")]
#[pg_extern(sql = false)]
fn _test_crash_after_next_publish() {
    RELAY.exclusive().crash_after_next_publish = true;
}
