//! The C entry points of the edit path, and what each runs.
//!
//! edit_feature(layer, ...), record_edit, register_layer, unregister_layer, release_layer and the
//! chunks of backfill, drift and resync are C functions. Each records the role calling it (exactly
//! `current_user` there), then runs its SQL body as the function's owner, the extension's owner,
//! which alone may write the outbox, the per-feature state and the registry (see `layers.rs` for how
//! the body gets back to the caller's rights for the user's table).
//!
//! Which body runs is stated here, once per entry point (`entry_points!` below): each has a C symbol
//! of its own, which its SQL declaration names (`AS 'MODULE_PATHNAME', '<symbol>'`). Nothing is
//! looked up by the function's name at run time, so renaming or overloading a SQL function cannot
//! change what it runs. `tests::every_entry_point_runs_what_its_entry_says` holds the catalog to
//! this table: every C function of the schema outside pgrx's and every edit_feature and record_edit
//! overload is an entry here, and every entry is declared as it says.

use std::ffi::CStr;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;
use pgrx::prelude::*;

use pgrx::pg_sys::panic::ErrorReport;

use crate::event_origin::{self, Origin};
use crate::plans::prepared;
use crate::roles::{self, As, Calling};

/// What an entry point returns, as its SQL declaration says and its body returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Returns {
    Integer,
    Bigint,
    Texts,
    Void,
    /// 0.2.0's _backfill_chunk (`feature_outbox_entry`), and _capture_rows.
    Bigints,
}

impl Returns {
    pub fn oid(self) -> pg_sys::Oid {
        match self {
            Returns::Integer => pg_sys::INT4OID,
            Returns::Bigint => pg_sys::INT8OID,
            Returns::Texts => pg_sys::TEXTARRAYOID,
            Returns::Void => pg_sys::VOIDOID,
            Returns::Bigints => pg_sys::INT8ARRAYOID,
        }
    }
}

/// One SQL entry point and what it runs.
#[derive(Debug)]
pub struct Entry {
    /// The C symbol its SQL declaration names.
    pub symbol: &'static str,
    /// Its SQL signature, `name(type, ...)` with each type as format_type writes it.
    pub signature: &'static str,
    /// The statement it runs as the function's owner; `$1`... are its arguments, as declared.
    pub body: &'static str,
    pub returns: Returns,
    /// Its number of arguments (of `signature`).
    pub nargs: usize,
    /// The origin its body's events get (src/event_origin.rs); None: the caller's, so that an
    /// entry point called by the capture worker writes `captured` events.
    pub origin: Option<Origin>,
}

/// The number of arguments of a signature `name(type, ...)`.
const fn arity(signature: &str) -> usize {
    let bytes = signature.as_bytes();
    let (mut i, mut commas, mut empty) = (0, 0, false);
    while i < bytes.len() {
        if bytes[i] == b',' {
            commas += 1;
        }
        if bytes[i] == b'(' && i + 1 < bytes.len() && bytes[i + 1] == b')' {
            empty = true;
        }
        i += 1;
    }
    if empty { 0 } else { commas + 1 }
}

const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };

/// An entry point's origin: `@ Resync` after its return type, else None.
macro_rules! origin {
    () => {
        None
    };
    ($origin:ident) => {
        Some(Origin::$origin)
    };
}

/// An entry point's first try, `first <path>` after its return type: a fn that may answer the call
/// itself (`moved::try_moved`) before the body runs. None: the body.
macro_rules! first {
    () => {
        None
    };
    ($first:path) => {
        Some($first)
    };
}

/// Declares each entry point: its finfo and C symbol, and its row of `ENTRIES`, from one line.
macro_rules! entry_points {
    ($($finfo:ident $symbol:ident $signature:literal -> $returns:ident $(@ $origin:ident)? $(first $first:path)?: $body:literal;)*) => {
        /// Every C entry point of the current SQL (sql/*.sql), with what it runs. Read by the test
        /// that holds the catalog to it.
        #[allow(dead_code)]
        pub const ENTRIES: &[Entry] = &[$(
            Entry {
                symbol: stringify!($symbol),
                signature: $signature,
                body: $body,
                returns: Returns::$returns,
                nargs: arity($signature),
                origin: origin!($($origin)?),
            },
        )*];
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $finfo() -> &'static pg_sys::Pg_finfo_record {
                &V1
            }

            #[doc = concat!("`", $signature, "`: runs `", $body, "`.")]
            #[pg_guard]
            #[unsafe(no_mangle)]
            pub unsafe extern "C-unwind" fn $symbol(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
                const ENTRY: Entry = Entry {
                    symbol: stringify!($symbol),
                    signature: $signature,
                    body: $body,
                    returns: Returns::$returns,
                    nargs: arity($signature),
                    origin: origin!($($origin)?),
                };
                unsafe { run(fcinfo, &ENTRY, first!($($first)?)) }
            }
        )*
    };
}

