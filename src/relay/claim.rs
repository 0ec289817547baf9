//! The relay's claim: one batch of outbox rows locked FOR UPDATE ... SKIP LOCKED, then (read_content),
//! for each layer in the batch, one bounded read of its table for the claimed features' current rows. Each
//! layer's read runs in its own subtransaction, so a layer that cannot be read stops no other. A
//! layer whose table or registered columns are gone (dropped past the DDL guard: a superuser's
//! repair, single-user mode) is held: its rows wait, unpublished and never parked, until
//! release_layer() (sql/layers.sql), and the claim skips them. Any other read error fails the
//! layer's rows row-level, so they retry and park with the reason as last_error.

use std::collections::{HashMap, HashSet};
use std::sync::LazyLock;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use serde_json::value::RawValue;

use super::error::RelayError;
use crate::event::Row;
use crate::plans::prepared;
use crate::subxact;

// The claim locks rows of the outbox alone, walking the partial index in id order from the
// low-water mark (low_water.rs), so the dead entries of published rows below it are never read.
// Per-feature order:
// - each worker claims only its own features ($3 workers, $4 this worker; relay_state::partition_of),
//   so two events of one feature are never in flight in two workers;
// - a feature whose older row waits for its per-row retry time (next_attempt_at in the future) has
//   none of its later rows claimed until that row is delivered or parked. Such rows are few, and the
//   partial index outbox_waiting holds exactly them;
// - the features passed over (another transaction holds one of their rows, pipeline.rs) are left
//   out: $5 their feature_ids, $6 their `layer feature_id` keys (the text is built only for a row
//   whose feature_id is among them);
// - a parked row holds nothing back (docs, Failures: "A parked row no longer holds its feature back").
// Within a batch, publish() sends a feature's rows in id order, each after the one before it was
// acknowledged.
const COLUMNS: &str = "o.id, o.event_id::text AS event_id, o.feature_id, o.feature_version, o.event_type, o.routing_key,
       o.previous_routing_key,
       to_char(o.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') AS occurred_at,
       o.row_failures, o.layer, o.previous_bbox, o.feature_key, o.traceparent, o.tracestate, o.origin";
const CLAIMABLE: &str = "
  FROM feature_outbox.outbox o
 WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.id >= $2
   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
   AND ($3 <= 1 OR (hashint8(o.feature_id) & 2147483647) % $3 = $4)
   AND o.layer <> ALL (ARRAY(SELECT h.layer FROM feature_outbox.layer_registry h WHERE h.held_since IS NOT NULL))
   AND NOT EXISTS (SELECT 1 FROM feature_outbox.outbox w
                    WHERE w.published_at IS NULL AND w.next_attempt_at IS NOT NULL AND w.parked_at IS NULL
                      AND w.feature_id = o.feature_id AND w.next_attempt_at > now() AND w.layer = o.layer
                      AND w.id < o.id)
   AND (o.feature_id <> ALL ($5::bigint[]) OR o.layer || ' ' || o.feature_id <> ALL ($6::text[]))
 ";

/// The claim: the rows locked, those locked elsewhere skipped; and, for each row, the first earlier
/// unpublished row of its feature that the claim did not take (`before`), or NULL. SKIP LOCKED
/// skips a row another transaction holds, and would take the row behind it: the ordering rule
/// (pipeline.rs) leaves out every row with a `before`. Such a row can only be one held elsewhere:
/// a row waiting for its retry, or of a held layer, keeps its feature's later rows out of the claim
/// already, and a parked one does not count. `before` walks the index once more, from the mark to
/// the last row claimed (the rows the claim walked), this worker's partition only. Both tests
/// against the claimed rows are hashed subplans: `NOT IN` is never turned into a join, and the
/// double negation keeps the feature test one too (as a join, the planner, which expects one
/// claimed row, loops over all of them for each row walked: 450 ms a batch with 4 workers). On a
/// 100,000-row backlog this takes the claim of 1,000 rows from 1.9 to 4 ms (1 worker) and from 2.8
/// to 7-9 ms (4 workers); of 100 rows from 0.37 to 0.75 ms. Only a fresh claim pays it: with a
/// backlog, each next batch is read ahead and relocked (pipeline.rs), never claimed fresh.
static CLAIM_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH c AS MATERIALIZED (SELECT {COLUMNS} {CLAIMABLE} ORDER BY o.id LIMIT $1 FOR UPDATE OF o SKIP LOCKED),
              before AS (SELECT e.layer, e.feature_id, min(e.id) AS id
                           FROM feature_outbox.outbox e
                          WHERE e.published_at IS NULL AND e.parked_at IS NULL
                            AND e.id >= $2 AND e.id < (SELECT max(c.id) FROM c)
                            AND ($3 <= 1 OR (hashint8(e.feature_id) & 2147483647) % $3 = $4)
                            AND e.id NOT IN (SELECT c.id FROM c)
                            AND NOT ((e.layer, e.feature_id) NOT IN (SELECT c.layer, c.feature_id FROM c))
                          GROUP BY e.layer, e.feature_id)
         SELECT c.*, b.id FROM c LEFT JOIN before b ON b.layer = c.layer AND b.feature_id = c.feature_id AND b.id < c.id
          ORDER BY c.id"
    )
});

