//! The user-table side of layers, and what keeps the rights apart.
//!
//! `edit_feature(layer, ...)`, `record_edit`, `register_layer` and the other C entry points
//! (`entry.rs`) record the role calling them, then run their SQL body (`_edit`, `_record_edit`, ...)
//! as the extension's owner, which alone may write the outbox, the per-feature state and the
//! registry. Whatever touches the user's table from that body goes through `_layer_write_row` or
//! `_as_caller_row`, which switch back to the recorded caller for the statement: its privileges are
//! checked, and its triggers, defaults, casts and CHECK expressions run, as that role, never as the
//! owner.

use std::ffi::CStr;

use pgrx::datum::{AnyElement, DatumWithOid};
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::plans::prepared;
use crate::roles::{self, As};
use crate::subxact;

/// A quoted identifier. Always quoted: correct for every name, keywords included.
pub fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

fn report(code: PgSqlErrorCode, message: String, detail: Option<String>, hint: Option<&str>) -> ! {
    let mut r = ErrorReport::new(code, message, "feature_outbox");
    if let Some(d) = detail {
        r = r.set_detail(d);
    }
    if let Some(h) = hint {
        r = r.set_hint(h);
    }
    r.report(PgLogLevel::ERROR);
    unreachable!("ERROR does not return")
}

/// The role that called the running edit function (`current_user` there). Errors outside one.
#[pg_extern(stable, parallel_safe)]
fn _caller_role() -> pg_sys::Oid {
    roles::caller().map(|c| c.user).unwrap_or_else(|| {
        report(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "_caller_role() is for feature_outbox's own functions".into(),
            None,
            Some("Call edit_feature, record_edit, register_layer or unregister_layer."),
        )
    })
}

/// Switches to the recorded caller of the running edit function for the duration of the guard.
fn as_caller() -> As {
    match roles::caller() {
        Some(c) => As::enter(c.user, c.context, 0),
        None => report(
            PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            "layer tables are written only through edit_feature and record_edit".into(),
            None,
            None,
        ),
    }
}

/// True when `xmin` is this transaction's or one of its subtransactions' (savepoints'), so the row
/// version carrying it was written by this transaction (TransactionIdIsCurrentTransactionId).
#[pg_extern(stable, parallel_safe)]
fn _written_by_this_transaction(xmin: pg_sys::TransactionId) -> bool {
    unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xmin) }
}

/// Runs `sql` (one row at most, `$1` the feature id) as the caller of the running edit function
/// and returns its columns as text, or NULL when it returns no row. For _edit and _record_edit's
/// reads of a layer's table, so that they see what the caller may see.
#[pg_extern(volatile)]
fn _as_caller_row(sql: &str, feature_id: i64) -> Option<Vec<Option<String>>> {
    caller_row(sql, pg_sys::INT8OID, feature_id.into())
}

/// As `_as_caller_row(sql, bigint)`, `$1` the feature's key as text (the statement casts it to the
/// id column's type): for every layer since 0.3.0, uuid and text keys included.
#[pg_extern(volatile, name = "_as_caller_row")]
fn _as_caller_row_key(sql: &str, key: &str) -> Option<Vec<Option<String>>> {
    caller_row(sql, pg_sys::TEXTOID, key.into())
}

fn caller_row(sql: &str, oid: pg_sys::Oid, arg: DatumWithOid) -> Option<Vec<Option<String>>> {
    let _caller = as_caller();
    Spi::connect(|client| {
        let plan = prepared(client, sql, &[oid], false);
        let table = client.select(&*plan, Some(1), &[arg]).unwrap_or_else(|e| error!("{e}"));
        if table.is_empty() {
            return None;
        }
        let row = table.first();
        let n = row.columns().unwrap_or(0);
        Some((1..=n).map(|i| row.get::<String>(i).ok().flatten()).collect())
    })
}

/// Runs `sql` (`$1` a bigint[] of its arguments) as the caller of the running feature_outbox
/// function, read-write so that it may lock rows (FOR SHARE), and returns each row's columns as
/// text. For backfill's reads of a layer's table, with the caller's rights.
#[pg_extern(volatile)]
fn _as_caller_rows(sql: &str, args: Vec<Option<i64>>) -> SetOfIterator<'static, Vec<Option<String>>> {
    caller_rows(sql, pg_sys::INT8ARRAYOID, args.into())
}

