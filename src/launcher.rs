//! The launcher: one background worker per cluster, connected to no database. Each tick it reads
//! pg_database, keeps an entry per served database (databases.rs), and starts the relay workers of
//! each as dynamic background workers, restarts them when they exit and stops them when the database
//! is no longer served. TimescaleDB's launcher and PostgreSQL's logical replication launcher work so.
//!
//! A database's worker 0 is also its probe: pg_extension can only be read connected to the
//! database, so worker 0 connects, looks, and leaves at once when the extension is not there. The
//! launcher starts the others once it is. A CREATE EXTENSION commit asks for a new look
//! (utility_hook.rs), so no database is probed over and over.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BackgroundWorkerStatus, BgWorkerStartTime, DynamicBackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::databases::{self, Served};
use crate::relay_state::{Database, MAX_DATABASES, MAX_WORKERS, Presence, RELAY, Slot, WorkerState};
use crate::settings;

/// How often the launcher looks without being woken.
const TICK: Duration = Duration::from_millis(250);
/// A worker that exited sooner than this after its start is started again only this long after.
const QUICK_EXIT: Duration = Duration::from_secs(1);

/// Registers the launcher. Called from `_PG_init` while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("feature_outbox launcher")
        .set_type("feature_outbox launcher")
        .set_library("feature_outbox")
        .set_function("feature_outbox_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(1)))
        .load();
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn feature_outbox_launcher_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(None, None);
    {
        let mut shared = RELAY.exclusive();
        shared.launcher_latch = unsafe { pg_sys::MyLatch } as usize;
    }
    unsafe { pg_sys::before_shmem_exit(Some(forget_launcher), pg_sys::Datum::from(0)) };
    let mut launcher = Launcher::default();
    loop {
        if crate::relay::stopping() {
            break;
        }
        crate::relay::reload_if_asked();
        launcher.tick();
        if !BackgroundWorker::wait_latch(Some(TICK)) {
            break;
        }
    }
    // Exit 1: after pg_terminate_backend the postmaster starts the launcher again. The workers it
    // started run on meanwhile; the next launcher finds them in shared memory.
    crate::relay::exit_process(1);
}

#[pg_guard]
unsafe extern "C-unwind" fn forget_launcher(_code: i32, _arg: pg_sys::Datum) {
    let mut shared = RELAY.exclusive();
    shared.launcher_latch = 0;
}

/// A worker this launcher registered: the handle tells whether the postmaster ever started it.
struct Started {
    handle: DynamicBackgroundWorker,
    database: u32,
    index: u16,
    at: Instant,
}

#[derive(Default)]
struct Launcher {
    started: HashMap<usize, Started>,
    /// Capture workers (src/capture/) started, by database.
    captures: HashMap<u32, (DynamicBackgroundWorker, Instant)>,
    /// (database, index) of workers that exited soon after their start, and when.
    quick_exits: HashMap<(u32, u16), Instant>,
    /// Workers that could not be registered, logged once until they are.
    unregistered: HashSet<(u32, u16)>,
    full_logged: bool,
    /// Databases named in feature_outbox.database that do not exist, logged once until they do.
    missing: HashSet<String>,
}

/// What one tick decided under the lock, done after it.
#[derive(Default)]
struct Plan {
    signal: Vec<i32>,
    /// (slot, database, index, database name)
    start: Vec<(usize, u32, u16, String)>,
    /// Workers for which no slot was free: (database, index, name).
    no_slot: Vec<(u32, u16, String)>,
    /// Capture workers to start: (database, name).
    capture: Vec<(u32, String)>,
}

/// The quick-exit key of a database's capture worker, beside its relay workers' indexes.
const CAPTURE_KEY: u16 = u16::MAX;

impl Launcher {
    fn tick(&mut self) {
        let catalog = BackgroundWorker::transaction(databases::scan);
        let served = Served::now();
        let wanted: HashMap<u32, String> = catalog.iter().filter(|d| d.served_by(&served)).map(|d| (d.oid, d.name.clone())).collect();
        let workers = settings::RELAY_WORKERS.get().clamp(0, MAX_WORKERS as i32) as u16;
        self.log_missing(&served, &catalog);
        self.forget_stopped();
        // relay_workers = 0 relays nothing: not even a probe runs.
        let wanted = if workers == 0 { HashMap::new() } else { wanted };
        let plan = self.plan(&wanted, workers);
        for (database, index, name) in plan.no_slot {
            self.unregistered_worker(database, index, &name, "all feature_outbox relay slots are in use");
        }
        for (slot, database, index, name) in plan.start {
            self.start(slot, database, index, &name);
        }
        for (database, name) in plan.capture {
            self.start_capture(database, &name);
        }
    }

