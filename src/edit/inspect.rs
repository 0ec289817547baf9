//! The one pass over an edit's geometry (WKB): everything about the shape that is not PostGIS's job.
//! Dimensions, empty members, non-finite ordinates, ring closure, the EPSG:4326 range, the source
//! CRS's area of use, antimeridian crossing, rings that wind around a pole, and the bounding box.
//! Pure Rust, no Postgres; the area of use comes in as data (see `area_of_use`).

use geo_traits::{
    CoordTrait, Dimensions, GeometryCollectionTrait, GeometryTrait, GeometryType, LineStringTrait,
    MultiLineStringTrait, MultiPointTrait, MultiPolygonTrait, PointTrait, PolygonTrait,
};

use super::area_of_use::Area;
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

/// What the pass checks beyond structure and finiteness.
#[derive(Default)]
pub struct Rules<'a> {
    /// Coordinates are EPSG:4326 degrees: check the range, the antimeridian and the bounding box.
    pub lonlat: bool,
    /// The area of use of the CRS the geometry was given in, with its margin in degrees.
    pub area: Option<(&'a Area, f64)>,
    /// The geometry was transformed from another CRS: report rings that wind around a pole.
    pub find_poles: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pole {
    North,
    South,
}

/// What the pass found.
#[derive(Debug, Clone, PartialEq)]
pub struct Facts {
    /// A line or ring has an edge spanning more than 180° of longitude: it crosses the antimeridian.
    pub crosses_antimeridian: bool,
    /// A ring winds once around this pole (its longitudes turn through 360°).
    pub encircled_pole: Option<Pole>,
    /// [west, south, east, north] in degrees, as RFC 7946 §5.2: west > east across the antimeridian.
    pub bbox: [f64; 4],
}

/// One pass over a WKB geometry.
///
/// Errors, each before anything is written: 22023 for Z or M ordinates, an empty geometry or member,
/// a non-finite ordinate, a line under 2 points, a ring that is unclosed or under 4 points, and a
/// coordinate outside the source CRS's area of use; 22003 (with `lonlat`) for a longitude outside
/// [-180, 180] or a latitude outside [-90, 90]; 22P02 for WKB that does not parse.
pub fn inspect(wkb: &[u8], rules: &Rules) -> Result<Facts, InputError> {
    guarded(|| {
        let g = read(wkb)?;
        dimensions(g.dim())?;
        let mut walk = Walk::new(rules);
        walk.geometry(&g, true)?;
        Ok(walk.facts())
    })
}

/// The bounding box of a geometry in EPSG:4326 degrees, `[west, south, east, north]` as RFC 7946 §5:
/// west > east across the antimeridian (§5.2); a cap around a pole reaches ±90 over all
/// longitudes (§5.3). None for a geometry `inspect` would refuse (empty, out of range).
pub fn bbox(wkb: &[u8]) -> Option<[f64; 4]> {
    inspect(wkb, &Rules { lonlat: true, ..Rules::default() }).ok().map(|f| f.bbox)
}

/// Validates every coordinate of a 2-D WKB geometry (the 0.1.0 entry point; see `inspect`).
pub fn check(wkb: &[u8], lonlat: bool) -> Result<(), InputError> {
    guarded(|| Walk::new(&Rules { lonlat, ..Rules::default() }).geometry(&read(wkb)?, true))
}

/// True when a ring or line of the geometry has an edge spanning more than 180° of longitude,
/// i.e. it was drawn across the antimeridian rather than the long way round.
pub fn crosses_antimeridian(wkb: &[u8]) -> Result<bool, InputError> {
    guarded(|| {
        let rules = Rules::default();
        let mut walk = Walk::new(&rules);
        walk.structure_only = true;
        walk.geometry(&read(wkb)?, true)?;
        Ok(walk.crosses)
    })
}

fn dimensions(d: Dimensions) -> Result<(), InputError> {
    let extra = match d {
        Dimensions::Xy => return Ok(()),
        Dimensions::Xym => "M",
        Dimensions::Xyz => "Z",
        _ => "Z and M",
    };
    Err(InputError::new(Code::InvalidParameter, format!("geometry has {extra} ordinates; features are 2-D"))
        .hint("Drop them first with ST_Force2D(geom)."))
}

struct Walk<'a> {
    rules: &'a Rules<'a>,
    /// Only the antimeridian test of the 0.1.0 helper: no errors for content.
    structure_only: bool,
    crosses: bool,
    pole: Option<Pole>,
    /// Longitude extent as given, and with negative longitudes shifted by +360 (for shapes across
    /// the antimeridian), and the latitude extent.
    lon: (f64, f64),
    shifted: (f64, f64),
    lat: (f64, f64),
}