// The built-in layer's two forms try the built-in move first (moved.rs), then _edit. A layer
// keyed by uuid or text goes through _edit_key and _record_edit_key, which find the
// feature's number for its key. The GeoJSON forms hand _edit the parsed EWKB. `@ Resync`: the
// events its body writes say so (src/event_origin.rs).
entry_points! {
    pg_finfo_feature_outbox_edit_built_in_geometry feature_outbox_edit_built_in_geometry
        "edit_feature(bigint, geometry, text)" -> Integer first super::moved::try_moved:
        "SELECT feature_outbox._edit('features', $1, $2, $3, NULL, NULL, false)";
    pg_finfo_feature_outbox_edit_built_in_geojson feature_outbox_edit_built_in_geojson
        "edit_feature(bigint, text, text)" -> Integer first super::moved::try_moved_geojson:
        "SELECT feature_outbox._edit('features', $1, NULL, $3, feature_outbox._geojson_to_ewkb($2), NULL, false)";
    pg_finfo_feature_outbox_edit_geojson feature_outbox_edit_geojson
        "edit_feature(text, bigint, text, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit($1, $2, NULL, $4, feature_outbox._geojson_to_ewkb($3), $5, false)";
    pg_finfo_feature_outbox_edit_geometry feature_outbox_edit_geometry
        "edit_feature(text, bigint, geometry, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit($1, $2, $3, $4, NULL, $5, false)";
    pg_finfo_feature_outbox_edit_text_key_geojson feature_outbox_edit_text_key_geojson
        "edit_feature(text, text, text, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit_key($1, $2, NULL, $4, feature_outbox._geojson_to_ewkb($3), $5, false)";
    pg_finfo_feature_outbox_edit_text_key_geometry feature_outbox_edit_text_key_geometry
        "edit_feature(text, text, geometry, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit_key($1, $2, $3, $4, NULL, $5, false)";
    pg_finfo_feature_outbox_edit_uuid_key_geojson feature_outbox_edit_uuid_key_geojson
        "edit_feature(text, uuid, text, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit_key($1, $2::pg_catalog.text, NULL, $4, feature_outbox._geojson_to_ewkb($3), $5, false)";
    pg_finfo_feature_outbox_edit_uuid_key_geometry feature_outbox_edit_uuid_key_geometry
        "edit_feature(text, uuid, geometry, text, jsonb)" -> Integer:
        "SELECT feature_outbox._edit_key($1, $2::pg_catalog.text, $3, $4, NULL, $5, false)";
    pg_finfo_feature_outbox_record_edit feature_outbox_record_edit
        "record_edit(text, bigint, text)" -> Integer:
        "SELECT feature_outbox._record_edit($1, $2, $3)";
    pg_finfo_feature_outbox_record_edit_text_key feature_outbox_record_edit_text_key
        "record_edit(text, text, text)" -> Integer:
        "SELECT feature_outbox._record_edit_key($1, $2, $3)";
    pg_finfo_feature_outbox_record_edit_uuid_key feature_outbox_record_edit_uuid_key
        "record_edit(text, uuid, text)" -> Integer:
        "SELECT feature_outbox._record_edit_key($1, $2::pg_catalog.text, $3)";
    pg_finfo_feature_outbox_register_layer feature_outbox_register_layer
        "register_layer(text, regclass, name, name, name, name[], name)" -> Void:
        "SELECT feature_outbox._register_layer($1, $2, $3, $4, $5, $6, $7)";
    pg_finfo_feature_outbox_unregister_layer feature_outbox_unregister_layer
        "unregister_layer(text)" -> Void:
        "SELECT feature_outbox._unregister_layer($1)";
    pg_finfo_feature_outbox_release_layer feature_outbox_release_layer
        "release_layer(text, regclass)" -> Bigint:
        "SELECT feature_outbox._release_layer($1, $2)";
    pg_finfo_feature_outbox_backfill_chunk feature_outbox_backfill_chunk
        "_backfill_chunk(text, geometry, text, integer)" -> Texts:
        "SELECT feature_outbox.__backfill_chunk($1, $2, $3, $4)";
    pg_finfo_feature_outbox_drift_chunk feature_outbox_drift_chunk
        "_drift_chunk(text, integer, text, integer, bigint)" -> Texts:
        "SELECT feature_outbox.__drift_chunk($1, $2, $3, $4, $5)";
    pg_finfo_feature_outbox_resync_chunk feature_outbox_resync_chunk
        "_resync_chunk(text, integer, text, integer, integer, bigint)" -> Texts @ Resync:
        "SELECT feature_outbox.__resync_chunk($1, $2, $3, $4, $5, $6)";
    pg_finfo_feature_outbox_capture_rows feature_outbox_capture_rows
        "_capture_rows(text, text[], text[])" -> Bigints:
        "SELECT feature_outbox.__capture_rows($1, $2, $3)";
}

