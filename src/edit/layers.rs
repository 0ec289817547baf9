//! The user-table side of a layer edit: writes the feature row with the calling role's own rights,
//! and tells whether a row version was written by this transaction (record_edit's check).
//!
//! edit_feature and record_edit run as the extension's owner, because only they may write the
//! outbox. The user's table is written here instead, after switching back to the calling role for
//! the statement: its privileges are checked, and its triggers, defaults and CHECK expressions
//! run, as that role, never as the owner.

use pgrx::datum::{AnyElement, DatumWithOid, JsonB};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use crate::plans::prepared;
use crate::subxact;

/// The calling role: the session's current role (its login role, or the one SET ROLE chose), which
/// a SECURITY DEFINER function does not change. An edit called from inside another SECURITY DEFINER
/// function therefore writes with the rights of the session's role, not that function's owner.
#[pg_extern(stable, parallel_safe)]
fn _caller_role() -> pg_sys::Oid {
    unsafe { pg_sys::GetOuterUserId() }
}

/// True when `xmin` is this transaction's or one of its subtransactions' (savepoints'), so the row
/// version carrying it was written by this transaction (TransactionIdIsCurrentTransactionId).
#[pg_extern(stable, parallel_safe)]
fn _written_by_this_transaction(xmin: pg_sys::TransactionId) -> bool {
    unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xmin) }
}

/// Switches the current user to the calling role until dropped (also when an ERROR unwinds).
struct AsCaller {
    user: pg_sys::Oid,
    context: i32,
}

impl AsCaller {
    fn enter() -> Self {
        let (mut user, mut context) = (pg_sys::Oid::INVALID, 0);
        unsafe {
            pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
            // LOCAL_USERID_CHANGE: SET ROLE inside (say, in a trigger) is refused, as in SECURITY DEFINER.
            pg_sys::SetUserIdAndSecContext(pg_sys::GetOuterUserId(), context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32);
        }
        AsCaller { user, context }
    }
}

impl Drop for AsCaller {
    fn drop(&mut self) {
        unsafe { pg_sys::SetUserIdAndSecContext(self.user, self.context) };
    }
}

/// A quoted identifier. Always quoted: correct for every name, keywords included.
pub fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

/// The shape of one layer write, from layer_registry.
struct Target<'a> {
    tbl: &'a str,
    id: String,
    geometry: String,
    version: String,
    retired: Option<String>,
}

/// Builds the statement for `op`. $1 the feature id, $2 the properties (jsonb), $3 the geometry.
fn statement(t: &Target<'_>, op: &str, keys: &[String], with_geometry: bool) -> String {
    let props = || keys.iter().map(|k| quote(k)).collect::<Vec<_>>();
    let row_version = "t.tableoid::oid::text || ':' || t.ctid::text || ':' || t.xmin::text";
    let from = if keys.is_empty() { String::new() } else { format!(" FROM jsonb_populate_record(NULL::{}, $2) r", t.tbl) };
    let (id, geometry, version) = (&t.id, &t.geometry, &t.version);
    if op == "created" {
        let cols: Vec<String> = [id.clone(), geometry.clone(), version.clone()].into_iter().chain(props()).collect();
        let vals: Vec<String> = ["$1".to_string(), "$3".into(), "1".into()].into_iter().chain(props().iter().map(|p| format!("r.{p}"))).collect();
        return format!(
            "INSERT INTO {} AS t ({}) SELECT {}{from} ON CONFLICT ({id}) DO NOTHING RETURNING t.{version}, {row_version}",
            t.tbl,
            cols.join(", "),
            vals.join(", ")
        );
    }
    if op == "delete" {
        return format!("DELETE FROM {} AS t WHERE t.{id} = $1 RETURNING t.{version} + 1, NULL::text", t.tbl);
    }
    // moved, updated, retired (with a retired column), and the record_* forms of record_edit.
    let mut set = vec![match op {
        "record_created" => format!("{version} = 1"),
        _ => format!("{version} = t.{version} + 1"),
    }];
    if with_geometry {
        set.push(format!("{geometry} = $3"));
    }
    if let Some(r) = &t.retired {
        match op {
            "retired" => set.push(format!("{r} = now()")),
            "record_retired" => set.push(format!("{r} = coalesce(t.{r}, now())")),
            _ => {}
        }
    }
    set.extend(props().iter().map(|p| format!("{p} = r.{p}")));
    let live = match (&t.retired, op) {
        (Some(r), "moved" | "updated" | "retired" | "record_moved" | "record_updated") => format!(" AND t.{r} IS NULL"),
        _ => String::new(),
    };
    format!("UPDATE {} AS t SET {}{from} WHERE t.{id} = $1{live} RETURNING t.{version}, {row_version}", t.tbl, set.join(", "))
}