impl<'a> Walk<'a> {
    fn new(rules: &'a Rules<'a>) -> Self {
        let inf = (f64::INFINITY, f64::NEG_INFINITY);
        Walk { rules, structure_only: false, crosses: false, pole: None, lon: inf, shifted: inf, lat: inf }
    }

    fn facts(&self) -> Facts {
        // Across the antimeridian, or in parts on both sides of it that are closer that way round
        // (RFC 7946 §5.2's Fiji example): the box from the shifted extent, west > east. Not for a
        // shape that reaches a pole (a polar cap, §5.3): its edges along the pole span every
        // longitude between its vertices.
        let polar = self.lat.0 <= -90.0 || self.lat.1 >= 90.0;
        let narrower = !polar && self.shifted.1 - self.shifted.0 < self.lon.1 - self.lon.0;
        let (west, east) = if self.crosses || narrower {
            let wrap = |x: f64| if x > 180.0 { x - 360.0 } else { x };
            (wrap(self.shifted.0), wrap(self.shifted.1))
        } else {
            self.lon
        };
        Facts { crosses_antimeridian: self.crosses, encircled_pole: self.pole, bbox: [west, self.lat.0, east, self.lat.1] }
    }

    fn fail(&self, e: InputError) -> Result<(), InputError> {
        if self.structure_only { Ok(()) } else { Err(e) }
    }

    fn geometry(&mut self, g: &impl GeometryTrait<T = f64>, top: bool) -> Result<(), InputError> {
        match g.as_type() {
            GeometryType::Point(p) => match p.coord() {
                Some(c) => self.coord(&c),
                // WKB writes POINT EMPTY as NaN NaN, which reads as no coordinate.
                None => self.fail(empty_error(if top { "" } else { "point" })),
            },
            GeometryType::LineString(l) => self.line(l, if top { "" } else { "linestring" }),
            GeometryType::Polygon(p) => self.polygon(p, top),
            GeometryType::MultiPoint(m) => {
                if m.num_points() == 0 {
                    return self.fail(empty_error(if top { "" } else { "multipoint" }));
                }
                m.points().try_for_each(|p| match p.coord() {
                    Some(c) => self.coord(&c),
                    None => self.fail(empty_error("point")),
                })
            }
            GeometryType::MultiLineString(m) => {
                if m.num_line_strings() == 0 {
                    return self.fail(empty_error(if top { "" } else { "multilinestring" }));
                }
                m.line_strings().try_for_each(|l| self.line(&l, "linestring"))
            }
            GeometryType::MultiPolygon(m) => {
                if m.num_polygons() == 0 {
                    return self.fail(empty_error(if top { "" } else { "multipolygon" }));
                }
                m.polygons().try_for_each(|p| self.polygon(&p, false))
            }
            GeometryType::GeometryCollection(gc) => {
                if gc.num_geometries() == 0 {
                    return self.fail(empty_error(if top { "" } else { "geometry collection" }));
                }
                gc.geometries().try_for_each(|m| self.geometry(&m, false))
            }
            _ => self.fail(InputError::new(Code::InvalidParameter, "unsupported geometry type")),
        }
    }

    fn polygon(&mut self, p: &impl PolygonTrait<T = f64>, top: bool) -> Result<(), InputError> {
        match p.exterior() {
            Some(ext) if ext.num_coords() > 0 => {
                self.ring(&ext)?;
                p.interiors().try_for_each(|r| self.ring(&r))
            }
            _ => self.fail(empty_error(if top { "" } else { "polygon" })),
        }
    }

