//! Routing key: the H3 cell of a feature's routing point.
//!
//! PostGIS picks the routing point (`ST_PointOnSurface`, see `sql/edit.sql`); this module only turns
//! that point, given as WKB in EPSG:4326, into a lowercase-hex H3 cell with h3o. Pure Rust, no Postgres.

use std::str::FromStr;

use geo_traits::{CoordTrait, GeometryTrait, GeometryType, PointTrait};
use h3o::{CellIndex, LatLng, Resolution};

use crate::input_error::{Code, InputError};

/// H3 cell (lowercase hex, e.g. `882a100d2dfffff`) of a WKB point.
///
/// `point_wkb`: ISO WKB or EWKB of a 2-D point, x = longitude and y = latitude in degrees.
/// `resolution`: H3 resolution 0–15.
///
/// Errors (class 22): the WKB is not a non-empty point, an ordinate is not finite or out of range,
/// or the resolution is outside 0–15.
pub fn cell_for_point_wkb(point_wkb: &[u8], resolution: u8) -> Result<String, InputError> {
    let res = resolution_of(i32::from(resolution))?;
    // Guarded like every other WKB walk: the lazy reader panics on a truncated buffer.
    let (lon, lat) = crate::edit::inspect::guarded(|| {
        let geom = wkb::reader::read_wkb(point_wkb)
            .map_err(|e| InputError::new(Code::InvalidText, format!("routing point is not valid WKB: {e}")))?;
        match geom.as_type() {
            GeometryType::Point(p) => p.coord().map(|c| (c.x(), c.y())),
            _ => None,
        }
        .ok_or_else(|| InputError::new(Code::InvalidParameter, "routing point must be a non-empty point"))
    })?;
    cell_for_lonlat(lon, lat, res)
}

/// An H3 resolution, 0–15; 22003 otherwise.
pub fn resolution_of(resolution: i32) -> Result<Resolution, InputError> {
    u8::try_from(resolution).ok().and_then(|r| Resolution::try_from(r).ok()).ok_or_else(|| {
        InputError::new(Code::OutOfRange, format!("H3 resolution {resolution} is outside 0–15"))
    })
}

/// H3 cell of a longitude/latitude pair in degrees.
pub fn cell_for_lonlat(lon: f64, lat: f64, res: Resolution) -> Result<String, InputError> {
    let ll = LatLng::new(lat, lon).map_err(|_| {
        InputError::new(Code::InvalidParameter, format!("routing point ({lon}, {lat}) is not finite"))
    })?;
    if !(-180.0..=180.0).contains(&lon) || !(-90.0..=90.0).contains(&lat) {
        return Err(InputError::new(
            Code::OutOfRange,
            format!("routing point ({lon}, {lat}) is outside longitude [-180, 180], latitude [-90, 90]"),
        ));
    }
    Ok(ll.to_cell(res).to_string())
}

/// A routing key (lowercase-hex H3 cell); 22P02 when it is not one.
pub fn parse_cell(key: &str) -> Result<CellIndex, InputError> {
    CellIndex::from_str(key).map_err(|_| InputError::new(Code::InvalidText, format!("\"{key}\" is not an H3 cell index")))
}

/// The H3 parent of cell `key` at `resolution` (the cell itself at its own resolution), as
/// lowercase hex. Only parents nest: a point's cell at a coarser resolution is not always the
/// parent of its finer cell, so subjects and area filters use parents alone.
///
/// Errors: 22P02 for a key that is not a cell, 22023 for a resolution finer than the key's own or
/// outside 0–15.
pub fn parent(key: &str, resolution: i32) -> Result<String, InputError> {
    let cell = parse_cell(key)?;
    let res = resolution_of(resolution).map_err(|e| InputError::new(Code::InvalidParameter, e.message))?;
    cell.parent(res).map(|c| c.to_string()).ok_or_else(|| {
        InputError::new(
            Code::InvalidParameter,
            format!("resolution {resolution} is finer than routing key {key}'s own ({})", u8::from(cell.resolution())),
        )
        .hint("Ask for a resolution at most feature_outbox.h3_resolution.")
    })
}

