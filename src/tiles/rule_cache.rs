//! Which layers have an expire rule, remembered per backend.
//!
//! Every edit asks whether its layer expires tiles (sql/edit.sql). As a subquery of expire_rules in
//! the outbox INSERT that cost each edit a subplan, two more relations opened and an index scan:
//! about 13,000 instructions of a built-in move (issue 51, section 16 of make bench). The answer
//! changes only when expire_rules does, so it is read once and kept until then: a statement trigger
//! on expire_rules (sql/tiles.sql, `expire_rules_changed`) sends a relcache invalidation for the
//! table at every write, the cascades of unregister_layer and drop_expire_output included, and the
//! callback registered here forgets the set when that invalidation arrives. Each call first takes
//! in the invalidations sent so far (AcceptInvalidationMessages, a flag test when there are none),
//! so a rule counts from the first edit after its transaction committed, as the subquery's fresh
//! snapshot had it, and this transaction's own change from its next command (rolled back with it).

use std::cell::{Cell, RefCell};
use std::collections::HashSet;

use pgrx::prelude::*;
use pgrx::pg_sys;

thread_local! {
    /// The layers with at least one rule, and expire_rules' OID they were read from; None: unknown.
    static LAYERS: RefCell<Option<(pg_sys::Oid, HashSet<String>)>> = const { RefCell::new(None) };
    /// Counts invalidations, so that a read overtaken by one is used once and not kept.
    static GENERATION: Cell<u64> = const { Cell::new(0) };
    static CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// expire_rules' OID in the extension's schema (pinned by the control file), or InvalidOid.
fn expire_rules_relid() -> pg_sys::Oid {
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"feature_outbox".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return pg_sys::InvalidOid;
        }
        pg_sys::get_relname_relid(c"expire_rules".as_ptr(), nsp)
    }
}

/// Relcache callback: expire_rules changed (or every relation did, after a cache reset).
#[pg_guard]
unsafe extern "C-unwind" fn forget(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    let ours = LAYERS.with(|l| match &*l.borrow() {
        Some((rel, _)) => relid == pg_sys::InvalidOid || relid == *rel,
        None => true,
    });
    if ours {
        LAYERS.with(|l| l.replace(None));
        GENERATION.with(|g| g.set(g.get() + 1));
    }
}

/// Whether `layer` is attached to at least one expire output (a row of expire_rules): the same
/// answer as `EXISTS (SELECT 1 FROM expire_rules WHERE layer = $1)` under READ COMMITTED, from a
/// set read once per backend and kept until expire_rules changes (see the module's comment).
/// Errors: none of its own (the read is a plain SELECT of expire_rules). Parallel unsafe: the read
/// takes a fresh snapshot, which a parallel query's leader may not.
#[pg_extern(stable, parallel_unsafe)]
fn _layer_expires(layer: &str) -> bool {
    if !CALLBACK.with(|c| c.replace(true)) {
        unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(forget), pg_sys::Datum::from(0usize)) };
    }
    // The table's lock, as the subquery took it; then every invalidation sent so far, so that a
    // rule committed before this call counts, as it would for a statement starting now.
    let lock = |rel: pg_sys::Oid| unsafe {
        pg_sys::LockRelationOid(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE)
    };
    if let Some(rel) = LAYERS.with(|l| l.borrow().as_ref().map(|(rel, _)| *rel)) {
        lock(rel);
    }
    unsafe { pg_sys::AcceptInvalidationMessages() };
    if let Some(found) = LAYERS.with(|l| l.borrow().as_ref().map(|(_, set)| set.contains(layer))) {
        return found;
    }
    let relid = expire_rules_relid();
    if relid == pg_sys::InvalidOid {
        return false;
    }
    lock(relid);
    // Counted before the snapshot the read takes: a rule committed after that snapshot sends its
    // invalidation later, which then stops the read from being kept (or clears it at the next call).
    let before = GENERATION.with(|g| g.get());
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let read = Spi::connect(|client| {
        client
            .select("SELECT DISTINCT r.layer FROM feature_outbox.expire_rules r", None, &[])?
            .map(|row| row.get::<String>(1))
            .collect::<Result<Vec<_>, _>>()
    });
    unsafe { pg_sys::PopActiveSnapshot() };
    let layers: HashSet<String> = read
        .unwrap_or_else(|e| error!("reading feature_outbox.expire_rules: {e}"))
        .into_iter()
        .flatten()
        .collect();
    let found = layers.contains(layer);
    if GENERATION.with(|g| g.get()) == before {
        LAYERS.with(|l| l.replace(Some((relid, layers))));
    }
    found
}

/// Sends a relcache invalidation for expire_rules, so that every backend's `_layer_expires` reads
/// the table again: other backends' once this transaction commits, this one's at its next command
/// and at its rollback. Called by the statement trigger expire_rules_changed (sql/tiles.sql).
#[pg_extern(volatile, parallel_unsafe)]
fn _expire_rules_changed() {
    let relid = expire_rules_relid();
    if relid != pg_sys::InvalidOid {
        unsafe { pg_sys::CacheInvalidateRelcacheByRelid(relid) };
    }
}