/// As `_as_caller_rows(sql, bigint[])`, `$1` a text[]: keys of any type, and the chunk cursors of
/// backfill, drift and resync, which the statement casts to the id column's type.
#[pg_extern(volatile, name = "_as_caller_rows")]
fn _as_caller_rows_text(sql: &str, args: Vec<Option<String>>) -> SetOfIterator<'static, Vec<Option<String>>> {
    caller_rows(sql, pg_sys::TEXTARRAYOID, args.into())
}

fn caller_rows(sql: &str, oid: pg_sys::Oid, args: DatumWithOid) -> SetOfIterator<'static, Vec<Option<String>>> {
    let _caller = as_caller();
    let rows: Vec<Vec<Option<String>>> = Spi::connect_mut(|client| {
        let plan = prepared(client, sql, &[oid], true);
        let table = client.update(&*plan, None, &[args]).unwrap_or_else(|e| error!("{e}"));
        table
            .map(|row| {
                let n = row.columns();
                (1..=n).map(|i| row.get::<String>(i).ok().flatten()).collect()
            })
            .collect()
    });
    SetOfIterator::new(rows)
}

// ---- the write -----------------------------------------------------------------------------------

/// The table of a layer: its quoted, schema-qualified name and whether it is partitioned.
fn table(layer: &str, oid: pg_sys::Oid) -> (String, bool) {
    unsafe {
        let name = pg_sys::get_rel_name(oid);
        if name.is_null() {
            report(
                PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
                format!("the table of layer {layer} (OID {}) no longer exists", oid.to_u32()),
                None,
                Some("Register the layer again on its new table, or unregister_layer() it."),
            );
        }
        let schema = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(oid));
        let qualified = format!(
            "{}.{}",
            quote(&CStr::from_ptr(schema).to_string_lossy()),
            quote(&CStr::from_ptr(name).to_string_lossy())
        );
        (qualified, pg_sys::get_rel_relkind(oid) as u8 == pg_sys::RELKIND_PARTITIONED_TABLE)
    }
}

/// The shape of one layer write, from layer_registry.
struct Target {
    tbl: String,
    id: String,
    geometry: String,
    version: String,
    retired: Option<String>,
    /// A partitioned table cannot return system columns from INSERT: the row version is read after.
    partitioned: bool,
    /// The key parameter as the statement uses it: `$1` (a bigint), or `$1::uuid` and the like (text).
    key: String,
}

const ROW_VERSION: &str = "t.tableoid::oid::text || ':' || t.ctid::text || ':' || t.xmin::text";

/// The digests of a row as written, as text that casts to uuid (see src/edit/digest.rs,
/// _properties_digest): of its geometry's EWKB (md5, in hex) and of its registered properties
/// (`registered`, in their order).
pub fn digests(geometry: &str, registered: &[String]) -> String {
    let props: Vec<String> = registered.iter().map(|p| format!("t.{}", quote(p))).collect();
    format!(
        "md5(ST_AsEWKB(t.{geometry})), feature_outbox._properties_digest(ROW({}))::text",
        props.join(", ")
    )
}

/// The SQL of a layer row's digests, as `digests` builds it, for the reads of drift(), resync() and
/// backfill(): `t` is the table's alias, `geometry_column` and `properties` as registered.
#[pg_extern(immutable, parallel_safe)]
fn _row_digests_sql(geometry_column: &str, properties: Vec<String>) -> String {
    digests(&quote(geometry_column), &properties)
}