/// The subject hierarchy of routing key `key`: its parent at each of `resolutions` (ascending)
/// coarser than its own, then the key itself. A key at resolution 8 with `[3, 5, 7]` gives
/// `[r3, r5, r7, key]`; with `[3, 5, 9]`, `[r3, r5, key]`.
pub fn hierarchy(key: &str, resolutions: &[u8]) -> Result<Vec<String>, InputError> {
    let cell = parse_cell(key)?;
    let own = cell.resolution();
    let mut tokens: Vec<String> = resolutions
        .iter()
        .filter_map(|&r| Resolution::try_from(r).ok())
        .filter(|&r| r < own)
        .filter_map(|r| cell.parent(r))
        .map(|c| c.to_string())
        .collect();
    tokens.push(cell.to_string());
    Ok(tokens)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// ISO WKB of POINT(x y), shared by the tests of other modules.
    pub(crate) fn point_wkb(x: f64, y: f64) -> Vec<u8> {
        let mut buf = vec![1u8];
        buf.extend_from_slice(&1u32.to_le_bytes());
        buf.extend_from_slice(&x.to_le_bytes());
        buf.extend_from_slice(&y.to_le_bytes());
        buf
    }

    #[test]
    fn known_cell_from_h3_documentation() {
        // Uber's H3 docs: latLngToCell(37.3615593, -122.0553238, 5) = 85283473fffffff.
        let cell = cell_for_point_wkb(&point_wkb(-122.0553238, 37.3615593), 5).unwrap();
        assert_eq!(cell, "85283473fffffff");
    }

    #[test]
    fn resolution_changes_the_cell_and_its_prefix_digit() {
        let wkb = point_wkb(13.405, 52.52);
        let r8 = cell_for_point_wkb(&wkb, 8).unwrap();
        let r9 = cell_for_point_wkb(&wkb, 9).unwrap();
        assert_ne!(r8, r9);
        assert!(r8.starts_with("88"), "{r8}");
        assert!(r9.starts_with("89"), "{r9}");
        assert_eq!(r8.len(), 15);
        assert_eq!(r8, r8.to_lowercase());
    }

    #[test]
    fn antimeridian_sides_give_different_cells() {
        let east = cell_for_point_wkb(&point_wkb(179.9, 52.0), 8).unwrap();
        let west = cell_for_point_wkb(&point_wkb(-179.9, 52.0), 8).unwrap();
        assert_ne!(east, west);
    }

    #[test]
    fn rejects_bad_resolution_and_points() {
        assert_eq!(cell_for_point_wkb(&point_wkb(0.0, 0.0), 16).unwrap_err().code, Code::OutOfRange);
        assert_eq!(cell_for_point_wkb(&point_wkb(f64::NAN, 0.0), 8).unwrap_err().code, Code::InvalidParameter);
        assert_eq!(cell_for_point_wkb(&point_wkb(200.0, 0.0), 8).unwrap_err().code, Code::OutOfRange);
        assert_eq!(cell_for_point_wkb(&[1, 2, 3], 8).unwrap_err().code, Code::InvalidText);
        // A point cut short inside its ordinates: an error, not a panic.
        assert_eq!(cell_for_point_wkb(&point_wkb(1.0, 2.0)[..12], 8).unwrap_err().code, Code::InvalidText);
        // LINESTRING(0 0, 1 1) is not a point.
        let mut line = vec![1u8];
        line.extend_from_slice(&2u32.to_le_bytes());
        line.extend_from_slice(&2u32.to_le_bytes());
        for v in [0.0f64, 0.0, 1.0, 1.0] {
            line.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(cell_for_point_wkb(&line, 8).unwrap_err().code, Code::InvalidParameter);
    }

    #[test]
    fn parents_nest_and_hierarchies_use_coarser_levels_only() {
        let key = cell_for_point_wkb(&point_wkb(13.405, 52.52), 8).unwrap();
        let h = hierarchy(&key, &[3, 5, 7]).unwrap();
        assert_eq!(h.len(), 4);
        assert_eq!(h[3], key);
        for (token, res) in h.iter().zip([3, 5, 7]) {
            assert_eq!(token, &parent(&key, res).unwrap());
            assert_eq!(parse_cell(token).unwrap().resolution(), Resolution::try_from(res as u8).unwrap());
        }
        // Each level is the parent of the next.
        assert_eq!(parent(&h[2], 5).unwrap(), h[1]);
        assert_eq!(parent(&h[1], 3).unwrap(), h[0]);
        // Levels at or finer than the key's own are left out.
        assert_eq!(hierarchy(&key, &[3, 8, 9]).unwrap(), vec![h[0].clone(), key.clone()]);
        assert_eq!(hierarchy(&key, &[]).unwrap(), vec![key.clone()]);
        assert_eq!(parent(&key, 8).unwrap(), key);
        assert_eq!(parent(&key, 9).unwrap_err().code, Code::InvalidParameter);
        assert_eq!(parent(&key, 16).unwrap_err().code, Code::InvalidParameter);
        assert_eq!(parent("zz", 3).unwrap_err().code, Code::InvalidText);
    }

    #[test]
    fn a_parent_differs_from_a_fresh_lookup_for_some_points() {
        // The reason subjects use parents: the coarse cell of a point is not always its fine cell's parent.
        let mut differ = 0;
        for i in 0..2000 {
            let (lon, lat) = (-120.0 + (i as f64) * 0.0173, 30.0 + (i as f64 * 0.0071) % 15.0);
            let fine = cell_for_lonlat(lon, lat, Resolution::Eight).unwrap();
            let fresh = cell_for_lonlat(lon, lat, Resolution::Three).unwrap();
            differ += (parent(&fine, 3).unwrap() != fresh) as usize;
        }
        assert!(differ > 0 && differ < 400, "{differ}");
    }
}
