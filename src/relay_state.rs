//! Relay state in shared memory: one slot per worker process and one entry per database the
//! launcher serves, read by the monitoring views and written by the launcher and the workers, so the
//! figures stay right while a worker is stuck. Also the commit-time wake-ups.

use std::sync::atomic::{AtomicBool, Ordering};

use pgrx::lwlock::PgLwLock;
use pgrx::prelude::*;
use pgrx::shmem::PGRXSharedMemory;
use pgrx::{PgXactCallbackEvent, pg_shmem_init, pg_sys, register_xact_callback};

/// Relay workers per database (feature_outbox.relay_workers).
pub const MAX_WORKERS: usize = 32;
/// Relay worker processes in the cluster, all databases together.
pub const MAX_SLOTS: usize = 128;
/// Databases the launcher keeps an entry for at once.
pub const MAX_DATABASES: usize = 64;
/// Room for a held copy's reason with the SQL that resolves it (sql/identity.sql).
const ERROR_LEN: usize = 512;
const NAME_LEN: usize = 64;
pub const EVENT_TYPES: [&str; 5] = ["created", "moved", "retired", "updated", "snapshot"];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum WorkerState {
    Stopped = 0,
    Idle = 1,
    Publishing = 2,
    BackingOff = 3,
    WaitingForUpdate = 4,
    /// Registered by the launcher, not yet connected.
    Starting = 5,
    /// The database's outbox came from another database (sql/identity.sql): its rows wait for
    /// resolve_copy().
    Held = 6,
    /// A claimed batch waits until the standbys the settings name have confirmed its WAL
    /// (relay/standby_gate.rs).
    WaitingForStandby = 7,
}

impl WorkerState {
    pub fn label(self) -> &'static str {
        match self {
            WorkerState::Stopped => "stopped",
            WorkerState::Idle => "idle",
            WorkerState::Publishing => "publishing",
            WorkerState::BackingOff => "backing off",
            WorkerState::WaitingForUpdate => "waiting for ALTER EXTENSION UPDATE",
            WorkerState::Starting => "starting",
            WorkerState::Held => "held: copy of another database",
            WorkerState::WaitingForStandby => "waiting for standby",
        }
    }
}

#[derive(Clone, Copy)]
pub struct Slot {
    /// Taken by the launcher for a worker it registers; freed when that worker exits (or never started).
    pub claimed: bool,
    /// The database the worker serves, its index (0 .. workers - 1) and the count it partitions by.
    pub database: u32,
    pub index: u16,
    pub workers: u16,
    pub pid: i32,
    /// Address of the worker's process latch: shared memory, mapped at the same address everywhere.
    pub latch: usize,
    pub state: WorkerState,
    pub relayed_rows: i64,
    pub relayed_by_type: [i64; 5],
    pub duplicates: i64,
    pub failed_attempts: i64,
    pub last_active_at: pg_sys::TimestampTz,
    pub last_error_at: pg_sys::TimestampTz,
    pub last_error: [u8; ERROR_LEN],
    /// True from an error until the worker next works without one (the sink is back): the backlog
    /// view shows only current errors, the workers view the last one either way.
    pub error_active: bool,
    /// The sink's health for metrics(): connected and working as last seen (a connect, a batch, or
    /// an idle worker's look at its connection each poll interval; for HTTP the last request).
    pub sink_up: bool,
    /// Sink-level failures (failed connects, sink outages seen by a batch or an idle look) since
    /// server start.
    pub sink_errors: i64,
    /// When the sink last worked: a connect, an acknowledged batch, or an idle look that found it
    /// connected. 0: never.
    pub sink_ok_at: pg_sys::TimestampTz,
    /// The standby gate (relay/standby_gate.rs): since when the current batch waits (0: it does
    /// not), on which standby, how many bytes it lacks (-1: it cannot confirm at all).
    pub standby_wait_since: pg_sys::TimestampTz,
    pub standby_wait_on: [u8; NAME_LEN + 16],
    pub standby_wait_bytes: i64,
    /// Batches (and tile chunks) that had to wait for a standby, and those published unconfirmed
    /// past feature_outbox.standby_wait_timeout, since server start.
    pub standby_held_batches: i64,
    pub standby_unconfirmed_batches: i64,
    /// Of those, the ones of the current wait (the WARNING comes with the first).
    pub standby_unconfirmed_in_wait: i64,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            claimed: false,
            database: 0,
            index: 0,
            workers: 0,
            pid: 0,
            latch: 0,
            state: WorkerState::Stopped,
            relayed_rows: 0,
            relayed_by_type: [0; 5],
            duplicates: 0,
            failed_attempts: 0,
            last_active_at: 0,
            last_error_at: 0,
            last_error: [0; ERROR_LEN],
            error_active: false,
            sink_up: false,
            sink_errors: 0,
            sink_ok_at: 0,
            standby_wait_since: 0,
            standby_wait_on: [0; NAME_LEN + 16],
            standby_wait_bytes: 0,
            standby_held_batches: 0,
            standby_unconfirmed_batches: 0,
            standby_unconfirmed_in_wait: 0,
        }
    }
}