/// An entry point's first try: the call's result, or None for its body to run.
type First = unsafe fn(pg_sys::FunctionCallInfo, &Declared) -> Option<pg_sys::Datum>;

/// Runs `entry` for the call `fcinfo`: `first` when it has one, as the function's owner with the
/// calling role recorded, then its body unless `first` answered. A declaration that does not match
/// the entry (a SQL function bound to the wrong symbol) raises XX000 instead of reading its
/// arguments or result as another's.
unsafe fn run(fcinfo: pg_sys::FunctionCallInfo, entry: &Entry, first: Option<First>) -> pg_sys::Datum {
    unsafe {
        let declared = Declared::of((*(*fcinfo).flinfo).fn_oid);
        if declared.returns != entry.returns.oid() || declared.types.len() != entry.nargs {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
                format!("function {} is bound to {}, the C entry point of {}", declared.name, entry.symbol, entry.signature),
                "feature_outbox",
            )
            .set_hint("Update the extension: ALTER EXTENSION feature_outbox UPDATE.")
            .report(PgLogLevel::ERROR);
        }
        declared.refuse_read_only();
        as_owner(&declared, || {
            if let Some(result) = first.and_then(|first| first(fcinfo, &declared)) {
                return result;
            }
            match entry.origin {
                Some(origin) => event_origin::with(origin, || call(fcinfo, entry.body, &declared, entry.returns)),
                None => call(fcinfo, entry.body, &declared, entry.returns),
            }
        })
    }
}

/// 0.1.0 to 0.3.0's C body of every entry point (their scripts bind this symbol). It finds the
/// body by the function's own name: `feature_outbox._<name>` with the same arguments, the forms of
/// edit_feature and record_edit as `ENTRIES` has them. Only the frozen scripts of released
/// versions use it, whose names never change; the current SQL binds `ENTRIES`' symbols.
#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_feature_outbox_entry() -> &'static pg_sys::Pg_finfo_record {
    &V1
}

/// See `pg_finfo_feature_outbox_entry`.
#[pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn feature_outbox_entry(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        let declared = Declared::of((*(*fcinfo).flinfo).fn_oid);
        declared.refuse_read_only();
        let types = &declared.types;
        let params = (1..=types.len()).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ");
        let keyed = matches!(types.get(1), Some(&pg_sys::TEXTOID) | Some(&pg_sys::UUIDOID));
        let edit = if keyed { "_edit_key($1, $2::pg_catalog.text" } else { "_edit($1, $2" };
        let sql = match declared.name.as_str() {
            "edit_feature" if types.get(2) == Some(&pg_sys::TEXTOID) => {
                format!("SELECT feature_outbox.{edit}, NULL, $4, feature_outbox._geojson_to_ewkb($3), $5, false)")
            }
            "edit_feature" => format!("SELECT feature_outbox.{edit}, $3, $4, NULL, $5, false)"),
            "record_edit" if keyed => "SELECT feature_outbox._record_edit_key($1, $2::pg_catalog.text, $3)".to_string(),
            other => format!("SELECT feature_outbox._{other}({params})"),
        };
        let returns = [Returns::Bigints, Returns::Texts, Returns::Bigint, Returns::Void]
            .into_iter()
            .find(|r| r.oid() == declared.returns)
            .unwrap_or(Returns::Integer);
        as_owner(&declared, || call(fcinfo, &sql, &declared, returns))
    }
}

