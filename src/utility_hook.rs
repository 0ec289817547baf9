//! A ProcessUtility hook, so that the relay never stands in the way of its databases' utility
//! commands, and hears at once of the ones that change what it serves.
//!
//! `DROP DATABASE`, `ALTER DATABASE ... RENAME` and `... SET TABLESPACE`, and `CREATE DATABASE ...
//! TEMPLATE` need the database without other sessions: PostgreSQL waits 5 s for them to leave, and
//! terminates only autovacuum. So the hook pauses the database first: its workers get SIGTERM, the
//! launcher starts none until the command's transaction ends, and the hook waits (at most PAUSE_WAIT)
//! until they have left. TimescaleDB's launcher does the same for DROP DATABASE.
//!
//! At commit, `CREATE EXTENSION feature_outbox` asks the launcher to look at the database again,
//! `DROP EXTENSION` sends its workers away, and `ALTER DATABASE/ROLE ... SET feature_outbox.*`
//! restarts them: a worker reads pg_db_role_setting only when it connects.

use std::ffi::CStr;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{PgList, PgXactCallbackEvent, register_xact_callback};

use crate::relay_state::{Presence, RELAY, this_database, wake_launcher};

/// The longest a command waits for the workers of its database to leave.
const PAUSE_WAIT: Duration = Duration::from_secs(2);

static mut PREVIOUS: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hook. Called from `_PG_init` while preloading, so every backend has it.
pub fn init() {
    unsafe {
        PREVIOUS = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(process_utility);
    }
}

/// What a utility statement means for the relay.
enum Effect {
    /// Needs database `name` without other sessions.
    Pause { name: String, command: &'static str },
    /// `ours`: feature_outbox itself; else one that may bring it with CASCADE.
    ExtensionCreated { ours: bool },
    ExtensionDropped,
    /// feature_outbox settings of one database, or of every one (ALTER ROLE without IN DATABASE).
    SettingsChanged(Option<String>),
}

unsafe fn text(p: *const std::ffi::c_char) -> Option<String> {
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The value of option `name` in a statement's DefElem list.
unsafe fn option(options: *mut pg_sys::List, name: &str) -> Option<String> {
    let options = unsafe { PgList::<pg_sys::DefElem>::from_pg(options) };
    options
        .iter_ptr()
        .find(|d| unsafe { text((**d).defname) }.as_deref() == Some(name) && !unsafe { (**d).arg }.is_null())
        .and_then(|d| unsafe { text(pg_sys::defGetString(d)) })
}

/// True for SET/RESET of a feature_outbox setting, and for RESET ALL.
unsafe fn ours(set: *mut pg_sys::VariableSetStmt) -> bool {
    if set.is_null() {
        return false;
    }
    match unsafe { text((*set).name) } {
        None => true,
        Some(name) => name.starts_with("feature_outbox."),
    }
}

unsafe fn effect(node: *mut pg_sys::Node) -> Option<Effect> {
    if node.is_null() {
        return None;
    }
    unsafe {
        match (*node).type_ {
            pg_sys::NodeTag::T_DropdbStmt => {
                text((*(node as *mut pg_sys::DropdbStmt)).dbname).map(|name| Effect::Pause { name, command: "DROP DATABASE" })
            }
            pg_sys::NodeTag::T_RenameStmt => {
                let s = node as *mut pg_sys::RenameStmt;
                ((*s).renameType == pg_sys::ObjectType::OBJECT_DATABASE)
                    .then(|| text((*s).subname))
                    .flatten()
                    .map(|name| Effect::Pause { name, command: "ALTER DATABASE RENAME" })
            }
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let s = node as *mut pg_sys::AlterDatabaseStmt;
                option((*s).options, "tablespace")
                    .and_then(|_| text((*s).dbname))
                    .map(|name| Effect::Pause { name, command: "ALTER DATABASE SET TABLESPACE" })
            }
            pg_sys::NodeTag::T_CreatedbStmt => {
                option((*(node as *mut pg_sys::CreatedbStmt)).options, "template").map(|name| Effect::Pause { name, command: "CREATE DATABASE TEMPLATE" })
            }
            // Any extension: one that requires feature_outbox brings it with CASCADE, without a
            // statement of its own. A look at a database that has it already changes nothing.
            pg_sys::NodeTag::T_CreateExtensionStmt => Some(Effect::ExtensionCreated {
                ours: text((*(node as *mut pg_sys::CreateExtensionStmt)).extname).as_deref() == Some("feature_outbox"),
            }),
            pg_sys::NodeTag::T_DropStmt => {
                let s = node as *mut pg_sys::DropStmt;
                let ours = (*s).removeType == pg_sys::ObjectType::OBJECT_EXTENSION
                    && PgList::<pg_sys::Node>::from_pg((*s).objects)
                        .iter_ptr()
                        .any(|o| text((*(o as *mut pg_sys::String)).sval).as_deref() == Some("feature_outbox"));
                ours.then_some(Effect::ExtensionDropped)
            }
            pg_sys::NodeTag::T_AlterDatabaseSetStmt => {
                let s = node as *mut pg_sys::AlterDatabaseSetStmt;
                ours((*s).setstmt).then(|| Effect::SettingsChanged(text((*s).dbname)))
            }
            pg_sys::NodeTag::T_AlterRoleSetStmt => {
                let s = node as *mut pg_sys::AlterRoleSetStmt;
                ours((*s).setstmt).then(|| Effect::SettingsChanged(text((*s).database)))
            }
            _ => None,
        }
    }
}

#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn process_utility(
    pstmt: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    let effect = if crate::relay_state::ready() { unsafe { effect((*pstmt).utilityStmt) } } else { None };
    if let Some(Effect::Pause { name, command }) = &effect
        && may_run(command, name, context)
    {
        pause(name, command);
    }
    // The capture worker leaves first (between its transactions: one writing a bulk change
    // deadlocked with the DROP), then the slot, origin and publications go with the extension,
    // which would otherwise keep WAL for ever.
    if matches!(effect, Some(Effect::ExtensionDropped)) {
        stop_capture(this_database());
        crate::capture::slot::drop_with_extension(this_database());
    }
    unsafe {
        match PREVIOUS {
            // Guarded: an ERROR in another library's hook (or below it) comes back as a Rust panic.
            Some(previous) => pg_sys::ffi::pg_guard_ffi_boundary(|| previous(pstmt, query, read_only_tree, context, params, env, dest, qc)),
            None => pg_sys::standard_ProcessUtility(pstmt, query, read_only_tree, context, params, env, dest, qc),
        }
    }
    match effect {
        Some(Effect::ExtensionCreated { ours: true }) => at_commit(|| look_again(this_database())),
        // Another extension's PREPARE stays allowed: a look that fires late, or never, costs nothing.
        Some(Effect::ExtensionCreated { ours: false }) => {
            register_xact_callback(PgXactCallbackEvent::Commit, || look_again(this_database()));
        }
        Some(Effect::ExtensionDropped) => at_commit(|| leave(this_database())),
        // The oid now: a commit callback may not read the catalog.
        Some(Effect::SettingsChanged(None)) => at_commit(|| restart(None)),
        Some(Effect::SettingsChanged(Some(name))) => {
            if let Some(oid) = oid_of(&name) {
                at_commit(move || restart(Some(oid)));
            }
        }
        _ => {}
    }
}

