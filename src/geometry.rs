//! Checks on a geometry's coordinates that PostGIS either does not make or reports as XX000:
//! empty members, non-finite ordinates, the EPSG:4326 range, and antimeridian crossing.
//! Input is WKB from `ST_AsBinary`; pure Rust, no Postgres.

use geo_traits::{
    CoordTrait, GeometryCollectionTrait, GeometryTrait, GeometryType, LineStringTrait,
    MultiLineStringTrait, MultiPointTrait, MultiPolygonTrait, PointTrait, PolygonTrait,
};

use crate::input_error::{Code, InputError};

const SWAP_HINT: &str = "Coordinates are longitude, latitude in degrees (EPSG:4326). Are x and y swapped?";
/// For an ordinate no degree value comes near: these are projected units (metres, feet), not swapped degrees.
const PROJECTED_HINT: &str = "These look like projected coordinates (metres or feet), not degrees. Name their EPSG code: a \"crs\" member in the GeoJSON ({\"type\":\"name\",\"properties\":{\"name\":\"EPSG:3857\"}}), or pass a geometry with ST_SetSRID(geom, 3857).";

/// The hint for an out-of-range coordinate: far outside degrees means projected units.
fn range_hint(x: f64, y: f64) -> &'static str {
    if x.abs() > 360.0 || y.abs() > 180.0 { PROJECTED_HINT } else { SWAP_HINT }
}

fn read(wkb: &[u8]) -> Result<wkb::reader::Wkb<'_>, InputError> {
    wkb::reader::read_wkb(wkb)
        .map_err(|e| InputError::new(Code::InvalidText, format!("geometry is not valid WKB: {e}")))
}

/// Runs a walk over WKB, turning a panic of the lazy WKB reader (it unwraps coordinates it reads
/// past the end of a truncated buffer) into an error instead of an XX000.
pub fn guarded<T>(walk: impl FnOnce() -> Result<T, InputError>) -> Result<T, InputError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(walk))
        .unwrap_or_else(|_| Err(InputError::new(Code::InvalidText, "geometry is not valid WKB: truncated")))
}

fn empty_error(what: &str) -> InputError {
    let message = if what.is_empty() {
        "geometry is empty".to_string()
    } else {
        format!("geometry has an empty {what}")
    };
    InputError::new(Code::InvalidParameter, message)
        .hint("A feature needs a non-empty geometry. To remove a feature, send a retired event.")
}

/// Validates every coordinate of a 2-D WKB geometry.
///
/// Raises 22023 for an empty geometry or an empty member (a collection's polygon, a polygon's
/// exterior ring, ...) and for a NaN or infinite ordinate. With `lonlat`, raises 22003 when a
/// longitude is outside [-180, 180] or a latitude outside [-90, 90].
/// Also raises 22023 for a line under 2 points and a ring that is unclosed or under 4 points, which
/// PostGIS accepts from (E)WKB but no GeoJSON consumer can use.
pub fn check(wkb: &[u8], lonlat: bool) -> Result<(), InputError> {
    guarded(|| walk(&read(wkb)?, lonlat, true))
}

fn walk(g: &impl GeometryTrait<T = f64>, lonlat: bool, top: bool) -> Result<(), InputError> {
    match g.as_type() {
        GeometryType::Point(p) => match p.coord() {
            Some(c) => coord(&c, lonlat),
            // WKB writes POINT EMPTY as NaN NaN, which reads as no coordinate.
            None => Err(empty_error(if top { "" } else { "point" })),
        },
        GeometryType::LineString(l) => line(l, lonlat, if top { "" } else { "linestring" }),
        GeometryType::Polygon(p) => polygon(p, lonlat, top),
        GeometryType::MultiPoint(m) => {
            if m.num_points() == 0 {
                return Err(empty_error(if top { "" } else { "multipoint" }));
            }
            m.points().try_for_each(|p| match p.coord() {
                Some(c) => coord(&c, lonlat),
                None => Err(empty_error("point")),
            })
        }
        GeometryType::MultiLineString(m) => {
            if m.num_line_strings() == 0 {
                return Err(empty_error(if top { "" } else { "multilinestring" }));
            }
            m.line_strings().try_for_each(|l| line(&l, lonlat, "linestring"))
        }
        GeometryType::MultiPolygon(m) => {
            if m.num_polygons() == 0 {
                return Err(empty_error(if top { "" } else { "multipolygon" }));
            }
            m.polygons().try_for_each(|p| polygon(&p, lonlat, false))
        }
        GeometryType::GeometryCollection(gc) => {
            if gc.num_geometries() == 0 {
                return Err(empty_error(if top { "" } else { "geometry collection" }));
            }
            gc.geometries().try_for_each(|m| walk(&m, lonlat, false))
        }
        _ => Err(InputError::new(Code::InvalidParameter, "unsupported geometry type")),
    }
}