/// The claim ahead, read while the batch claimed before it is in flight: without locks, which would
/// not outlive this transaction (the transaction that sends it locks its rows again, see
/// pipeline.rs `Batch::relock`, which applies the ordering rule), and without that batch's own
/// rows ($7). Run unprepared, so the planner sees $7 as a constant and looks it up in a hash table
/// (a hashed `= ANY`, PostgreSQL 14 and later): kept as a generic plan, each row would walk the
/// whole array.
static CLAIM_AHEAD_SQL: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {COLUMNS}, NULL::bigint {CLAIMABLE} AND NOT (o.id = ANY($7)) ORDER BY o.id LIMIT $1"));

const CLAIM_TYPES: [pg_sys::Oid; 6] =
    [pg_sys::INT8OID, pg_sys::INT8OID, pg_sys::INT4OID, pg_sys::INT4OID, pg_sys::INT8ARRAYOID, pg_sys::TEXTARRAYOID];

/// plan_cache_mode as it was, then forcing generic plans, for this transaction.
const GENERIC_SQL: &str = "SELECT current_setting('plan_cache_mode'), set_config('plan_cache_mode', 'force_generic_plan', true)";
const RESTORE_SQL: &str = "SELECT set_config('plan_cache_mode', $1, true)";

/// The claim's planner settings, for its transaction only (see `claim`).
pub(super) const PLANNER_SQL: &str =
    "SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)";