/// Runs `f` as `declared`'s owner, with the calling role recorded for `_layer_write_row` and
/// `_as_caller_row`; both are undone when `f` returns or an ERROR unwinds through it.
fn as_owner<R>(declared: &Declared, f: impl FnOnce() -> R) -> R {
    let caller = roles::current();
    let _calling = Calling::push(caller);
    let _owner = As::enter(declared.owner, caller.context, 0);
    f()
}

/// A function as pg_proc declares it.
pub(super) struct Declared {
    name: String,
    /// Its owner: the extension's owner, who created it.
    owner: pg_sys::Oid,
    returns: pg_sys::Oid,
    /// Its argument types (PostGIS's geometry among them, whose OID no constant gives).
    pub(super) types: Vec<pg_sys::Oid>,
}

impl Declared {
    unsafe fn of(oid: pg_sys::Oid) -> Declared {
        unsafe {
            let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::PROCOID as i32, pg_sys::Datum::from(oid));
            if tuple.is_null() {
                error!("cache lookup failed for function {oid:?}");
            }
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_proc>(tuple);
            let declared = Declared {
                name: CStr::from_ptr((*form).proname.data.as_ptr()).to_string_lossy().into_owned(),
                owner: (*form).proowner,
                returns: (*form).prorettype,
                types: (*form).proargtypes.values.as_slice((*form).pronargs as usize).to_vec(),
            };
            pg_sys::ReleaseSysCache(tuple);
            declared
        }
    }

    /// Every entry point writes: in a read-only transaction (a hot standby's included) it raises
    /// 25006, and in parallel mode 25000, as its statements would, before any of them runs. pgrx's
    /// read-write SPI takes a transaction id first, which a standby refuses with XX000.
    fn refuse_read_only(&self) {
        let name = std::ffi::CString::new(self.name.as_str()).unwrap_or_default();
        unsafe {
            pg_sys::PreventCommandIfReadOnly(name.as_ptr());
            pg_sys::PreventCommandIfParallelMode(name.as_ptr());
        }
    }
}

/// What a body returned, read as a Rust value inside SPI.
enum Returned {
    Integer(i32),
    Bigint(i64),
    Bigints(Vec<Option<i64>>),
    Texts(Vec<Option<String>>),
}

/// Runs `sql` with the call's arguments (its callers run it `as_owner`) and returns its one value
/// as `returns` (NULL for void and for no row).
unsafe fn call(fcinfo: pg_sys::FunctionCallInfo, sql: &str, declared: &Declared, returns: Returns) -> pg_sys::Datum {
    unsafe {
        let types = &declared.types;
        if (*fcinfo).nargs as usize != types.len() {
            error!("function {} was called with {} arguments, not its {}", declared.name, (*fcinfo).nargs, types.len());
        }
        let args: Vec<DatumWithOid> = (0..types.len())
            .map(|i| {
                if pgrx::fcinfo::pg_arg_is_null(fcinfo, i) {
                    DatumWithOid::null_oid(types[i])
                } else {
                    DatumWithOid::new(pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, i), types[i])
                }
            })
            .collect();
        // Turned into a datum after SPI, in the caller's memory context.
        let result: Option<Returned> = Spi::connect_mut(|client| {
            let plan = prepared(client, sql, types, true);
            let table = client.update(&*plan, None, &args).unwrap_or_else(|e| error!("{e}"));
            if table.is_empty() {
                return None;
            }
            let first = table.first();
            match returns {
                Returns::Bigints => first.get::<Vec<Option<i64>>>(1).ok().flatten().map(Returned::Bigints),
                Returns::Texts => first.get::<Vec<Option<String>>>(1).ok().flatten().map(Returned::Texts),
                Returns::Bigint => first.get::<i64>(1).ok().flatten().map(Returned::Bigint),
                Returns::Integer => first.get::<i32>(1).ok().flatten().map(Returned::Integer),
                Returns::Void => None,
            }
        });
        match result.and_then(|r| match r {
            Returned::Integer(v) => Some(pg_sys::Datum::from(v)),
            Returned::Bigint(v) => v.into_datum(),
            Returned::Bigints(array) => array.into_datum(),
            Returned::Texts(array) => array.into_datum(),
        }) {
            Some(v) => v,
            None => pgrx::fcinfo::pg_return_null(fcinfo),
        }
    }
}

#[cfg(any(test, feature = "pg_test"))]
#[pgrx::pg_schema]
mod tests {
    use std::collections::BTreeMap;
    use std::ffi::CString;

