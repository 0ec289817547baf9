//! The SQL face of the tile math: which tiles a shape touches, and which an edit from one shape to
//! another expires, under the rules an expire output would apply (sql/tiles.sql wraps them).

use pgrx::prelude::*;

use super::shape::{self, Shape};
use super::{Change, Expired, Rule, expire};
use crate::edit::ok_or_report;
use crate::input_error::{Code, InputError};

/// The rows both functions return (spelled out in their signatures: pgrx reads the tokens).
type Tiles = TableIterator<'static, (name!(zoom, i32), name!(x, i32), name!(y, i32))>;

fn read(wkb: &[u8]) -> Shape {
    ok_or_report(shape::from_wkb(wkb).map_err(|e| InputError::new(Code::InvalidParameter, e.to_string())), "tiles_touched")
}

fn rows(e: Expired, what: &str) -> Tiles {
    if e.fell_back_to_boundary {
        notice!(
            "{what} is over max_tiles_geometry: only its boundary's tiles{}",
            e.dropped_from_zoom.map(|z| format!(", and none from zoom {z} up")).unwrap_or_default()
        );
    }
    TableIterator::new(e.tiles.into_iter().map(|t| (i32::from(t.zoom), t.x as i32, t.y as i32)))
}

/// The tiles a shape (2-D WKB, EPSG:4326 degrees) touches at zooms `minzoom`..=`maxzoom`. Errors
/// as `Rule::checked` (22023).
#[allow(clippy::too_many_arguments)]
#[pg_extern(immutable, parallel_safe)]
fn _tiles_touched(
    wkb: &[u8],
    maxzoom: i32,
    minzoom: i32,
    buffer: f64,
    mode: &str,
    full_area_limit: Option<f64>,
    max_tiles_geometry: i64,
) -> TableIterator<'static, (name!(zoom, i32), name!(x, i32), name!(y, i32))> {
    let rule = ok_or_report(Rule::checked(minzoom, maxzoom, buffer, mode, full_area_limit, true, max_tiles_geometry), "tiles_touched");
    rows(expire(&Change::New(&read(wkb)), &rule), "the shape")
}

/// The tiles an edit from `old` to `new` (2-D WKB, EPSG:4326 degrees) expires as a move: with
/// `diff`, those the symmetric difference touches; without, those either shape touches.
#[allow(clippy::too_many_arguments)]
#[pg_extern(immutable, parallel_safe)]
fn _tiles_changed(
    old: &[u8],
    new: &[u8],
    maxzoom: i32,
    minzoom: i32,
    buffer: f64,
    mode: &str,
    full_area_limit: Option<f64>,
    diff: bool,
    max_tiles_geometry: i64,
) -> TableIterator<'static, (name!(zoom, i32), name!(x, i32), name!(y, i32))> {
    let rule = ok_or_report(Rule::checked(minzoom, maxzoom, buffer, mode, full_area_limit, diff, max_tiles_geometry), "tiles_changed");
    let (old, new) = (read(old), read(new));
    rows(expire(&Change::Moved { old: &old, new: &new, properties_changed: false }, &rule), "the change")
}

/// Checks an expire output's or rule's settings as the relay will read them (`Rule::checked`),
/// raising 22023 with the reason; for define_expire_output and expire_layer.
#[pg_extern(immutable, parallel_safe)]
fn _expire_rule_check(minzoom: i32, maxzoom: i32, buffer: f64, mode: &str, full_area_limit: Option<f64>, max_tiles_geometry: i64) {
    ok_or_report(Rule::checked(minzoom, maxzoom, buffer, mode, full_area_limit, true, max_tiles_geometry).map(|_| ()), "expire_layer");
}