// Each layer's read statement, built from its registry row: the key as text (the claimed keys, a
// text[], are cast to the id column's type, bigint for integer keys), the current version, the geometry in
// EPSG:4326 as WKB, and the registered properties as one JSON object (to_jsonb of each column;
// jsonb_build_object takes at most 50 pairs, so longer lists are joined with ||). Every function is
// schema-qualified (PostGIS by its own schema), so no search_path can redirect the call. A NULL
// table: the table was dropped.
const LAYERS_SQL: &str = "
SELECT r.layer, c.oid IS NOT NULL, r.tbl::oid::bigint, r.since_id, c.relowner,
       format('SELECT t.%1$I::text, t.%2$I, %6$I.ST_AsBinary(%6$I.ST_Transform(t.%3$I, 4326)), (%4$s)::text '
              'FROM %5$s t WHERE t.%1$I = ANY($1::text[]::%7$s[])',
              r.id_column, r.version_column, r.geometry_column,
              coalesce((SELECT string_agg(part, ' || ')
                          FROM (SELECT 'pg_catalog.jsonb_build_object(' ||
                                       string_agg(format('%L, pg_catalog.to_jsonb(t.%I)', p, p), ', ' ORDER BY i) || ')' AS part
                                  FROM unnest(r.properties) WITH ORDINALITY u(p, i)
                                 GROUP BY (i - 1) / 50) parts),
                       '''{}''::jsonb'),
              r.tbl, g.nspname,
              feature_outbox._key_cast(r.id_type))
  FROM feature_outbox.layer_registry r
  LEFT JOIN pg_catalog.pg_class c ON c.oid = r.tbl
 CROSS JOIN (SELECT n.nspname FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace
              WHERE e.extname = 'postgis') g
 WHERE r.layer = ANY($1)";

/// A feature's current row: version, WKB in EPSG:4326, properties.
type Current = (Option<i32>, Option<Vec<u8>>, Option<String>);

/// What to claim: up to `limit` rows of worker `index`'s features (of `workers`), from the
/// low-water mark up, leaving out the features `passed_over`.
pub struct Request<'a> {
    pub limit: i64,
    pub index: usize,
    pub workers: usize,
    pub passed_over: &'a [(String, i64)],
}

/// Claimed rows without their content yet, and for each the earlier row of its feature that the
/// claim did not take (see CLAIM_SQL).
pub struct Claimed {
    pub rows: Vec<Row>,
    pub before: Vec<Option<i64>>,
}

/// Claims the rows `request` names. With `ahead_of` (the batch this transaction claimed already), it
/// claims ahead: it leaves those rows out, and takes no lock (`CLAIM_AHEAD_SQL`). From the mark, not
/// from above `ahead_of`: a row below them that became claimable since (a late commit, a retry come
/// due) is taken in its feature's order.
pub fn claim(client: &mut SpiClient<'_>, request: &Request<'_>, ahead_of: Option<&HashSet<i64>>) -> Result<Claimed, RelayError> {
    // A freshly loaded backlog has no statistics yet: the planner then picks a bitmap scan and sorts
    // every unpublished row (17 ms per batch at 50k rows, measured) instead of reading the first n
    // from the partial index (1 ms). The walk in id order is always right here; pin it for this
    // transaction only. And no JIT: the seq scan of the (tiny) registry for held layers carries the
    // disabled-seqscan cost, which lifts the plan over jit_above_cost, and compiling it cost 300 ms
    // a batch (bench/ab_bench.py: 1,500 events/s against 0.2.0's 20,000 before this).
    // Every statement of the relay's loop is a kept plan: parsing and planning them anew took half
    // of an idle worker's CPU at 1,000 edits/s (perf, issue 24).
    let settings = prepared(client, PLANNER_SQL, &[], true);
    client.update(&*settings, None, &[])?;
    let (ids, keys): (Vec<i64>, Vec<String>) = request.passed_over.iter().map(|(layer, id)| (*id, format!("{layer} {id}"))).unzip();
    let mut args = vec![
        request.limit.into(),
        crate::relay_state::low_water().into(),
        (request.workers as i32).into(),
        (request.index as i32).into(),
        ids.into(),
        keys.into(),
    ];
    // FOR UPDATE must go through update(): select() runs read-only (pgrx field notes). Read-write
    // either way: SPI then takes a fresh snapshot, which sees the rows committed since this
    // transaction began.
    let table = match ahead_of {
        None => {
            let plan = prepared(client, &CLAIM_SQL, &CLAIM_TYPES, true);
            client.update(&*plan, None, &args)?
        }
        Some(held) => {
            args.push(held.iter().copied().collect::<Vec<i64>>().into());
            client.update(CLAIM_AHEAD_SQL.as_str(), None, &args)?
        }
    };
    let mut claimed = Claimed { rows: Vec::with_capacity(table.len()), before: Vec::with_capacity(table.len()) };
    for r in table {
        let get_s = |i| r.get::<String>(i);
        claimed.rows.push(Row {
            id: r.get::<i64>(1)?.unwrap_or_default(),
            event_id: get_s(2)?.unwrap_or_default(),
            feature_id: r.get::<i64>(3)?.unwrap_or_default(),
            feature_key: get_s(12)?,
            feature_version: r.get::<i32>(4)?.unwrap_or_default(),
            event_type: get_s(5)?.unwrap_or_default(),
            routing_key: get_s(6)?.unwrap_or_default(),
            previous_routing_key: get_s(7)?,
            occurred_at: get_s(8)?.unwrap_or_default(),
            row_failures: r.get::<i32>(9)?.unwrap_or_default(),
            layer: get_s(10)?.unwrap_or_default(),
            registration_id: 0,
            previous_bbox: r.get::<Vec<f64>>(11)?,
            geometry_version: None,
            geometry: None,
            properties: None,
            read_error: None,
            traceparent: get_s(13)?,
            tracestate: get_s(14)?,
            origin: get_s(15)?.unwrap_or_default(),
        });
        claimed.before.push(r.get::<i64>(16)?);
    }
    Ok(claimed)
}

/// Fills in each claimed row's current feature row: for each layer in the batch, one bounded read
/// of its table. The rows of a layer found held are left out (their locks go with this transaction).
pub fn read_content(client: &mut SpiClient<'_>, rows: &mut Vec<Row>) -> Result<(), RelayError> {
    if rows.is_empty() {
        return Ok(());
    }
    // The claim ran read-write, so SPI took a fresh snapshot for it. The reads below run
    // read-only, and read-only SPI uses the active snapshot: the one this transaction began
    // with, older than the claim's. An edit that committed in between had its outbox row
    // claimed but its feature row unseen, and went out with null content (issue 20). Read
    // under a snapshot taken now, which sees everything the claim saw (in READ COMMITTED, a
    // new one; the relay's transactions always are, see relay/mod.rs).
    unsafe { pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot()) };
    let read = read_layers(client, rows);
    unsafe { pg_sys::PopActiveSnapshot() };
    let held = read?;
    rows.retain(|r| !held.contains(&r.layer));
    Ok(())
}

/// Whether a failed layer read means the layer's table no longer matches its registration: a
/// table, column, type or function the read names is gone (42P01, 42703, 42804, 42883). Such a
/// layer is held rather than failing its rows, which no retry could deliver.
fn holds(code: PgSqlErrorCode) -> bool {
    matches!(
        code,
        PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE
            | PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN
            | PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH
            | PgSqlErrorCode::ERRCODE_UNDEFINED_FUNCTION
    )
}

/// Fills in geometry, version and properties of each row from its layer's table: one query per
/// layer, in its own subtransaction. A layer that cannot be read sets `read_error` on its rows, or
/// is held (see `holds`): recorded in layer_registry (held_since, held_reason) and returned.
fn read_layers(client: &mut SpiClient<'_>, rows: &mut [Row]) -> Result<Vec<String>, RelayError> {
    let mut names: Vec<String> = rows.iter().map(|r| r.layer.clone()).collect();
    names.sort();
    names.dedup();
    // Its generic plan, always: the plan cache chose a custom plan at every batch, and planning it
    // took 28 % of a worker's CPU at 1,000 edits/s (perf). Only for this read: a layer's own read
    // keeps its custom plan, which prunes a partitioned table's partitions by the claimed keys.
    let generic = prepared(client, GENERIC_SQL, &[], true);
    let mode = client.update(&*generic, None, &[]).and_then(|t| t.first().get_one::<String>())?.unwrap_or_default();
    let plan = prepared(client, LAYERS_SQL, &[pg_sys::TEXTARRAYOID], false);
    let registry = client.select(&*plan, None, &[names.clone().into()])?;
    // layer -> (since_id, table owner, read statement), or why it cannot be read and whether that holds it
    let mut reads: HashMap<String, Result<(i64, pg_sys::Oid, String), (String, bool)>> = HashMap::new();
    for r in registry {
        let layer = r.get::<String>(1)?.unwrap_or_default();
        let exists = r.get::<bool>(2)?.unwrap_or(false);
        let oid = r.get::<i64>(3)?.unwrap_or_default();
        let since = r.get::<i64>(4)?.unwrap_or_default();
        let owner = r.get::<pg_sys::Oid>(5)?.unwrap_or(pg_sys::Oid::INVALID);
        let sql = r.get::<String>(6)?.unwrap_or_default();
        let read = if exists {
            Ok((since, owner, sql))
        } else {
            Err((format!("its table (OID {oid}) was dropped"), true))
        };
        reads.insert(layer, read);
    }
    let restore = prepared(client, RESTORE_SQL, &[pg_sys::TEXTOID], true);
    client.update(&*restore, None, &[mode.into()])?;
    let mut held = Vec::new();
    for layer in names {
        let read = reads.remove(&layer).unwrap_or_else(|| Err((format!("layer \"{layer}\" is not registered"), false)));
        let since = read.as_ref().map(|(since, _, _)| *since).unwrap_or(0);
        let ids: Vec<String> = rows.iter().filter(|r| r.layer == layer && r.id >= since).map(|r| r.key()).collect();
        let current = read.and_then(|(_, owner, sql)| {
            read_layer(&sql, owner, ids).map_err(|f| (format!("cannot read its table: {}", f.message), holds(f.code)))
        });
        let current = match current {
            Err((reason, true)) => {
                hold(client, &layer, &reason)?;
                held.push(layer);
                continue;
            }
            other => other.map_err(|(reason, _)| format!("layer \"{layer}\": {reason}")),
        };
        for row in rows.iter_mut().filter(|r| r.layer == layer) {
            if row.id < since {
                row.read_error = Some(format!(
                    "outbox row {} was written for an earlier layer named \"{layer}\", unregistered since; the current one starts at outbox id {since}",
                    row.id
                ));
                continue;
            }
            row.registration_id = since;
            match &current {
                Ok(by_id) => {
                    if let Some((version, geometry, properties)) = by_id.get(&row.key()) {
                        row.geometry_version = *version;
                        row.geometry = geometry.clone();
                        row.properties = match properties {
                            Some(p) => Some(RawValue::from_string(p.clone()).map_err(|e| RelayError::Sql(e.to_string()))?),
                            None => None,
                        };
                    }
                }
                Err(e) => row.read_error = Some(e.clone()),
            }
        }
    }
    Ok(held)
}

/// Holds `layer`: the claim skips its rows from the next batch on, until release_layer().
fn hold(client: &mut SpiClient<'_>, layer: &str, reason: &str) -> Result<(), RelayError> {
    let why = format!("{reason}; restore it, then SELECT feature_outbox.release_layer('{layer}') (see README, Layers)");
    log!("feature_outbox relay: layer \"{layer}\" is held, its rows wait: {why}");
    client
        .update(
            "UPDATE feature_outbox.layer_registry SET held_since = coalesce(held_since, now()), held_reason = $2 WHERE layer = $1",
            None,
            &[layer.into(), why.as_str().into()],
        )
        .map(|_| ())
        .map_err(RelayError::from)
}

/// Reads one layer's rows as the table's owner, in a restricted context, as PostgreSQL runs VACUUM
/// and ANALYZE: code the owner controls (casts, to_jsonb of their types) runs with their rights only.
fn read_layer(sql: &str, owner: pg_sys::Oid, ids: Vec<String>) -> Result<HashMap<String, Current>, subxact::Failure> {
    let context = crate::roles::current().context;
    let _owner = crate::roles::As::enter(owner, context, pg_sys::SECURITY_RESTRICTED_OPERATION);
    subxact::run(|| {
        Spi::connect(|client| {
            let plan = prepared(client, sql, &[pg_sys::TEXTARRAYOID], false);
            let table = client.select(&*plan, None, &[ids.into()]).unwrap_or_else(|e| error!("{e}"));
            let mut by_id = HashMap::with_capacity(table.len());
            for r in table {
                let id = r.get::<String>(1).unwrap_or_else(|e| error!("{e}")).unwrap_or_default();
                let version = r.get::<i32>(2).unwrap_or_else(|e| error!("{e}"));
                let geometry = r.get::<Vec<u8>>(3).unwrap_or_else(|e| error!("{e}"));
                let properties = r.get::<String>(4).unwrap_or_else(|e| error!("{e}"));
                by_id.insert(id, (version, geometry, properties));
            }
            by_id
        })
    })
}