    fn ring(&mut self, r: &impl LineStringTrait<T = f64>) -> Result<(), InputError> {
        self.line(r, "ring")?;
        let (n, first, last) = (r.num_coords(), r.coord(0), r.coord(r.num_coords().saturating_sub(1)));
        let closed = matches!((first, last), (Some(a), Some(b)) if a.x() == b.x() && a.y() == b.y());
        if n < 4 || !closed {
            return self.fail(InputError::new(
                Code::InvalidParameter,
                format!("polygon ring has {n} points{}; a ring needs at least 4, the last equal to the first", if closed { "" } else { " and is not closed" }),
            )
            .hint("Close each ring by repeating its first point, or build the polygon with ST_MakePolygon."));
        }
        if self.rules.find_poles && self.pole.is_none() {
            self.pole = encircled_pole(r);
        }
        Ok(())
    }

    fn line(&mut self, l: &impl LineStringTrait<T = f64>, what: &str) -> Result<(), InputError> {
        match l.num_coords() {
            0 => return self.fail(empty_error(what)),
            1 => {
                let what = if what.is_empty() { "linestring" } else { what };
                return self.fail(InputError::new(Code::InvalidParameter, format!("geometry has a {what} of a single point"))
                    .hint("A line needs at least 2 points; use a Point for a single position."));
            }
            _ => {}
        }
        let mut prev: Option<(f64, f64)> = None;
        for c in l.coords() {
            self.coord(&c)?;
            let (x, y) = (c.x(), c.y());
            // An edge along a pole (both ends at latitude ±90) has no length on the sphere.
            if let Some((px, py)) = prev
                && (x - px).abs() > 180.0
                && !(py.abs() == 90.0 && py == y)
            {
                self.crosses = true;
            }
            prev = Some((x, y));
        }
        Ok(())
    }

    fn coord(&mut self, c: &impl CoordTrait<T = f64>) -> Result<(), InputError> {
        let (x, y) = (c.x(), c.y());
        if self.structure_only {
            return Ok(());
        }
        if !x.is_finite() || !y.is_finite() {
            return Err(InputError::new(Code::InvalidParameter, format!("geometry has a non-finite ordinate ({x}, {y})"))
                .hint("Every ordinate must be a finite number; NaN and Infinity are not coordinates."));
        }
        if !self.rules.lonlat {
            return Ok(());
        }
        if !(-180.0..=180.0).contains(&x) {
            return Err(InputError::new(Code::OutOfRange, format!("longitude {x} is outside [-180, 180]")).hint(range_hint(x, y)));
        }
        if !(-90.0..=90.0).contains(&y) {
            return Err(InputError::new(Code::OutOfRange, format!("latitude {y} is outside [-90, 90]")).hint(range_hint(x, y)));
        }
        if let Some((area, margin)) = self.rules.area
            && !area.contains(x, y, margin)
        {
            return Err(area.outside_error(x, y, margin));
        }
        self.lon = (self.lon.0.min(x), self.lon.1.max(x));
        let s = if x < 0.0 { x + 360.0 } else { x };
        self.shifted = (self.shifted.0.min(s), self.shifted.1.max(s));
        self.lat = (self.lat.0.min(y), self.lat.1.max(y));
        Ok(())
    }
}

/// The pole a ring of lon/lat degrees winds around, if any: the sum of its edges' longitude steps
/// (each taken the short way, within ±180°) is ±360° for a ring around a pole and 0 otherwise.
fn encircled_pole(r: &impl LineStringTrait<T = f64>) -> Option<Pole> {
    let (mut turn, mut lat_sum, mut prev) = (0.0, 0.0, None::<f64>);
    for c in r.coords() {
        if let Some(px) = prev {
            turn += short_step(c.x() - px);
        }
        lat_sum += c.y();
        prev = Some(c.x());
    }
    (turn.abs() > 180.0).then(|| if lat_sum < 0.0 { Pole::South } else { Pole::North })
}