/// A NUL-padded text in shared memory; None when empty.
fn read_text(buf: &[u8]) -> Option<String> {
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    (end > 0).then(|| String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Stores `text`, cut on a char boundary so that it stays valid UTF-8, leaving room for a NUL.
fn write_text(buf: &mut [u8], text: &str) {
    let mut end = text.len().min(buf.len() - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    buf.fill(0);
    buf[..end].copy_from_slice(&text.as_bytes()[..end]);
}

impl Slot {
    pub fn error_text(&self) -> Option<String> {
        read_text(&self.last_error)
    }

    /// The standby the current batch waits on, while it waits.
    pub fn standby_waiting_on(&self) -> Option<String> {
        (self.standby_wait_since != 0).then(|| read_text(&self.standby_wait_on).unwrap_or_default())
    }

    pub fn set_standby_waiting_on(&mut self, name: &str) {
        write_text(&mut self.standby_wait_on, name);
    }

    pub fn set_error(&mut self, text: &str, at: pg_sys::TimestampTz) {
        write_text(&mut self.last_error, text);
        self.last_error_at = at;
        self.error_active = true;
    }

    /// Running or about to: a process holds, or will hold, this slot for `database`.
    pub fn serves(&self, database: u32) -> bool {
        self.claimed && self.database == database
    }
}

/// Whether a served database holds the extension, as its worker 0 last found when it connected.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Presence {
    /// Not looked yet, or asked to look again (CREATE EXTENSION committed there).
    Unknown = 0,
    /// Worker 0 is connecting to look.
    Probing = 1,
    Present = 2,
    Absent = 3,
}

/// One database the launcher serves: named by feature_outbox.database (or every one, `*`), allowing
/// connections and no template.
#[derive(Clone, Copy)]
pub struct Database {
    /// 0: a free entry.
    pub oid: u32,
    name: [u8; NAME_LEN],
    pub presence: Presence,
    /// Utility commands (DROP DATABASE, ...) now running on it: no worker may connect.
    pub paused: u16,
    paused_for: [u8; 32],
    /// Its settings changed (ALTER DATABASE ... SET): the launcher restarts its workers.
    pub restart: bool,
    /// Bumped by each CREATE EXTENSION commit there: a look that began before one looks again.
    pub looks_asked: u32,
    /// The claim's low-water mark: every outbox row with a lower id is published or parked, and no
    /// transaction that could still add one below it is running (see relay/low_water.rs). 0 = unknown.
    pub low_water: i64,
    /// The outbox the mark belongs to: DROP and CREATE EXTENSION make another, whose ids start again.
    pub low_water_relid: u32,
    /// Bumped whenever rows below the mark may have become claimable again (retry_parked): a mark
    /// computed before that is discarded.
    pub low_water_generation: u64,
    /// Rows neither published nor parked, as worker 0 last counted them, and when.
    pub unpublished: i64,
    pub unpublished_at: pg_sys::TimestampTz,
    /// The launcher's error for this database (a worker it could not start), while it lasts.
    error: [u8; ERROR_LEN],
    pub error_at: pg_sys::TimestampTz,
    /// Its capture worker (src/capture/).
    pub capture: Capture,
}

/// What a database's capture worker is doing, for the launcher (whether to start one) and the
/// capture view.
#[derive(Clone, Copy)]
pub struct Capture {
    /// A layer is captured there (as capture_layer, or worker 0 at its start, last found): the
    /// launcher keeps a capture worker running. The worker clears it when it finds none.
    pub wanted: bool,
    /// The launcher started one that has not exited yet.
    pub claimed: bool,
    pub pid: i32,
    pub latch: usize,
    pub state: &'static str,
    /// When it last had read every committed change; 0 before that.
    pub caught_up_at: pg_sys::TimestampTz,
    pub events: i64,
    pub refused: i64,
    last_error: [u8; ERROR_LEN],
    pub last_error_at: pg_sys::TimestampTz,
}

impl Default for Capture {
    fn default() -> Self {
        Capture {
            wanted: false,
            claimed: false,
            pid: 0,
            latch: 0,
            state: "stopped",
            caught_up_at: 0,
            events: 0,
            refused: 0,
            last_error: [0; ERROR_LEN],
            last_error_at: 0,
        }
    }
}

impl Capture {
    pub fn last_error(&self) -> Option<String> {
        read_text(&self.last_error)
    }
    pub fn set_error(&mut self, error: Option<&str>) {
        match error {
            Some(e) => {
                write_text(&mut self.last_error, e);
                self.last_error_at = now();
            }
            None => self.last_error.fill(0),
        }
    }
}

impl Default for Database {
    fn default() -> Self {
        Database {
            oid: 0,
            name: [0; NAME_LEN],
            presence: Presence::Unknown,
            paused: 0,
            paused_for: [0; 32],
            restart: false,
            looks_asked: 0,
            low_water: 0,
            low_water_relid: 0,
            low_water_generation: 0,
            unpublished: 0,
            unpublished_at: 0,
            error: [0; ERROR_LEN],
            error_at: 0,
            capture: Capture::default(),
        }
    }
}

impl Database {
    pub fn new(oid: u32, name: &str) -> Self {
        let mut d = Database { oid, ..Default::default() };
        d.set_name(name);
        d
    }
    pub fn name(&self) -> String {
        read_text(&self.name).unwrap_or_default()
    }
    pub fn set_name(&mut self, name: &str) {
        write_text(&mut self.name, name);
    }
    pub fn paused_for(&self) -> Option<String> {
        (self.paused > 0).then(|| read_text(&self.paused_for).unwrap_or_default())
    }
    pub fn set_paused_for(&mut self, command: &str) {
        write_text(&mut self.paused_for, command);
    }
    pub fn error(&self) -> Option<String> {
        read_text(&self.error)
    }
    pub fn set_error(&mut self, error: Option<&str>) {
        match error {
            Some(e) => {
                write_text(&mut self.error, e);
                self.error_at = now();
            }
            None => {
                self.error.fill(0);
                self.error_at = 0;
            }
        }
    }
}

#[derive(Clone, Copy)]
pub struct RelayShared {
    pub slots: [Slot; MAX_SLOTS],
    pub databases: [Database; MAX_DATABASES],
    /// The launcher's process latch (0 while none runs): set to make it look at once.
    pub launcher_latch: usize,
    /// Fault injection (test builds): the next worker to get acknowledgements exits before marking.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub crash_after_next_publish: bool,
    /// Test builds: the next tile delivery exits before deleting its queued edits.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub crash_after_next_tiles: bool,
    /// Test builds: the next capture transaction that completes a decoded one exits after its
    /// commit, before the slot is advanced.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub crash_after_next_capture: bool,
    /// Test builds: the capture worker's next read of its slot first waits inside PostgreSQL.
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub stall_next_capture_read: bool,
}

impl Default for RelayShared {
    fn default() -> Self {
        RelayShared {
            slots: [Slot::default(); MAX_SLOTS],
            databases: [Database::default(); MAX_DATABASES],
            launcher_latch: 0,
            crash_after_next_publish: false,
            crash_after_next_tiles: false,
            crash_after_next_capture: false,
            stall_next_capture_read: false,
        }
    }
}

impl RelayShared {
    pub fn database(&self, oid: u32) -> Option<&Database> {
        self.databases.iter().find(|d| d.oid == oid && oid != 0)
    }
    pub fn database_mut(&mut self, oid: u32) -> Option<&mut Database> {
        self.databases.iter_mut().find(|d| d.oid == oid && oid != 0)
    }
    /// A new entry for database `oid` in a free place; None when all MAX_DATABASES are taken.
    pub fn add_database(&mut self, oid: u32, name: &str) -> Option<&mut Database> {
        let free = self.databases.iter_mut().find(|d| d.oid == 0)?;
        *free = Database::new(oid, name);
        Some(free)
    }
}

unsafe impl PGRXSharedMemory for RelayShared {}

/// The current database's OID.
pub fn this_database() -> u32 {
    unsafe { pg_sys::MyDatabaseId }.to_u32()
}

/// Sets the launcher's latch, so that it looks at the databases now rather than at its next tick.
pub fn wake_launcher() {
    let latch = RELAY.share().launcher_latch;
    if latch != 0 {
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}

pub static RELAY: PgLwLock<RelayShared> = unsafe { PgLwLock::new(c"feature_outbox_relay") };
static READY: AtomicBool = AtomicBool::new(false);

/// Requests the shared memory. Only legal while shared_preload_libraries is processed.
pub fn init() {
    pg_shmem_init!(RELAY);
    READY.store(true, Ordering::Relaxed);
}

/// False in a backend whose server did not preload the library: no relay, no shared state.
pub fn ready() -> bool {
    READY.load(Ordering::Relaxed)
}

pub fn now() -> pg_sys::TimestampTz {
    unsafe { pg_sys::GetCurrentTimestamp() }
}

thread_local! {
    /// The relay workers (bit per worker index) this transaction's edits will wake at commit.
    static WAKE_MASK: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// wake_at_end is registered (once per backend, for every transaction after).
    static WAKE_AT_END: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static WAKE_REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static RESET_REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` when this transaction commits (never before, never on abort), once however often it
/// is asked for in the transaction; `asked` remembers that it was.
fn once_at_commit(asked: &'static std::thread::LocalKey<std::cell::Cell<bool>>, f: fn()) {
    if !ready() || asked.with(|a| a.replace(true)) {
        return;
    }
    register_xact_callback(PgXactCallbackEvent::Commit, move || {
        asked.with(|a| a.set(false));
        f();
    });
    register_xact_callback(PgXactCallbackEvent::Abort, move || asked.with(|a| a.set(false)));
}

/// Called by edit_feature: at commit set every relay worker's latch, so a committed edit is
/// published without waiting for the poll interval. As pg_net does.
#[pg_extern(volatile, parallel_unsafe)]
fn _wake_relay_at_commit() {
    once_at_commit(&WAKE_REGISTERED, wake_all);
}

/// The relay worker (0 .. workers - 1) that owns `feature_id`'s events: each worker publishes only
/// its own features, so the events of one feature are never in flight in two workers. The claim
/// computes the same in SQL: `(hashint8(feature_id) & 2147483647) % workers`.
pub fn partition_of(feature_id: i64, workers: usize) -> usize {
    if workers <= 1 {
        return 0;
    }
    let hash = unsafe { pgrx::direct_function_call::<i32>(pg_sys::hashint8, &[feature_id.into_datum()]) }.unwrap_or(0);
    ((hash & 0x7fff_ffff) as usize) % workers
}

/// Called by edit_feature for each edit: when this transaction commits, set the latch of the relay
/// worker that owns `feature_id` (and only that one), unless feature_outbox.wake_at_commit is off.
#[pg_extern(volatile, parallel_unsafe)]
#[inline(never)] // a step of its own in bench/edit_steps.py
pub(crate) fn _wake_relay_for(feature_id: i64) {
    if !ready() || !crate::settings::WAKE_AT_COMMIT.get() {
        return;
    }
    let workers = crate::settings::RELAY_WORKERS.get().clamp(0, MAX_WORKERS as i32) as usize;
    if workers == 0 {
        return;
    }
    let bit = 1u32 << partition_of(feature_id, workers);
    WAKE_MASK.with(|m| m.set(m.get() | bit));
    // One callback for the backend's life, not two per transaction: pgrx's register_xact_callback
    // boxes each closure anew, about 2,000 instructions an edit.
    if !WAKE_AT_END.with(|r| r.replace(true)) {
        unsafe { pg_sys::RegisterXactCallback(Some(wake_at_end), std::ptr::null_mut()) };
    }
}

/// At the end of each transaction: sets the latches of the workers in WAKE_MASK when it committed,
/// and forgets them when it aborted or was prepared (COMMIT PREPARED runs elsewhere; the workers'
/// poll finds those rows).
#[pg_guard]
unsafe extern "C-unwind" fn wake_at_end(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        pg_sys::XactEvent::XACT_EVENT_COMMIT => {
            let mask = WAKE_MASK.with(|m| m.replace(0));
            if mask != 0 {
                wake(mask);
            }
        }
        pg_sys::XactEvent::XACT_EVENT_ABORT | pg_sys::XactEvent::XACT_EVENT_PREPARE => WAKE_MASK.with(|m| m.set(0)),
        _ => {}
    }
}

/// The claim's low-water outbox id (0 when unknown, or when the library was not preloaded): every
/// row below it is published or parked. The claim and the backlog view start their scans here.
#[pg_extern(stable, parallel_safe)]
fn _relay_low_water() -> i64 {
    low_water()
}

/// The mark, if it belongs to this database's outbox as it is now; else 0.
pub fn low_water() -> i64 {
    if !ready() {
        return 0;
    }
    let Some((mark, relid)) = RELAY.share().database(this_database()).map(|d| (d.low_water, d.low_water_relid)) else {
        return 0;
    };
    if mark > 0 && relid == outbox_relid() { mark } else { 0 }
}

/// OID of feature_outbox.outbox, or 0 (two syscache lookups).
pub fn outbox_relid() -> u32 {
    crate::own_schema::relid(c"outbox").to_u32()
}

/// Called by retry_parked(): when this transaction commits (its unparked rows then visible), the
/// low-water mark drops to 0 and a mark computed meanwhile is discarded.
#[pg_extern(volatile, parallel_unsafe)]
fn _relay_low_water_reset() {
    once_at_commit(&RESET_REGISTERED, || {
        if let Some(d) = RELAY.exclusive().database_mut(this_database()) {
            d.low_water = 0;
            d.low_water_generation += 1;
        }
    });
}

fn wake_all() {
    wake(u32::MAX);
}

/// Sets the latches of this database's workers in `mask` (bit = worker index).
fn wake(mask: u32) {
    // A worker backing off after a sink failure sleeps its backoff out whatever commits (relay/connection.rs,
    // sleep_for): waking it would cost every commit a signal and the worker a wake-up for nothing.
    let database = this_database();
    let latches: Vec<usize> = RELAY
        .share()
        .slots
        .iter()
        .filter(|s| s.serves(database) && mask & (1u32 << s.index) != 0 && s.pid != 0 && s.latch != 0 && s.state != WorkerState::BackingOff)
        .map(|s| s.latch)
        .collect();
    for latch in latches {
        unsafe { pg_sys::SetLatch(latch as *mut pg_sys::Latch) };
    }
}