fn polygon(p: &impl PolygonTrait<T = f64>, lonlat: bool, top: bool) -> Result<(), InputError> {
    match p.exterior() {
        Some(ext) if ext.num_coords() > 0 => {
            ring(&ext, lonlat)?;
            p.interiors().try_for_each(|r| ring(&r, lonlat))
        }
        _ => Err(empty_error(if top { "" } else { "polygon" })),
    }
}

fn ring(r: &impl LineStringTrait<T = f64>, lonlat: bool) -> Result<(), InputError> {
    line(r, lonlat, "ring")?;
    let (n, first, last) = (r.num_coords(), r.coord(0), r.coord(r.num_coords().saturating_sub(1)));
    let closed = matches!((first, last), (Some(a), Some(b)) if a.x() == b.x() && a.y() == b.y());
    if n < 4 || !closed {
        return Err(InputError::new(
            Code::InvalidParameter,
            format!("polygon ring has {n} points{}; a ring needs at least 4, the last equal to the first", if closed { "" } else { " and is not closed" }),
        )
        .hint("Close each ring by repeating its first point, or build the polygon with ST_MakePolygon."));
    }
    Ok(())
}

fn line(l: &impl LineStringTrait<T = f64>, lonlat: bool, what: &str) -> Result<(), InputError> {
    match l.num_coords() {
        0 => return Err(empty_error(what)),
        1 => {
            let what = if what.is_empty() { "linestring" } else { what };
            return Err(InputError::new(Code::InvalidParameter, format!("geometry has a {what} of a single point"))
                .hint("A line needs at least 2 points; use a Point for a single position."));
        }
        _ => {}
    }
    l.coords().try_for_each(|c| coord(&c, lonlat))
}

fn coord(c: &impl CoordTrait<T = f64>, lonlat: bool) -> Result<(), InputError> {
    let (x, y) = (c.x(), c.y());
    if !x.is_finite() || !y.is_finite() {
        return Err(InputError::new(Code::InvalidParameter, format!("geometry has a non-finite ordinate ({x}, {y})"))
            .hint("Every ordinate must be a finite number; NaN and Infinity are not coordinates."));
    }
    if lonlat && !(-180.0..=180.0).contains(&x) {
        return Err(InputError::new(Code::OutOfRange, format!("longitude {x} is outside [-180, 180]")).hint(range_hint(x, y)));
    }
    if lonlat && !(-90.0..=90.0).contains(&y) {
        return Err(InputError::new(Code::OutOfRange, format!("latitude {y} is outside [-90, 90]")).hint(range_hint(x, y)));
    }
    Ok(())
}

/// True when a ring or line of the geometry has an edge spanning more than 180° of longitude,
/// i.e. it was drawn across the antimeridian rather than the long way round.
pub fn crosses_antimeridian(wkb: &[u8]) -> Result<bool, InputError> {
    guarded(|| Ok(crosses(&read(wkb)?)))
}

fn crosses(g: &impl GeometryTrait<T = f64>) -> bool {
    match g.as_type() {
        GeometryType::LineString(l) => line_crosses(l),
        GeometryType::Polygon(p) => polygon_crosses(p),
        GeometryType::MultiLineString(m) => m.line_strings().any(|l| line_crosses(&l)),
        GeometryType::MultiPolygon(m) => m.polygons().any(|p| polygon_crosses(&p)),
        GeometryType::GeometryCollection(gc) => gc.geometries().any(|m| crosses(&m)),
        _ => false,
    }
}

fn polygon_crosses(p: &impl PolygonTrait<T = f64>) -> bool {
    p.exterior().is_some_and(|r| line_crosses(&r)) || p.interiors().any(|r| line_crosses(&r))
}

