//! The Rust half of `edit_feature` (the SQL half is `sql/edit.sql`): GeoJSON parsing, the one pass
//! over the geometry (`inspect`), polar caps and the H3 cell. Each maps `InputError` to
//! `ereport(ERROR)` with its class-22 SQLSTATE.

use std::ffi::CStr;

use pgrx::heap_tuple::PgHeapTuple;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::{AllocatedByRust, PgTupleDesc};

use crate::input_error::{Code, InputError};
use crate::{geojson, routing, settings};

mod area_of_use;
mod digest;
pub mod inspect;
pub mod layers;
mod polar;
pub mod entry;
mod moved;
mod postgis;

pub(crate) fn ok_or_report<T>(r: Result<T, InputError>, funcname: &'static str) -> T {
    match r {
        Ok(v) => v,
        Err(e) => {
            let code = match e.code {
                Code::InvalidText => PgSqlErrorCode::ERRCODE_INVALID_TEXT_REPRESENTATION,
                Code::InvalidParameter => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
                Code::OutOfRange => PgSqlErrorCode::ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE,
            };
            let mut report = ErrorReport::new(code, e.message, funcname);
            if let Some(hint) = e.hint {
                report = report.set_hint(hint);
            }
            report.report(PgLogLevel::ERROR);
            unreachable!("ERROR does not return")
        }
    }
}

/// A row of composite type `name` of the extension's schema (sql/schema.sql), from its column
/// values in order, each with the type its column must have. The type is found in the system
/// caches and its descriptor used from the type cache, not copied: about a thousand instructions,
/// where pgrx's `PgHeapTuple::new_composite_type` parses the name as SQL at every call. A type
/// altered by hand so that a value no longer fits its column raises XX000 instead of storing it.
pub(crate) fn row_of<const N: usize>(
    name: &CStr,
    values: [(Option<pg_sys::Datum>, pg_sys::Oid); N],
) -> PgHeapTuple<'static, AllocatedByRust> {
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"feature_outbox".as_ptr(), false);
        let typoid = pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::TYPENAMENSP as i32,
            pg_sys::Anum_pg_type_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(name.as_ptr()),
            pg_sys::Datum::from(schema),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        );
        let name = name.to_string_lossy();
        if typoid == pg_sys::InvalidOid {
            error!("type feature_outbox.{name} does not exist");
        }
        let tupdesc = PgTupleDesc::from_pg(pg_sys::lookup_rowtype_tupdesc(typoid, -1));
        if tupdesc.len() != N || tupdesc.iter().zip(&values).any(|(a, (_, t))| a.type_oid().value() != *t) {
            error!("type feature_outbox.{name} does not have the columns this library writes; update the extension");
        }
        PgHeapTuple::from_datums(tupdesc, values.map(|(v, _)| v)).unwrap_or_else(|e| error!("{e}"))
    }
}

/// GeoJSON geometry text (RFC 7946) to EWKB with its SRID (4326 unless a `crs` member says otherwise).
/// Raises 22P02 for malformed GeoJSON and 22023 for altitudes, empty geometries or unknown CRS names,
/// in a database of any encoding (ServerText).
#[pg_extern(immutable, strict, parallel_safe)]
fn _geojson_to_ewkb(geojson: crate::server_text::ServerText) -> Vec<u8> {
    ok_or_report(geojson::to_ewkb(&geojson.0), "edit_feature")
}

/// The one pass over an edit's geometry (see `inspect::inspect`).
///
/// `wkb`: ISO WKB or EWKB. `lonlat`: the coordinates are EPSG:4326 degrees, so check their range and
/// report the bounding box. `source_srid`: the SRID the edit was given in; when it is not 4326, rings
/// around a pole are reported. `crs`: that SRID's `auth_name:auth_srid` from spatial_ref_sys, whose
/// area of use (PROJ's database, widened by `feature_outbox.area_of_use_margin` degrees) every
/// coordinate must lie in; NULL skips the test.
///
/// Returns a `geometry_facts` (sql/schema.sql): `antimeridian` (an edge crosses it), `polar` (-1: a
/// ring winds around the South Pole, 1: the North Pole, 0: neither), `bbox` ({west, south, east,
/// north} in degrees, RFC 7946 §5.2) and `h3_resolution` (`feature_outbox.h3_resolution` now, read
/// here, where it costs nothing). Raises 22023, 22003 or 22P02 as `inspect` says, before anything is
/// written.
#[pg_extern(stable, parallel_safe, name = "_inspect_geometry")]
fn _inspect_geometry_facts(
    wkb: &[u8],
    lonlat: bool,
    source_srid: i32,
    crs: Option<&str>,
) -> pgrx::composite_type!('static, "geometry_facts") {
    let (facts, resolution) = inspect_edit(wkb, lonlat, source_srid, crs);
    row_of(
        c"geometry_facts",
        [
            (facts.crosses_antimeridian.into_datum(), pg_sys::BOOLOID),
            (pole(&facts).into_datum(), pg_sys::INT4OID),
            (facts.bbox.to_vec().into_datum(), pg_sys::FLOAT8ARRAYOID),
            (resolution.into_datum(), pg_sys::INT4OID),
        ],
    )
}