/// Writes feature `feature_id` of a user layer as the calling role. `op`: created, moved, updated,
/// retired, delete, or record_created / record_moved / record_updated / record_retired (record_edit:
/// the version, and the retired column, only). `tbl` is the table's name as regclass text; the
/// column names as registered. `geometry`: the geometry to store, already in the column's SRID, or
/// NULL to keep the current one. `properties`: registered columns to set, converted as
/// jsonb_populate_record converts them; a value that does not fit raises its class-22 error, naming
/// the column. Returns {new version, row version (tableoid:ctid:xmin)}, or NULL when no live row
/// matched (created: when the id exists). Errors: 42501 when the calling role lacks the privilege,
/// and whatever the table's own constraints and triggers raise.
#[pg_extern(volatile)]
#[allow(clippy::too_many_arguments)]
fn _layer_write(
    op: &str,
    tbl: &str,
    id_column: &str,
    geometry_column: &str,
    version_column: &str,
    retired_column: Option<&str>,
    feature_id: i64,
    geometry: Option<AnyElement>,
    properties: Option<JsonB>,
) -> Option<Vec<Option<String>>> {
    let keys: Vec<String> = match &properties {
        Some(JsonB(serde_json::Value::Object(m))) if op != "delete" => m.keys().cloned().collect(),
        _ => Vec::new(),
    };
    let target = Target {
        tbl,
        id: quote(id_column),
        geometry: quote(geometry_column),
        version: quote(version_column),
        retired: retired_column.map(quote),
    };
    let geometry_oid = geometry.as_ref().map(|g| g.oid());
    let sql = statement(&target, op, &keys, geometry_oid.is_some());
    let _caller = AsCaller::enter();
    if !keys.is_empty() {
        check_properties(tbl, &keys, properties.as_ref().expect("keys come from it"));
    }
    Spi::connect_mut(|client| {
        let jsonb_oid = pg_sys::JSONBOID;
        let mut types = vec![pg_sys::INT8OID, jsonb_oid];
        let mut args: Vec<DatumWithOid> = vec![feature_id.into(), unsafe { DatumWithOid::new(properties, jsonb_oid) }];
        if let (Some(g), Some(oid)) = (geometry, geometry_oid) {
            types.push(oid);
            args.push(unsafe { DatumWithOid::new(g, oid) });
        }
        let plan = prepared(client, &sql, &types, true);
        let table = client
            .update(&*plan, None, &args)
            .unwrap_or_else(|e| error!("layer write failed: {e}"));
        if table.is_empty() {
            return None;
        }
        let row = table.first();
        let version = row.get::<i32>(1).ok().flatten().map(|v| v.to_string());
        let row_version = row.get::<String>(2).ok().flatten();
        Some(vec![version, row_version])
    })
}

/// Converts each given property to its column's type, as the write will; the first that does not
/// fit raises its own error (class 22) with the column's name. Runs as the calling role.
fn check_properties(tbl: &str, keys: &[String], properties: &JsonB) {
    let columns: Vec<String> = keys.iter().map(|k| format!("r.{}", quote(k))).collect();
    let sql = format!("SELECT {} FROM jsonb_populate_record(NULL::{tbl}, $1) r", columns.join(", "));
    let all = subxact::run(|| {
        Spi::connect(|client| {
            let plan = prepared(client, &sql, &[pg_sys::JSONBOID], false);
            let args = [unsafe { DatumWithOid::new(JsonB(properties.0.clone()), pg_sys::JSONBOID) }];
            client.select(&*plan, None, &args).map(|_| ()).unwrap_or_else(|e| error!("{e}"));
        })
    });
    let Err(first) = all else { return };
    // Find the column: one key at a time.
    for key in keys {
        let one = serde_json::json!({ key: properties.0.get(key) });
        let sql = format!("SELECT r.{} FROM jsonb_populate_record(NULL::{tbl}, $1) r", quote(key));
        if let Err(f) = subxact::run(|| {
            Spi::connect(|client| {
                let args = [unsafe { DatumWithOid::new(JsonB(one.clone()), pg_sys::JSONBOID) }];
                client.select(sql.as_str(), None, &args).map(|_| ()).unwrap_or_else(|e| error!("{e}"));
            })
        }) {
            raise(f.code, format!("property \"{key}\" does not fit its column in {tbl}: {}", f.message), f.detail);
        }
    }
    raise(first.code, format!("properties do not fit the columns of {tbl}: {}", first.message), first.detail);
}

fn raise(code: PgSqlErrorCode, message: String, detail: Option<String>) -> ! {
    let mut report = ErrorReport::new(code, message, "feature_outbox").set_hint(
        "Give each property as JSON that converts to its column's type, as jsonb_populate_record converts it.",
    );
    if let Some(d) = detail {
        report = report.set_detail(d);
    }
    report.report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target<'static> {
        Target { tbl: "public.parcels", id: quote("id"), geometry: quote("geom"), version: quote("version"), retired: Some(quote("retired_at")) }
    }

    #[test]
    fn statements_set_only_what_the_edit_gives() {
        let q = |s: &str| s.replace('`', "\"");
        let moved = statement(&target(), "moved", &[], true);
        assert!(moved.starts_with(&q("UPDATE public.parcels AS t SET `version` = t.`version` + 1, `geom` = $3 WHERE t.`id` = $1 AND t.`retired_at` IS NULL")));
        let updated = statement(&target(), "updated", &["name".into()], false);
        assert!(updated.contains(&q("SET `version` = t.`version` + 1, `name` = r.`name` FROM jsonb_populate_record(NULL::public.parcels, $2) r")));
        assert!(!updated.contains("geom"));
        let created = statement(&target(), "created", &["name".into()], true);
        assert!(created.contains(&q("(`id`, `geom`, `version`, `name`) SELECT $1, $3, 1, r.`name` FROM jsonb_populate_record")));
        assert!(created.contains(&q("ON CONFLICT (`id`) DO NOTHING")));
        assert!(statement(&target(), "retired", &[], false).contains(&q("`retired_at` = now()")));
        assert!(statement(&target(), "record_retired", &[], false).contains(&q("`retired_at` = coalesce(t.`retired_at`, now())")));
        assert!(!statement(&target(), "record_retired", &[], false).contains("IS NULL"));
        assert!(statement(&target(), "record_created", &[], false).contains(&q("SET `version` = 1")));
        assert!(statement(&target(), "delete", &[], false).starts_with(&q("DELETE FROM public.parcels AS t WHERE t.`id` = $1")));
        assert_eq!(quote("we\"ird"), "\"we\"\"ird\"");
    }
}
