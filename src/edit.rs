//! The Rust half of `edit_feature` (the SQL half is `sql/edit.sql`): GeoJSON parsing, coordinate
//! checks and the H3 cell. Each maps `InputError` to `ereport(ERROR)` with its class-22 SQLSTATE.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::input_error::{Code, InputError};
use crate::{geojson, geometry, routing, settings};

fn ok_or_report<T>(r: Result<T, InputError>, funcname: &'static str) -> T {
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

/// GeoJSON geometry text (RFC 7946) to EWKB with its SRID (4326 unless a `crs` member says otherwise).
/// Raises 22P02 for malformed GeoJSON and 22023 for altitudes, empty geometries or unknown CRS names.
#[pg_extern(immutable, strict, parallel_safe)]
fn _geojson_to_ewkb(geojson: &str) -> Vec<u8> {
    ok_or_report(geojson::to_ewkb(geojson), "edit_feature")
}

/// Checks every coordinate of a 2-D WKB geometry: raises 22023 for an empty geometry or member and
/// for NaN/Infinity; with `lonlat`, 22003 for longitude outside [-180, 180] or latitude outside [-90, 90].
#[pg_extern(immutable, strict, parallel_safe)]
fn _check_coordinates(wkb: &[u8], lonlat: bool) {
    ok_or_report(geometry::check(wkb, lonlat), "edit_feature")
}

/// True when a ring or line of the WKB geometry has an edge spanning more than 180° of longitude.
#[pg_extern(immutable, strict, parallel_safe)]
fn _crosses_antimeridian(wkb: &[u8]) -> bool {
    ok_or_report(geometry::crosses_antimeridian(wkb), "edit_feature")
}

/// H3 cell (lowercase hex) of a WKB point in EPSG:4326 degrees, at `feature_outbox.h3_resolution`.
#[pg_extern(stable, strict, parallel_safe)]
fn _routing_cell(point_wkb: &[u8]) -> String {
    let resolution = settings::H3_RESOLUTION.get() as u8;
    ok_or_report(routing::cell_for_point_wkb(point_wkb, resolution), "edit_feature")
}