fn at_commit(f: impl FnOnce() + std::panic::UnwindSafe + std::panic::RefUnwindSafe + 'static) {
    refuse_prepare();
    register_xact_callback(PgXactCallbackEvent::Commit, f);
}

/// A prepared transaction ends in another session, or never: this backend's commit and abort
/// callbacks would run at its own next transaction end instead. So PREPARE TRANSACTION is refused
/// for the statements this hook follows, as PostgreSQL refuses it after LISTEN or temporary tables.
fn refuse_prepare() {
    register_xact_callback(PgXactCallbackEvent::PrePrepare, || {
        ereport!(
            ERROR,
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "cannot PREPARE a transaction that changed what the feature_outbox relay serves",
            "Commit it instead: CREATE or DROP EXTENSION feature_outbox, ALTER DATABASE or ROLE ... SET feature_outbox.*, and renaming a served database take effect for the relay at commit."
        );
    });
}

/// Whether `command` on database `name` would get past PostgreSQL's own checks, as far as they can
/// be known before it runs: the hook must not stop a database's workers for a statement that is
/// refused anyway (a role that does not own the database, DROP DATABASE in a transaction block).
fn may_run(command: &str, name: &str, context: pg_sys::ProcessUtilityContext::Type) -> bool {
    let in_block = context != pg_sys::ProcessUtilityContext::PROCESS_UTILITY_TOPLEVEL || unsafe { pg_sys::IsTransactionBlock() };
    if matches!(command, "DROP DATABASE" | "CREATE DATABASE TEMPLATE") && in_block {
        return false;
    }
    let createdb = matches!(command, "CREATE DATABASE TEMPLATE" | "ALTER DATABASE RENAME");
    // pg_has_role(..., 'USAGE') is has_privs_of_role, true for superusers, as PostgreSQL's owner
    // check is; CREATEDB as have_createdb_privilege reads it (superusers have it).
    let allowed = Spi::get_one_with_args::<bool>(
        "SELECT pg_catalog.pg_has_role(d.datdba, 'USAGE') AND (NOT $2 OR r.rolsuper OR r.rolcreatedb)
           FROM pg_catalog.pg_database d, pg_catalog.pg_roles r
          WHERE d.datname = $1 AND r.rolname = current_user",
        &[name.into(), createdb.into()],
    );
    matches!(allowed, Ok(Some(true)))
}

fn oid_of(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    let oid = unsafe { pg_sys::get_database_oid(name.as_ptr(), true) };
    (oid != pg_sys::InvalidOid).then(|| oid.to_u32())
}