/// A longitude difference taken the short way round, in (-180, 180].
pub fn short_step(d: f64) -> f64 {
    let d = d.rem_euclid(360.0);
    if d > 180.0 { d - 360.0 } else { d }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use geo::{Geometry, GeometryCollection, LineString, MultiPolygon, Point, Polygon, polygon};

    /// ISO WKB of a geo geometry, shared by the tests of the edit modules.
    pub(crate) fn wkb(g: &Geometry) -> Vec<u8> {
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

    #[test]
    fn bounding_box_follows_rfc_7946_across_the_antimeridian() {
        let rules = Rules { lonlat: true, ..Rules::default() };
        let across: Geometry =
            polygon![(x: 179.5, y: 51.0), (x: -179.5, y: 51.0), (x: -179.5, y: 52.0), (x: 179.5, y: 52.0), (x: 179.5, y: 51.0)].into();
        let facts = inspect(&wkb(&across), &rules).unwrap();
        assert!(facts.crosses_antimeridian);
        assert_eq!(facts.bbox, [179.5, 51.0, -179.5, 52.0]);
        let plain = inspect(&wkb(&square(13.0, 52.0).into()), &rules).unwrap();
        assert_eq!(plain.bbox, [13.0, 52.0, 14.0, 53.0]);
        // Parts on both sides, none crossing (RFC 7946 §5.2's Fiji): the narrow box, west > east.
        let fiji: Geometry = MultiPolygon::new(vec![square(177.0, -20.0), square(-179.0, -17.0)]).into();
        assert_eq!(bbox(&wkb(&fiji)), Some([177.0, -20.0, -178.0, -16.0]));
        // Parts far apart the other way: the ordinary box.
        let wide: Geometry = MultiPolygon::new(vec![square(-10.0, 0.0), square(9.0, 0.0)]).into();
        assert_eq!(bbox(&wkb(&wide)), Some([-10.0, 0.0, 10.0, 1.0]));
        assert_eq!(bbox(&[1, 2, 3]), None);
    }

    #[test]
    fn rings_around_a_pole_are_found_only_for_transformed_shapes() {
        let ring: Vec<(f64, f64)> = [45.0, 135.0, -135.0, -45.0, 45.0].iter().map(|&x| (x, -77.0)).collect();
        let around: Geometry = Polygon::new(LineString::from(ring), vec![]).into();
        let transformed = Rules { lonlat: true, find_poles: true, ..Rules::default() };
        assert_eq!(inspect(&wkb(&around), &transformed).unwrap().encircled_pole, Some(Pole::South));
        assert_eq!(inspect(&wkb(&around), &Rules { lonlat: true, ..Rules::default() }).unwrap().encircled_pole, None);
        assert_eq!(inspect(&wkb(&square(10.0, -80.0).into()), &transformed).unwrap().encircled_pole, None);
    }

    #[test]
    fn an_edge_along_a_pole_is_not_an_antimeridian_crossing() {
        // Antarctica as RFC 7946 draws it: along latitude -90 from 180 back to -180.
        let cap: Geometry = polygon![(x: -180.0, y: -80.0), (x: 0.0, y: -80.0), (x: 180.0, y: -80.0), (x: 180.0, y: -90.0),
                                     (x: -180.0, y: -90.0), (x: -180.0, y: -80.0)].into();
        let facts = inspect(&wkb(&cap), &Rules { lonlat: true, ..Rules::default() }).unwrap();
        assert!(!facts.crosses_antimeridian);
        assert_eq!(facts.bbox, [-180.0, -90.0, 180.0, -80.0]);
    }

    #[test]
    fn z_and_m_ordinates_are_refused_by_name() {
        let mut buf = vec![1u8];
        buf.extend_from_slice(&1001u32.to_le_bytes()); // ISO WKB POINT Z
        for v in [1.0f64, 2.0, 3.0] {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        let e = inspect(&buf, &Rules::default()).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (Code::InvalidParameter, "geometry has Z ordinates; features are 2-D"));
    }

    #[test]
    fn a_vertex_outside_the_area_of_use_is_refused() {
        let zone = Area { crs: "EPSG:32633".into(), crs_name: "UTM 33N".into(), name: "12°E to 18°E".into(),
                          west: 12.0, south: 0.0, east: 18.0, north: 84.0, layer: None };
        let rules = Rules { lonlat: true, area: Some((&zone, 1.0)), find_poles: true };
        assert!(inspect(&wkb(&square(14.0, 50.0).into()), &rules).is_ok());
        let e = inspect(&wkb(&square(18.5, 50.0).into()), &rules).unwrap_err();
        assert!(e.message.contains("(19.5, 50)") && e.message.contains("EPSG:32633"), "{}", e.message);
    }
}