/// 0.1.0 to 0.3.0's declaration of `_inspect_geometry` (their scripts name this symbol): the same
/// facts as `{crosses_antimeridian 0|1, pole -1|0|1, west, south, east, north, h3_resolution}`.
#[pg_extern(stable, parallel_safe, sql = false)]
fn _inspect_geometry(wkb: &[u8], lonlat: bool, source_srid: i32, crs: Option<&str>) -> Vec<f64> {
    let (facts, resolution) = inspect_edit(wkb, lonlat, source_srid, crs);
    let [west, south, east, north] = facts.bbox;
    let crosses = f64::from(u8::from(facts.crosses_antimeridian));
    vec![crosses, f64::from(pole(&facts)), west, south, east, north, f64::from(resolution)]
}

#[inline(never)] // a step of its own in bench/edit_steps.py
fn inspect_edit(wkb: &[u8], lonlat: bool, source_srid: i32, crs: Option<&str>) -> (inspect::Facts, i32) {
    let area = crs.and_then(area_of_use::lookup);
    let rules = inspect::Rules {
        lonlat,
        area: area.as_ref().map(|a| (a, settings::AREA_OF_USE_MARGIN.get())),
        find_poles: lonlat && source_srid != 4326,
    };
    (ok_or_report(inspect::inspect(wkb, &rules), "edit_feature"), settings::H3_RESOLUTION.get())
}

/// The encircled pole as `geometry_facts.polar` gives it: -1 South, 1 North, 0 none.
fn pole(facts: &inspect::Facts) -> i32 {
    match facts.encircled_pole {
        Some(inspect::Pole::South) => -1,
        Some(inspect::Pole::North) => 1,
        None => 0,
    }
}

/// The area-of-use test of `_inspect_geometry`, for the CRS a layer stores in: every coordinate of
/// `wkb` (EPSG:4326 degrees) must lie in the area of use of `crs` (`auth_name:auth_srid`), widened
/// by `feature_outbox.area_of_use_margin` degrees, the rule an edit given in that CRS meets. So a
/// shape stored now is never one a later edit in the column's own SRID refuses. Raises 22023 naming
/// `layer`; a CRS without a recorded area passes.
#[pg_extern(stable, parallel_safe)]
fn _check_storage_area(wkb: &[u8], crs: &str, layer: &str) {
    let Some(mut area) = area_of_use::lookup(crs) else { return };
    area.layer = Some(layer.to_string());
    let rules = inspect::Rules { lonlat: true, area: Some((&area, settings::AREA_OF_USE_MARGIN.get())), find_poles: false };
    ok_or_report(inspect::inspect(wkb, &rules).map(|_| ()), "edit_feature")
}

/// EWKB (SRID 4326) of the same Polygon or MultiPolygon with each ring around a pole rebuilt as a
/// polar cap that covers it (see `polar`). `wkb`: the shape after ST_Transform to 4326, densified in
/// its source CRS first. Raises 22023 when the shape cannot be rebuilt.
#[pg_extern(immutable, strict, parallel_safe)]
fn _close_polar_caps(wkb: &[u8]) -> Vec<u8> {
    geojson::with_srid(ok_or_report(polar::close_polar_caps(wkb), "edit_feature"), 4326)
}

/// H3 cell (lowercase hex) of a routing point, `lon` and `lat` in EPSG:4326 degrees, at H3
/// `resolution` 0–15. A longitude in (180, 360), from a point taken on the longitude-shifted shape
/// of a feature across the antimeridian, is wrapped back to [-180, 180]. Raises 22023 for a
/// non-finite point and 22003 for one out of range.
#[pg_extern(immutable, strict, parallel_safe)]
#[inline(never)] // a step of its own in bench/edit_steps.py
fn _h3_cell(lon: f64, lat: f64, resolution: i32) -> String {
    let lon = if lon > 180.0 { lon - 360.0 } else { lon };
    let res = ok_or_report(routing::resolution_of(resolution), "edit_feature");
    ok_or_report(routing::cell_for_lonlat(lon, lat, res), "edit_feature")
}

/// The H3 parent (lowercase hex) of routing key `cell` at `resolution` 0–15; the cell itself at its
/// own resolution. Raises 22023 for a resolution finer than the cell's own or outside 0–15, and
/// 22P02 for text that is not an H3 cell.
#[pg_extern(immutable, strict, parallel_safe)]
fn _h3_parent(cell: &str, resolution: i32) -> String {
    ok_or_report(routing::parent(cell, resolution), "backlog_by_cell")
}

// The 0.1.0 helpers. 0.1.0's install script declares them, so their symbols stay; 0.2.0 no longer
// declares them as SQL functions (the upgrade script drops them).

/// 0.1.0: checks every coordinate of a 2-D WKB geometry (see `inspect::check`).
#[pg_extern(immutable, strict, parallel_safe, sql = false)]
fn _check_coordinates(wkb: &[u8], lonlat: bool) {
    ok_or_report(inspect::check(wkb, lonlat), "edit_feature")
}

/// 0.1.0: true when a ring or line of the WKB geometry has an edge spanning more than 180° of longitude.
#[pg_extern(immutable, strict, parallel_safe, sql = false)]
fn _crosses_antimeridian(wkb: &[u8]) -> bool {
    ok_or_report(inspect::crosses_antimeridian(wkb), "edit_feature")
}

/// 0.1.0: H3 cell of a WKB point in EPSG:4326 degrees, at `feature_outbox.h3_resolution`.
#[pg_extern(stable, strict, parallel_safe, sql = false)]
fn _routing_cell(point_wkb: &[u8]) -> String {
    let resolution = settings::H3_RESOLUTION.get() as u8;
    ok_or_report(routing::cell_for_point_wkb(point_wkb, resolution), "edit_feature")
}