/// Builds the statement for `op`. $1 the feature id, $2 the properties (jsonb text), $3 the geometry.
/// With `registered` (the layer's properties), the row's digests follow the version and row version.
fn statement(t: &Target, op: &str, keys: &[String], with_geometry: bool, registered: Option<&[String]>) -> String {
    let props = || keys.iter().map(|k| quote(k)).collect::<Vec<_>>();
    let from = if keys.is_empty() { String::new() } else { format!(" FROM jsonb_populate_record(NULL::{}, $2::jsonb) r", t.tbl) };
    let (id, geometry, version) = (&t.id, &t.geometry, &t.version);
    let mut returning = if t.partitioned { format!("t.{version}, NULL::text") } else { format!("t.{version}, {ROW_VERSION}") };
    if let Some(r) = registered {
        returning = format!("{returning}, {}", digests(geometry, r));
    }
    if op == "created" {
        let cols: Vec<String> = [id.clone(), geometry.clone(), version.clone()].into_iter().chain(props()).collect();
        let vals: Vec<String> = [t.key.clone(), "$3".into(), "1".into()].into_iter().chain(props().iter().map(|p| format!("r.{p}"))).collect();
        return format!(
            "INSERT INTO {} AS t ({}) SELECT {}{from} ON CONFLICT ({id}) DO NOTHING RETURNING {returning}",
            t.tbl,
            cols.join(", "),
            vals.join(", ")
        );
    }
    if op == "delete" {
        let digests = registered.map(|r| format!(", {}", digests(geometry, r))).unwrap_or_default();
        return format!("DELETE FROM {} AS t WHERE t.{id} = {} RETURNING t.{version} + 1, NULL::text{digests}", t.tbl, t.key);
    }
    // moved, updated, retired (with a retired column), and record_edit's record_* forms.
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
    format!("UPDATE {} AS t SET {}{from} WHERE t.{id} = {}{live} RETURNING {returning}", t.tbl, set.join(", "), t.key)
}

/// 0.2.0's declaration of the layer write (its install script names this symbol): as
/// `_layer_write_row` without digests, `{new version, row version}` as text.
#[pg_extern(volatile, sql = false)]
#[allow(clippy::too_many_arguments)]
fn _layer_write(
    layer: &str,
    op: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    geometry_column: &str,
    version_column: &str,
    retired_column: Option<&str>,
    feature_id: i64,
    geometry: Option<AnyElement>,
    properties: Option<&str>,
    keys: Option<Vec<String>>,
) -> Option<Vec<Option<String>>> {
    let columns = Columns { tbl, id_column, geometry_column, version_column, retired_column };
    let w = write(layer, op, &columns, Key::Id(feature_id), geometry, properties, keys, None)?;
    Some(vec![w.version.map(|v| v.to_string()), w.row_version])
}

/// Writes feature `key` of a user layer as the caller of the running edit function. `key`: the
/// feature's key as text, converted to `id_type` (the id column's type; bigint for integer keys).
/// `op`:
/// created, moved, updated, retired, delete, or record_created / record_moved / record_updated /
/// record_retired (record_edit: the version, and the retired column, only; on a layer without a
/// retired column, record_edit's `retired` comes here as delete, as edit_feature's does). `tbl`: the table's OID;
/// the column names as registered. `geometry`: what to store, already in the column's SRID, or NULL
/// to keep the current one. `properties` (jsonb as text) and `keys` (its keys): registered columns
/// to set, converted as jsonb_populate_record converts them; a value that does not fit raises its
/// class-22 error naming the property. `registered`: the layer's properties, whose digest is taken.
/// Returns a `layer_write` (sql/schema.sql) of the row as written (as it was, for delete):
/// `version` (the new one), `row_version` (tableoid:ctid:xmin), `geometry_digest` (md5 of its
/// EWKB) and `properties_digest`; NULL when no live row matched (created: when the id exists).
/// Errors: 42501 when the caller lacks the privilege, 42P01 when the table is gone, 42804 when the
/// version column is no longer integer, and whatever the table's constraints and triggers raise.
#[pg_extern(volatile, name = "_layer_write_row")]
#[allow(clippy::too_many_arguments)]
fn _layer_write_row_composite(
    layer: &str,
    op: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    geometry_column: &str,
    version_column: &str,
    retired_column: Option<&str>,
    key: &str,
    id_type: &str,
    geometry: Option<AnyElement>,
    properties: Option<&str>,
    keys: Option<Vec<String>>,
    registered: Option<Vec<String>>,
) -> Option<pgrx::composite_type!('static, "layer_write")> {
    let columns = Columns { tbl, id_column, geometry_column, version_column, retired_column };
    let w = write(layer, op, &columns, Key::parse(key, id_type), geometry, properties, keys, Some(registered.unwrap_or_default()))?;
    Some(super::row_of(
        c"layer_write",
        [
            (w.version.into_datum(), pg_sys::INT4OID),
            (w.row_version.into_datum(), pg_sys::TEXTOID),
            (w.geometry_digest.as_deref().map(digest_uuid).into_datum(), pg_sys::UUIDOID),
            (w.properties_digest.as_deref().map(digest_uuid).into_datum(), pg_sys::UUIDOID),
        ],
    ))
}