    /// Says once which named databases do not exist (yet): they are served once created.
    fn log_missing(&mut self, served: &Served, catalog: &[databases::Catalogued]) {
        let Served::Named(names) = served else {
            self.missing.clear();
            return;
        };
        self.missing.retain(|n| names.contains(n) && !catalog.iter().any(|d| d.name == *n));
        for name in names.iter().filter(|n| !catalog.iter().any(|d| d.name == **n)) {
            if self.missing.insert(name.clone()) {
                log!("feature_outbox launcher: database \"{name}\" does not exist (see feature_outbox.database); it is served once it is created");
            }
        }
    }

    /// Drops the handles of workers that have stopped, and frees the slot of one that never ran.
    fn forget_stopped(&mut self) {
        let stopped: Vec<usize> =
            self.started.iter().filter(|(_, s)| matches!(s.handle.pid(), Err(BackgroundWorkerStatus::Stopped | BackgroundWorkerStatus::PostmasterDied))).map(|(slot, _)| *slot).collect();
        for slot in stopped {
            let Some(s) = self.started.remove(&slot) else { continue };
            let mut shared = RELAY.exclusive();
            // A probe that found no extension leaves at once by design; a CREATE EXTENSION right
            // after must not wait out the throttle meant for workers that fail as they start.
            let looked = shared.database(s.database).is_some_and(|d| matches!(d.presence, Presence::Absent | Presence::Unknown));
            if s.at.elapsed() < QUICK_EXIT && !looked {
                self.quick_exits.insert((s.database, s.index), Instant::now());
            }
            let slot = &mut shared.slots[slot];
            // Never started (no process), or gone before it attached: no exit callback freed it.
            if slot.claimed && slot.pid == 0 && slot.database == s.database && slot.index == s.index {
                slot.claimed = false;
                slot.state = WorkerState::Stopped;
            }
        }
        let stopped: Vec<u32> =
            self.captures.iter().filter(|(_, (h, _))| matches!(h.pid(), Err(BackgroundWorkerStatus::Stopped | BackgroundWorkerStatus::PostmasterDied))).map(|(d, _)| *d).collect();
        for database in stopped {
            let Some((_, at)) = self.captures.remove(&database) else { continue };
            if at.elapsed() < QUICK_EXIT {
                self.quick_exits.insert((database, CAPTURE_KEY), Instant::now());
            }
            if let Some(d) = RELAY.exclusive().database_mut(database)
                && d.capture.pid == 0
            {
                d.capture.claimed = false; // never attached: no exit callback freed it
            }
        }
        self.quick_exits.retain(|_, at| at.elapsed() < QUICK_EXIT);
    }

    fn plan(&mut self, wanted: &HashMap<u32, String>, workers: u16) -> Plan {
        let mut plan = Plan::default();
        let mut shared = RELAY.exclusive();
        let shared = &mut *shared;
        // Databases no longer served (dropped, renamed out of the list, now a template): stop their
        // workers; forget the entry once none is left.
        for d in shared.databases.iter_mut().filter(|d| d.oid != 0 && !wanted.contains_key(&d.oid)) {
            let running: Vec<&Slot> = shared.slots.iter().filter(|s| s.serves(d.oid)).collect();
            plan.signal.extend(running.iter().filter(|s| s.pid != 0).map(|s| s.pid));
            plan.signal.extend((d.capture.pid != 0).then_some(d.capture.pid));
            if running.is_empty() && !d.capture.claimed && d.paused == 0 {
                *d = Database::default();
            }
        }
        for (oid, name) in wanted {
            match shared.databases.iter_mut().find(|d| d.oid == *oid) {
                Some(d) => {
                    if d.name() != *name {
                        d.set_name(name); // ALTER DATABASE ... RENAME TO
                    }
                }
                None => match shared.add_database(*oid, name) {
                    Some(_) => {}
                    None if !self.full_logged => {
                        warning!("feature_outbox launcher: more than {MAX_DATABASES} databases to serve; database \"{name}\" is not served");
                        self.full_logged = true;
                    }
                    None => {}
                },
            }
        }
        for d in shared.databases.iter_mut().filter(|d| d.oid != 0 && wanted.contains_key(&d.oid) && d.paused == 0) {
            if d.presence == Presence::Present && d.capture.wanted && !d.capture.claimed && !self.quick_exits.contains_key(&(d.oid, CAPTURE_KEY)) {
                d.capture.claimed = true;
                plan.capture.push((d.oid, d.name()));
            }
            if std::mem::take(&mut d.restart) {
                // Its settings changed: each worker reads them when it connects.
                plan.signal.extend(shared.slots.iter().filter(|s| s.serves(d.oid) && s.pid != 0).map(|s| s.pid));
            }
            let indexes: Vec<u16> = match d.presence {
                Presence::Unknown => vec![0],
                Presence::Present => (0..workers).collect(),
                // Worker 0 gone before it looked (a crash, a terminate): look again.
                Presence::Probing if !shared.slots.iter().any(|s| s.serves(d.oid) && s.index == 0) => vec![0],
                Presence::Probing | Presence::Absent => vec![],
            };
            for index in indexes {
                if shared.slots.iter().any(|s| s.serves(d.oid) && s.index == index) || self.quick_exits.contains_key(&(d.oid, index)) {
                    continue;
                }
                // The slot this worker had before keeps its counters; else a free one.
                let free = shared.slots.iter().position(|s| !s.claimed && s.pid == 0 && s.database == d.oid && s.index == index);
                let free = free.or_else(|| shared.slots.iter().position(|s| !s.claimed && s.pid == 0 && s.database == 0));
                let free = free.or_else(|| shared.slots.iter().position(|s| !s.claimed && s.pid == 0));
                let Some(free) = free else {
                    plan.no_slot.push((d.oid, index, d.name()));
                    continue;
                };
                let slot = &mut shared.slots[free];
                if slot.database != d.oid || slot.index != index {
                    *slot = Slot::default();
                }
                slot.claimed = true;
                slot.database = d.oid;
                slot.index = index;
                slot.workers = workers;
                slot.state = WorkerState::Starting;
                if d.presence == Presence::Unknown {
                    d.presence = Presence::Probing;
                }
                plan.start.push((free, d.oid, index, d.name()));
            }
        }
        // Under the lock: a worker releases its slot (and its pid) only under it, so each pid here
        // is still that worker's.
        for pid in &plan.signal {
            unsafe { libc::kill(*pid, libc::SIGTERM) };
        }
        plan
    }