    use pgrx::prelude::*;
    use pgrx::{PgList, pg_sys};

    use super::ENTRIES;

    /// A function of the schema as the catalog has it.
    struct Function {
        language: String,
        source: String,
        returns: pg_sys::Oid,
        types: Vec<pg_sys::Oid>,
    }

    /// The type of the one column `sql` returns when prepared with parameter `types`.
    fn result_type(sql: &str, types: &[pg_sys::Oid]) -> pg_sys::Oid {
        let query = CString::new(sql).unwrap();
        let mut types = types.to_vec();
        Spi::connect(|_| unsafe {
            let plan = pg_sys::SPI_prepare(query.as_ptr(), types.len() as i32, types.as_mut_ptr());
            assert!(!plan.is_null(), "{sql} does not prepare");
            let sources = PgList::<pg_sys::CachedPlanSource>::from_pg(pg_sys::SPI_plan_get_plan_sources(plan));
            let desc = (*sources.get_ptr(0).unwrap()).resultDesc;
            assert_eq!((*desc).natts, 1, "{sql} returns one column");
            // Through PgTupleDesc: PostgreSQL 18 keeps attributes behind compact_attrs.
            pgrx::PgTupleDesc::from_pg_unchecked(desc).get(0).map(|a| a.atttypid).unwrap_or(pg_sys::InvalidOid)
        })
    }

    /// The dispatch table against the catalog, both ways: every C function of the schema that
    /// pgrx did not declare (but _event_origin and _outbox_values_valid, a column default and a CHECK
    /// that run no body), and every
    /// edit_feature and record_edit overload, is an entry point
    /// bound to the symbol its entry names; every entry has its SQL function, declared with the
    /// entry's return type; and each body prepares with the function's argument types and returns
    /// that type.
    #[pg_test]
    fn every_entry_point_runs_what_its_entry_says() {
        // Signatures as the table writes them: unqualified, PostGIS's types included.
        Spi::run(
            "SELECT set_config('search_path', 'feature_outbox, ' || quote_ident(n.nspname), true)
               FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'postgis'",
        )
        .unwrap();
        let catalog: BTreeMap<String, Function> = Spi::connect(|client| {
            client
                .select(
                    "SELECT p.oid::regprocedure::text, l.lanname::text, p.prosrc, p.prorettype,
                            ARRAY(SELECT a.t FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY a(t, n) ORDER BY a.n)
                       FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
                      WHERE p.pronamespace = 'feature_outbox'::regnamespace
                        AND ((l.lanname = 'c' AND p.prosrc NOT LIKE '%\\_wrapper' AND p.prosrc NOT IN ('feature_outbox_event_origin', 'feature_outbox_outbox_values_valid'))
                             OR p.proname IN ('edit_feature', 'record_edit'))",
                    None,
                    &[],
                )
                .unwrap()
                .map(|row| {
                    let f = Function {
                        language: row.get(2).unwrap().unwrap(),
                        source: row.get(3).unwrap().unwrap(),
                        returns: row.get(4).unwrap().unwrap(),
                        types: row.get(5).unwrap().unwrap(),
                    };
                    (row.get::<String>(1).unwrap().unwrap(), f)
                })
                .collect()
        });
        let entries: BTreeMap<String, &super::Entry> = ENTRIES.iter().map(|e| (e.signature.replace(' ', ""), e)).collect();
        assert_eq!(entries.len(), ENTRIES.len(), "two entries with one signature");
        let symbols: std::collections::BTreeSet<&str> = ENTRIES.iter().map(|e| e.symbol).collect();
        assert_eq!(symbols.len(), ENTRIES.len(), "two entries with one symbol");
        for (signature, f) in &catalog {
            let entry = entries.get(signature).unwrap_or_else(|| panic!("{signature} ({} {}) is not in ENTRIES", f.language, f.source));
            assert_eq!((f.language.as_str(), f.source.as_str()), ("c", entry.symbol), "{signature}");
        }
        for (signature, entry) in &entries {
            let f = catalog.get(signature).unwrap_or_else(|| panic!("ENTRIES has {signature}, the SQL does not"));
            assert_eq!(f.returns, entry.returns.oid(), "{signature} is declared returning another type");
            assert_eq!(f.types.len(), entry.nargs, "{signature}");
            assert_eq!(result_type(entry.body, &f.types), entry.returns.oid(), "{signature} runs {}", entry.body);
        }
    }
}