/// 0.3.0's declaration of `_layer_write_row` (its script names this symbol): the same write,
/// `{new version, row version, geometry digest, properties digest}` as text.
#[pg_extern(volatile, sql = false)]
#[allow(clippy::too_many_arguments)]
fn _layer_write_row(
    layer: &str,
    op: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    geometry_column: &str,
    version_column: &str,
    retired_column: Option<&str>,
    key: &str,
    id_type: &str,
    geometry: Option<AnyElement>,
    properties: Option<&str>,
    keys: Option<Vec<String>>,
    registered: Option<Vec<String>>,
) -> Option<Vec<Option<String>>> {
    let columns = Columns { tbl, id_column, geometry_column, version_column, retired_column };
    let w = write(layer, op, &columns, Key::parse(key, id_type), geometry, properties, keys, Some(registered.unwrap_or_default()))?;
    Some(vec![w.version.map(|v| v.to_string()), w.row_version, w.geometry_digest, w.properties_digest])
}

/// A digest as the write's statement returns it, md5 hex or uuid text (see `digests`), as the
/// uuid it is. Parsed by hand, without allocating: two a write, about 2,500 instructions each the
/// general way.
fn digest_uuid(text: &str) -> pgrx::Uuid {
    parse_digest(text).unwrap_or_else(|| error!("a layer write returned \"{text}\" as a digest, not 16 bytes in hex"))
}

fn parse_digest(text: &str) -> Option<pgrx::Uuid> {
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut bytes = [0u8; 16];
    let mut n = 0;
    for c in text.bytes().filter(|c| *c != b'-') {
        if n == 32 {
            return None;
        }
        bytes[n / 2] = (bytes[n / 2] << 4) | nibble(c)?;
        n += 1;
    }
    (n == 32).then(|| pgrx::Uuid::from_bytes(bytes))
}

/// A feature's key as a write binds it: a bigint (integer keys), or text cast to the id column's type.
enum Key {
    Id(i64),
    Text(String, String),
}

impl Key {
    /// `key` as text for a column of `id_type`. An integer key binds as the bigint it is (no cast in
    /// the statement); a malformed one goes through the cast, which raises its error.
    fn parse(key: &str, id_type: &str) -> Key {
        match (id_type, key.parse::<i64>()) {
            ("bigint", Ok(id)) => Key::Id(id),
            _ => Key::Text(key.to_string(), id_type.to_string()),
        }
    }

    /// `$1` as the statement uses it.
    fn param(&self) -> String {
        match self {
            Key::Id(_) => "$1".into(),
            Key::Text(_, id_type) => format!("$1::{id_type}"),
        }
    }

    fn bind(&self) -> (pg_sys::Oid, DatumWithOid<'_>) {
        match self {
            Key::Id(id) => (pg_sys::INT8OID, (*id).into()),
            Key::Text(key, _) => (pg_sys::TEXTOID, key.as_str().into()),
        }
    }
}

/// A layer's registered table and columns.
struct Columns<'a> {
    tbl: pg_sys::Oid,
    id_column: &'a str,
    geometry_column: &'a str,
    version_column: &'a str,
    retired_column: Option<&'a str>,
}

/// A layer row as a write left it (see `statement`): the digests only when it took them.
struct Written {
    version: Option<i32>,
    row_version: Option<String>,
    geometry_digest: Option<String>,
    properties_digest: Option<String>,
}