fn line_crosses(l: &impl LineStringTrait<T = f64>) -> bool {
    let xs: Vec<f64> = l.coords().map(|c| c.x()).collect();
    xs.windows(2).any(|w| (w[1] - w[0]).abs() > 180.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use geo::{Geometry, GeometryCollection, LineString, MultiPolygon, Point, Polygon, polygon};

    fn wkb(g: &Geometry) -> Vec<u8> {
        let mut buf = Vec::new();
        wkb::writer::write_geometry(&mut buf, g, &Default::default()).unwrap();
        buf
    }

    fn square(x: f64, y: f64) -> Polygon {
        polygon![(x: x, y: y), (x: x + 1.0, y: y), (x: x + 1.0, y: y + 1.0), (x: x, y: y + 1.0), (x: x, y: y)]
    }

    #[test]
    fn accepts_ordinary_polygon() {
        assert_eq!(check(&wkb(&square(13.0, 52.0).into()), true), Ok(()));
    }

    #[test]
    fn rejects_non_finite_anywhere() {
        let mut ring = square(1.0, 1.0).exterior().clone();
        ring.0[2].y = f64::INFINITY;
        let g: Geometry = MultiPolygon(vec![square(0.0, 0.0), Polygon::new(ring, vec![])]).into();
        let err = check(&wkb(&g), false).unwrap_err();
        assert_eq!(err.code, Code::InvalidParameter);
        assert!(err.message.contains("non-finite"), "{}", err.message);
    }

    #[test]
    fn rejects_empty_member_of_collection() {
        let empty = Polygon::new(LineString(vec![]), vec![]);
        let g = Geometry::GeometryCollection(GeometryCollection(vec![Point::new(1.0, 1.0).into(), empty.into()]));
        let err = check(&wkb(&g), true).unwrap_err();
        assert_eq!(err.code, Code::InvalidParameter);
        assert!(err.message.contains("empty polygon"), "{}", err.message);
        let whole: Geometry = MultiPolygon::<f64>(vec![]).into();
        assert_eq!(check(&wkb(&whole), true).unwrap_err().message, "geometry is empty");
    }

    #[test]
    fn range_checked_only_for_lonlat() {
        let swapped: Geometry = square(52.0, 170.0).into();
        assert_eq!(check(&wkb(&swapped), false), Ok(()));
        let err = check(&wkb(&swapped), true).unwrap_err();
        assert_eq!(err.code, Code::OutOfRange);
        assert!(err.hint.unwrap().contains("swapped"));
    }

    #[test]
    fn projected_metres_get_a_crs_hint_not_a_swap_hint() {
        // EPSG:3857 Berlin given as if it were degrees.
        let berlin: Geometry = Point::new(1_491_681.0, 6_893_000.0).into();
        let hint = check(&wkb(&berlin), true).unwrap_err().hint.unwrap();
        assert!(hint.contains("projected") && hint.contains("crs") && hint.contains("ST_SetSRID"), "{hint}");
        assert!(!hint.contains("swapped"));
    }

    #[test]
    fn rejects_rings_and_lines_postgis_would_store() {
        // geo::Polygon closes its rings, so write these polygons' WKB by hand.
        let raw_polygon = |points: &[(f64, f64)]| {
            let mut buf = vec![1u8];
            for n in [3u32, 1, points.len() as u32] {
                buf.extend_from_slice(&n.to_le_bytes());
            }
            for (x, y) in points {
                buf.extend_from_slice(&x.to_le_bytes());
                buf.extend_from_slice(&y.to_le_bytes());
            }
            buf
        };
        let open = raw_polygon(&[(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (0.0, 1.0)]);
        assert!(check(&open, true).unwrap_err().message.contains("not closed"));
        let short = raw_polygon(&[(0.0, 0.0), (1.0, 1.0), (0.0, 0.0)]);
        assert!(check(&short, true).unwrap_err().message.contains("3 points"));
        let dot: Geometry = LineString::from(vec![(0.0, 1.0)]).into();
        assert!(check(&wkb(&dot), true).unwrap_err().message.contains("single point"));
    }

    #[test]
    fn truncated_wkb_is_an_error_not_a_panic() {
        let mut buf = wkb(&Geometry::Point(Point::new(1.0, 2.0)));
        buf.truncate(12);
        assert_eq!(check(&buf, true).unwrap_err().code, Code::InvalidText);
    }

    #[test]
    fn antimeridian_crossing_is_an_edge_over_180_degrees() {
        let across: Geometry =
            polygon![(x: 179.5, y: 51.0), (x: -179.5, y: 51.0), (x: -179.5, y: 52.0), (x: 179.5, y: 52.0), (x: 179.5, y: 51.0)].into();
        assert!(crosses_antimeridian(&wkb(&across)).unwrap());
        // Two parts on both sides, like Aleutians West, with no edge across: not a crossing.
        let parts: Geometry = MultiPolygon(vec![square(178.0, 51.0), square(-179.5, 51.0)]).into();
        assert!(!crosses_antimeridian(&wkb(&parts)).unwrap());
    }
}
