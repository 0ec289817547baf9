//! Routing key: the H3 cell of a feature's routing point.
//!
//! PostGIS picks the routing point (`ST_PointOnSurface`, see `sql/edit.sql`); this module only turns
//! that point, given as WKB in EPSG:4326, into a lowercase-hex H3 cell with h3o. Pure Rust, no Postgres.

use geo_traits::{CoordTrait, GeometryTrait, GeometryType, PointTrait};
use h3o::{LatLng, Resolution};

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
}