#[allow(clippy::too_many_arguments)]
fn write(
    layer: &str,
    op: &str,
    c: &Columns,
    key: Key,
    geometry: Option<AnyElement>,
    properties: Option<&str>,
    keys: Option<Vec<String>>,
    registered: Option<Vec<String>>,
) -> Option<Written> {
    let _caller = as_caller();
    let (name, partitioned) = table(layer, c.tbl);
    let keys = if op == "delete" { Vec::new() } else { keys.unwrap_or_default() };
    let target = Target {
        tbl: name,
        id: quote(c.id_column),
        geometry: quote(c.geometry_column),
        version: quote(c.version_column),
        retired: c.retired_column.map(quote),
        partitioned,
        key: key.param(),
    };
    let geometry_oid = geometry.as_ref().map(|g| g.oid());
    let sql = statement(&target, op, &keys, geometry_oid.is_some(), registered.as_deref());
    if !keys.is_empty() {
        check_properties(layer, &target.tbl, &keys, properties.unwrap_or("{}"));
    }
    let written = Spi::connect_mut(|client| {
        let (key_oid, key_arg) = key.bind();
        let mut types = vec![key_oid, pg_sys::TEXTOID];
        let mut args: Vec<DatumWithOid> = vec![key_arg, properties.into()];
        if let (Some(g), Some(oid)) = (geometry, geometry_oid) {
            types.push(oid);
            args.push(unsafe { DatumWithOid::new(g, oid) });
        }
        let plan = prepared(client, &sql, &types, true);
        let table = client.update(&*plan, None, &args).unwrap_or_else(|e| error!("layer write failed: {e}"));
        if table.is_empty() {
            return None;
        }
        let row = table.first();
        let version = match row.get::<i32>(1) {
            Ok(v) => v,
            Err(e) => report(
                PgSqlErrorCode::ERRCODE_DATATYPE_MISMATCH,
                format!("the version column {} of layer {layer} is no longer integer: {e}", target.version),
                None,
                Some("Register the layer again once its version column is integer NOT NULL."),
            ),
        };
        let text = |i: usize| row.get::<String>(i).ok().flatten();
        let digests = row.columns().unwrap_or(2) >= 4;
        Some(Written {
            version,
            row_version: text(2),
            geometry_digest: if digests { text(3) } else { None },
            properties_digest: if digests { text(4) } else { None },
        })
    })?;
    if target.partitioned && op != "delete" {
        let sql = format!("SELECT {ROW_VERSION} FROM {} t WHERE t.{} = {}", target.tbl, target.id, target.key);
        let row_version = Spi::connect(|client| {
            let (key_oid, key_arg) = key.bind();
            let plan = prepared(client, &sql, &[key_oid], false);
            client.select(&*plan, Some(1), &[key_arg]).ok().and_then(|t| t.first().get::<String>(1).ok().flatten())
        });
        return Some(Written { row_version, ..written });
    }
    Some(written)
}

/// Converts each given property to its column's type, as the write will; the first that does not
/// fit raises its own error (class 22) with the property's name. Runs as the caller. Other errors
/// (a cancel, a statement timeout) pass through unchanged.
fn check_properties(layer: &str, tbl: &str, keys: &[String], properties: &str) {
    let columns: Vec<String> = keys.iter().map(|k| format!("r.{}", quote(k))).collect();
    let sql = format!("SELECT {} FROM jsonb_populate_record(NULL::{tbl}, $1::jsonb) r", columns.join(", "));
    let all = subxact::run(|| {
        Spi::connect(|client| {
            let plan = prepared(client, &sql, &[pg_sys::TEXTOID], false);
            client.select(&*plan, None, &[properties.into()]).map(|_| ()).unwrap_or_else(|e| error!("{e}"));
        })
    });
    let Err(first) = all else { return };
    let failed = |f: &subxact::Failure| -> ! {
        if f.code == PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN {
            report(
                f.code,
                format!("a registered property of layer {layer} is no longer a column of {tbl}: {}", f.message),
                None,
                Some("Register the layer again with its current columns."),
            );
        }
        report(f.code, f.message.clone(), f.detail.clone(), None)
    };
    if !is_data_exception(first.code) {
        failed(&first);
    }
    // Find the property: one key at a time.
    for key in keys {
        let sql = format!("SELECT r.{} FROM jsonb_populate_record(NULL::{tbl}, jsonb_build_object($2, ($1::jsonb) -> $2)) r", quote(key));
        if let Err(f) = subxact::run(|| {
            Spi::connect(|client| {
                let plan = prepared(client, &sql, &[pg_sys::TEXTOID, pg_sys::TEXTOID], false);
                client.select(&*plan, None, &[properties.into(), key.as_str().into()]).map(|_| ()).unwrap_or_else(|e| error!("{e}"));
            })
        }) {
            if !is_data_exception(f.code) {
                failed(&f);
            }
            report(
                f.code,
                format!("property \"{key}\" does not fit its column in {tbl}: {}", f.message),
                f.detail,
                Some("Give each property as JSON that converts to its column's type, as jsonb_populate_record converts it."),
            );
        }
    }
    report(first.code, format!("properties do not fit the columns of {tbl}: {}", first.message), first.detail, None)
}