/// Sends SIGTERM to `database`'s workers, its capture worker too when `capture`; returns how many
/// there were and whether any still serves it. Under the lock: a worker gives up its slot, and so
/// its pid, only under it.
fn terminate(database: u32, capture: bool) -> (usize, bool) {
    let shared = RELAY.share();
    let serving: Vec<_> = shared.slots.iter().filter(|s| s.serves(database)).collect();
    let mut pids: Vec<i32> = serving.iter().filter(|s| s.pid != 0).map(|s| s.pid).collect();
    // The capture worker too, for a pause: an active logical slot would stop DROP DATABASE.
    let worker = shared.database(database).map(|d| d.capture).filter(|_| capture).unwrap_or_default();
    pids.extend((worker.pid != 0).then_some(worker.pid));
    for pid in &pids {
        unsafe { libc::kill(*pid, libc::SIGTERM) };
    }
    (pids.len(), !serving.is_empty() || worker.claimed)
}

/// Pauses database `name` until this transaction ends, and waits until its workers have left.
fn pause(name: &str, command: &'static str) {
    let Some(database) = oid_of(name) else { return };
    {
        let mut shared = RELAY.exclusive();
        if shared.database(database).is_none() && !crate::databases::Served::now().includes(name) {
            return;
        }
        // Not seen by the launcher yet (created or served a moment ago): an entry, paused from the
        // start, so that it starts no worker there meanwhile.
        if shared.database(database).is_none() {
            shared.add_database(database, name);
        }
        let Some(d) = shared.database_mut(database) else { return };
        d.paused += 1;
        d.set_paused_for(command);
    }
    let resume = move || {
        if let Some(d) = RELAY.exclusive().database_mut(database) {
            d.paused = d.paused.saturating_sub(1);
        }
        wake_launcher();
    };
    refuse_prepare();
    register_xact_callback(PgXactCallbackEvent::Commit, resume);
    register_xact_callback(PgXactCallbackEvent::Abort, resume);
    let started = Instant::now();
    loop {
        // Again each round: a worker registered just before the pause gets its pid only now.
        let (_, serving) = terminate(database, true);
        if !serving {
            break;
        }
        if started.elapsed() >= PAUSE_WAIT {
            warning!("feature_outbox: relay workers of database \"{name}\" did not leave within {PAUSE_WAIT:?}; {command} may wait for them");
            break;
        }
        unsafe {
            pg_sys::pg_usleep(10_000);
            pg_sys::check_for_interrupts!();
        }
    }
    if command == "DROP DATABASE" {
        forget_capture_origin(database);
    }
}

/// Sends SIGTERM to `database`'s capture worker and waits (at most PAUSE_WAIT) until it has left.
/// The launcher starts no other: the DROP's commit marks the extension absent, and an abort leaves
/// `wanted` set, so it starts one again.
fn stop_capture(database: u32) {
    let started = Instant::now();
    loop {
        let pid = RELAY.share().database(database).map_or(0, |d| d.capture.pid);
        if pid == 0 {
            return;
        }
        unsafe { libc::kill(pid, libc::SIGTERM) };
        if started.elapsed() >= PAUSE_WAIT {
            warning!("feature_outbox: the capture worker did not leave within {PAUSE_WAIT:?}");
            return;
        }
        unsafe {
            pg_sys::pg_usleep(10_000);
            pg_sys::check_for_interrupts!();
        }
    }
}

/// DROP DATABASE takes the database's logical slots with it, but not the capture worker's
/// replication origin, which is the cluster's (src/capture/slot.rs names both after the OID).
/// Dropped in the same transaction, so it stays when the DROP fails; through the C function, as
/// the database's owner may not call pg_replication_origin_drop.
fn forget_capture_origin(database: u32) {
    let name = std::ffi::CString::new(format!("feature_outbox_capture_{database}")).expect("no NUL");
    unsafe { pg_sys::replorigin_drop_by_name(name.as_ptr(), true, false) };
}

/// A CREATE EXTENSION committed in `database`: the launcher looks there again.
fn look_again(database: u32) {
    if let Some(d) = RELAY.exclusive().database_mut(database) {
        d.looks_asked = d.looks_asked.wrapping_add(1);
        if d.presence == Presence::Absent {
            d.presence = Presence::Unknown;
        }
    }
    wake_launcher();
}

/// DROP EXTENSION committed in `database`: its workers leave, and none comes back until a CREATE.
fn leave(database: u32) {
    {
        let mut shared = RELAY.exclusive();
        let Some(d) = shared.database_mut(database) else { return };
        d.presence = Presence::Absent;
    }
    // The capture worker stays: it finds the extension gone at its next round, drops its slot,
    // origin and publications, and leaves (src/capture/worker.rs).
    if let Some(d) = RELAY.share().database(database)
        && d.capture.latch != 0
    {
        unsafe { pg_sys::SetLatch(d.capture.latch as *mut pg_sys::Latch) };
    }
    if terminate(database, false).0 > 0 {
        log!("feature_outbox: extension feature_outbox dropped; its relay workers leave this database");
    }
}

/// Settings of one database (or of every one, `None`) changed: the launcher restarts its workers.
fn restart(database: Option<u32>) {
    {
        let mut shared = RELAY.exclusive();
        for d in shared.databases.iter_mut().filter(|d| d.oid != 0 && database.is_none_or(|oid| d.oid == oid)) {
            d.restart = true;
        }
    }
    wake_launcher();
}
