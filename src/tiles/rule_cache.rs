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
//! (A commit is visible a moment before its invalidation is sent: an edit in that moment is
//! treated as if made just before the commit.) The trigger fires in replica mode too.

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

/// expire_rules' OID, or InvalidOid.
fn expire_rules_relid() -> pg_sys::Oid {
    crate::own_schema::relid(c"expire_rules")
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

/// Whether `layer` is attached to at least one expire output (a row of expire_rules): the answer
/// `EXISTS (SELECT 1 FROM expire_rules WHERE layer = $1)` gives in a statement starting now under
/// READ COMMITTED (under REPEATABLE READ too: the set is shared by the backend's transactions), from
/// a set read once per backend and kept until expire_rules changes (see the module's comment).
/// Errors: none of its own (the read is a plain SELECT of expire_rules). Parallel unsafe: the read
/// takes a fresh snapshot, which a parallel query's leader may not.
#[pg_extern(stable, parallel_unsafe)]
pub(crate) fn _layer_expires(layer: &str) -> bool {
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
    let layers = read_layers();
    let found = layers.contains(layer);
    if GENERATION.with(|g| g.get()) == before {
        LAYERS.with(|l| l.replace(Some((relid, layers))));
    }
    found
}

/// The layers of expire_rules as committed now (and as this transaction changed them), whatever the
/// caller's isolation level: the set outlives the transaction, so it is read as a catalog is,
/// under the latest snapshot. Read-only SPI uses the pushed snapshot as it is; pgrx's select would
/// run read-write once the transaction has an xid, taking the transaction's own snapshot instead
/// (a REPEATABLE READ caller's old one would then be kept for the backend's life).
fn read_layers() -> HashSet<String> {
    let query = c"SELECT DISTINCT r.layer FROM feature_outbox.expire_rules r";
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot()) };
    let layers = Spi::connect(|_client| unsafe {
        let rc = pg_sys::SPI_execute(query.as_ptr(), true, 0);
        if rc != pg_sys::SPI_OK_SELECT as i32 {
            error!("reading feature_outbox.expire_rules: SPI_execute returned {rc}");
        }
        let table = pg_sys::SPI_tuptable;
        (0..pg_sys::SPI_processed as usize)
            .filter_map(|i| {
                let mut isnull = false;
                let datum = pg_sys::SPI_getbinval(*(*table).vals.add(i), (*table).tupdesc, 1, &mut isnull);
                String::from_datum(datum, isnull)
            })
            .collect()
    });
    unsafe { pg_sys::PopActiveSnapshot() };
    layers
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