    /// Registers the worker for `slot`. When max_worker_processes is used up, frees the slot and
    /// says which worker of which database could not start, in the log (once) and in the database's
    /// entry, where its backlog view and relay_databases show it.
    fn start(&mut self, slot: usize, database: u32, index: u16, name: &str) {
        // SAFETY: the launcher is single-threaded; the handle must outlive this tick's context.
        let handle = unsafe { pgrx::PgMemoryContexts::TopMemoryContext.switch_to(|_| {
            BackgroundWorkerBuilder::new(&format!("feature_outbox relay {index} in {name}"))
                .set_type("feature_outbox relay")
                .set_library("feature_outbox")
                .set_function("feature_outbox_relay_main")
                .set_argument((slot as i32).into_datum())
                .enable_spi_access()
                .set_start_time(BgWorkerStartTime::RecoveryFinished)
                .set_restart_time(None)
                .set_notify_pid(pg_sys::MyProcPid)
                .load_dynamic()
        }) };
        match handle {
            Ok(handle) => {
                self.started.insert(slot, Started { handle, database, index, at: Instant::now() });
                if self.unregistered.remove(&(database, index)) {
                    log!("feature_outbox launcher: relay worker {index} of database \"{name}\" started");
                    if !self.unregistered.iter().any(|(d, _)| *d == database)
                        && let Some(d) = RELAY.exclusive().database_mut(database)
                    {
                        d.set_error(None);
                    }
                }
            }
            Err(_) => {
                {
                    let mut shared = RELAY.exclusive();
                    shared.slots[slot].claimed = false;
                    shared.slots[slot].state = WorkerState::Stopped;
                }
                let why = format!("no background worker slot is free (max_worker_processes = {})", unsafe { pg_sys::max_worker_processes });
                self.unregistered_worker(database, index, name, &why);
            }
        }
    }

    /// Registers the capture worker of `database`; when no background worker slot is free, says so
    /// in the capture view and tries again at a later tick.
    fn start_capture(&mut self, database: u32, name: &str) {
        // SAFETY: as in start().
        let handle = unsafe { pgrx::PgMemoryContexts::TopMemoryContext.switch_to(|_| {
            BackgroundWorkerBuilder::new(&format!("feature_outbox capture in {name}"))
                .set_type("feature_outbox capture")
                .set_library("feature_outbox")
                .set_function("feature_outbox_capture_main")
                .set_argument((database as i64).into_datum())
                .enable_spi_access()
                .set_start_time(BgWorkerStartTime::RecoveryFinished)
                .set_restart_time(None)
                .set_notify_pid(pg_sys::MyProcPid)
                .load_dynamic()
        }) };
        let mut shared = RELAY.exclusive();
        let Some(d) = shared.database_mut(database) else { return };
        match handle {
            Ok(handle) => {
                self.captures.insert(database, (handle, Instant::now()));
            }
            Err(_) => {
                d.capture.claimed = false;
                let why = format!("could not start the capture worker: no background worker slot is free (max_worker_processes = {})", unsafe { pg_sys::max_worker_processes });
                d.capture.set_error(Some(&why));
                self.quick_exits.insert((database, CAPTURE_KEY), Instant::now());
            }
        }
    }

    fn unregistered_worker(&mut self, database: u32, index: u16, name: &str, why: &str) {
        let error = format!(
            "could not start relay worker {index} of database \"{name}\": {why}; raise max_worker_processes (docs: Many databases) and restart the server"
        );
        if let Some(d) = RELAY.exclusive().database_mut(database) {
            d.set_error(Some(&error));
        }
        if self.unregistered.insert((database, index)) {
            warning!("feature_outbox launcher: {error}");
        }
    }
}