/// SQLSTATE class 22: the value does not fit.
fn is_data_exception(code: PgSqlErrorCode) -> bool {
    let sqlstate = code as i32;
    // PGSIXBIT packs the five characters six bits each, first character lowest.
    (sqlstate & 0x3f) == ('2' as i32 - '0' as i32) && ((sqlstate >> 6) & 0x3f) == ('2' as i32 - '0' as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(partitioned: bool) -> Target {
        Target {
            tbl: "public.parcels".into(),
            id: quote("id"),
            geometry: quote("geom"),
            version: quote("version"),
            retired: Some(quote("retired_at")),
            partitioned,
            key: "$1".into(),
        }
    }

    #[test]
    fn digests_parse_from_md5_hex_and_uuid_text() {
        let hex = "0123456789abcdefFEDCBA9876543210";
        let bytes = [0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10];
        assert_eq!(parse_digest(hex).map(|u| *u.as_bytes()), Some(bytes));
        assert_eq!(parse_digest("01234567-89ab-cdef-fedc-ba9876543210").map(|u| *u.as_bytes()), Some(bytes));
        for bad in ["", "0123", "0123456789abcdef0123456789abcdef00", "0123456789abcdefg123456789abcdef"] {
            assert!(parse_digest(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn statements_set_only_what_the_edit_gives() {
        let q = |s: &str| s.replace('`', "\"");
        let t = target(false);
        let moved = statement(&t, "moved", &[], true, None);
        assert!(moved.starts_with(&q("UPDATE public.parcels AS t SET `version` = t.`version` + 1, `geom` = $3 WHERE t.`id` = $1 AND t.`retired_at` IS NULL")));
        assert!(moved.ends_with(&format!("RETURNING t.\"version\", {ROW_VERSION}")));
        let updated = statement(&t, "updated", &["name".into()], false, None);
        assert!(updated.contains(&q("SET `version` = t.`version` + 1, `name` = r.`name` FROM jsonb_populate_record(NULL::public.parcels, $2::jsonb) r")));
        assert!(!updated.contains("geom"));
        let created = statement(&t, "created", &["name".into()], true, None);
        assert!(created.contains(&q("(`id`, `geom`, `version`, `name`) SELECT $1, $3, 1, r.`name` FROM jsonb_populate_record")));
        assert!(created.contains(&q("ON CONFLICT (`id`) DO NOTHING")));
        assert!(statement(&t, "retired", &[], false, None).contains(&q("`retired_at` = now()")));
        assert!(statement(&t, "record_retired", &[], false, None).contains(&q("`retired_at` = coalesce(t.`retired_at`, now())")));
        assert!(!statement(&t, "record_retired", &[], false, None).contains("IS NULL"));
        assert!(statement(&t, "record_created", &[], false, None).contains(&q("SET `version` = 1")));
        assert!(statement(&t, "delete", &[], false, None).starts_with(&q("DELETE FROM public.parcels AS t WHERE t.`id` = $1")));
        // A partitioned table returns no system columns from INSERT.
        assert!(statement(&target(true), "created", &[], true, None).ends_with("RETURNING t.\"version\", NULL::text"));
        assert_eq!(quote("we\"ird"), "\"we\"\"ird\"");
        // With the registered properties, the row's digests follow, deleted rows' included.
        let digested = statement(&t, "updated", &[], false, Some(&["name".into(), "zone".into()]));
        assert!(digested.ends_with(&q("md5(ST_AsEWKB(t.`geom`)), feature_outbox._properties_digest(ROW(t.`name`, t.`zone`))::text")));
        assert!(statement(&t, "delete", &[], false, Some(&[])).ends_with("_properties_digest(ROW())::text"));
    }

    #[test]
    fn data_exceptions_are_class_22() {
        assert!(is_data_exception(PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION));
        assert!(is_data_exception(PgSqlErrorCode::ERRCODE_STRING_DATA_RIGHT_TRUNCATION));
        assert!(!is_data_exception(PgSqlErrorCode::ERRCODE_QUERY_CANCELED));
        assert!(!is_data_exception(PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN));
    }
}
