//! Polygons around a pole. A ring that encloses a pole in a polar CRS (EPSG:3031, EPSG:3413) comes
//! out of ST_Transform as a ring whose longitudes turn through 360°: self-intersecting, of zero area
//! in EPSG:4326. This rebuilds it as the polygon it stands for: cut at the antimeridian and closed
//! along the pole's edge, e.g. (-180 a, ..., 180 b, 180 -90, -180 -90, -180 a), which covers the pole.
//! The input should be densified in the source CRS first, so that the edges between vertices
//! follow the source shape. Pure Rust, no Postgres.

use geo::{Coord, Geometry, LineString, MultiPolygon, Polygon};
use geo_traits::{CoordTrait, GeometryTrait, GeometryType, LineStringTrait, MultiPolygonTrait, PolygonTrait};

use super::inspect::{Pole, guarded, short_step};
use crate::input_error::{Code, InputError};

fn unsupported(why: &str) -> InputError {
    InputError::new(Code::InvalidParameter, format!("a polygon around a pole cannot be stored in EPSG:4326: {why}"))
        .hint("Split it into parts that do not enclose the pole, or transform it to EPSG:4326 yourself.")
}

/// Rebuilds every polygon whose exterior ring winds around a pole (WKB of a Polygon or MultiPolygon
/// in EPSG:4326 degrees) and returns ISO WKB of the same type.
///
/// Errors (22023): another geometry type, a hole that winds around a pole, a ring that crosses the
/// antimeridian more than once on its way round.
pub fn close_polar_caps(wkb: &[u8]) -> Result<Vec<u8>, InputError> {
    let geom = guarded(|| {
        let g = wkb::reader::read_wkb(wkb)
            .map_err(|e| InputError::new(Code::InvalidText, format!("geometry is not valid WKB: {e}")))?;
        match g.as_type() {
            GeometryType::Polygon(p) => Ok(Geometry::Polygon(polygon(p)?)),
            GeometryType::MultiPolygon(m) => {
                Ok(Geometry::MultiPolygon(MultiPolygon(m.polygons().map(|p| polygon(&p)).collect::<Result<_, _>>()?)))
            }
            _ => Err(unsupported("only a Polygon or MultiPolygon can enclose a pole")),
        }
    })?;
    let mut out = Vec::new();
    wkb::writer::write_geometry(&mut out, &geom, &Default::default())
        .map_err(|e| InputError::new(Code::InvalidParameter, format!("cannot encode geometry: {e}")))?;
    Ok(out)
}

fn coords(r: &impl LineStringTrait<T = f64>) -> Vec<Coord> {
    r.coords().map(|c| Coord { x: c.x(), y: c.y() }).collect()
}

/// +1 or -1 when the closed ring turns once around a pole (east or west), else 0.
fn winding(ring: &[Coord]) -> i32 {
    let turn: f64 = ring.windows(2).map(|w| short_step(w[1].x - w[0].x)).sum();
    if turn > 180.0 { 1 } else if turn < -180.0 { -1 } else { 0 }
}

fn polygon(p: &impl PolygonTrait<T = f64>) -> Result<Polygon, InputError> {
    let exterior = p.exterior().map(|r| coords(&r)).unwrap_or_default();
    let interiors: Vec<Vec<Coord>> = p.interiors().map(|r| coords(&r)).collect();
    if interiors.iter().any(|r| winding(r) != 0) {
        return Err(unsupported("one of its holes winds around the pole"));
    }
    let exterior = match winding(&exterior) {
        0 => exterior,
        turn => cap(&exterior, turn)?,
    };
    Ok(Polygon::new(LineString(exterior), interiors.into_iter().map(LineString).collect()))
}

/// The ring of a polar cap: the ring's path from -180° to 180° of longitude, then along the pole.
fn cap(ring: &[Coord], turn: i32) -> Result<Vec<Coord>, InputError> {
    let mut pts: Vec<Coord> = ring[..ring.len() - 1].to_vec();
    if turn < 0 {
        pts.reverse();
    }
    let m = pts.len();
    let pole_lat = match if pts.iter().map(|c| c.y).sum::<f64>() < 0.0 { Pole::South } else { Pole::North } {
        Pole::South => -90.0,
        Pole::North => 90.0,
    };
    // Longitudes unwrapped over two laps: u[i] increases by 360 from one lap to the next.
    let mut u = Vec::with_capacity(2 * m + 1);
    u.push(pts[0]);
    for i in 1..=2 * m {
        let (prev, c) = (u[i - 1], pts[i % m]);
        u.push(Coord { x: prev.x + short_step(c.x - pts[(i - 1) % m].x), y: c.y });
    }
    // The first antimeridian value (180 + 360k) at or after the start.
    let cut = 180.0 + 360.0 * ((u[0].x - 180.0) / 360.0).ceil();
    let at = |a: Coord, b: Coord, x: f64| a.y + (b.y - a.y) * (x - a.x) / (b.x - a.x);
    let start = (0..2 * m)
        .find(|&i| u[i].x <= cut && u[i + 1].x > cut)
        .ok_or_else(|| unsupported("its ring does not reach the antimeridian"))?;
    let mut out = vec![Coord { x: -180.0, y: at(u[start], u[start + 1], cut) }];
    for k in start + 1..=2 * m {
        if u[k].x >= cut + 360.0 {
            out.push(Coord { x: 180.0, y: at(u[k - 1], u[k], cut + 360.0) });
            out.extend([Coord { x: 180.0, y: pole_lat }, Coord { x: -180.0, y: pole_lat }, out[0]]);
            return Ok(out);
        }
        let x = u[k].x - cut - 180.0;
        if x < -180.0 {
            return Err(unsupported("its ring crosses the antimeridian more than once on its way round the pole"));
        }
        out.push(Coord { x, y: u[k].y });
    }
    Err(unsupported("its ring does not go once round the pole"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edit::inspect::tests::wkb;
    use geo::{Area, Contains, Point, polygon};

    fn read(buf: &[u8]) -> Polygon {
        match geo_traits::to_geo::ToGeoGeometry::to_geometry(&wkb::reader::read_wkb(buf).unwrap()) {
            Geometry::Polygon(p) => p,
            other => panic!("{other:?}"),
        }
    }

    /// A ring at latitude `lat` around a pole, vertices every 30° from `start`, in `dir` order.
    fn around(lat: f64, start: f64, dir: f64) -> Polygon {
        let mut ring: Vec<Coord> =
            (0..12).map(|i| Coord { x: short_step(start + dir * 30.0 * i as f64), y: lat }).collect();
        ring.push(ring[0]);
        Polygon::new(LineString(ring), vec![])
    }

    #[test]
    fn a_ring_around_the_south_pole_becomes_a_cap_that_covers_it() {
        for (start, dir) in [(45.0, 1.0), (45.0, -1.0), (-180.0, 1.0), (170.0, -1.0)] {
            let cap = read(&close_polar_caps(&wkb(&around(-77.0, start, dir).into())).unwrap());
            let xs: Vec<f64> = cap.exterior().coords().map(|c| c.x).collect();
            assert!(xs.iter().all(|x| (-180.0..=180.0).contains(x)), "{xs:?}");
            assert!(cap.unsigned_area() > 0.0);
            assert!(cap.contains(&Point::new(0.0, -89.0)), "{start} {dir}: {cap:?}");
            assert!(!cap.contains(&Point::new(0.0, -70.0)));
        }
    }

    #[test]
    fn a_ring_around_the_north_pole_closes_along_latitude_90() {
        let cap = read(&close_polar_caps(&wkb(&around(80.0, 10.0, 1.0).into())).unwrap());
        assert!(cap.exterior().coords().any(|c| c.y == 90.0));
        assert!(cap.contains(&Point::new(100.0, 85.0)));
    }

    #[test]
    fn polygons_away_from_the_pole_are_left_alone() {
        let square: Geometry = polygon![(x: 0.0, y: -70.0), (x: 10.0, y: -70.0), (x: 10.0, y: -60.0), (x: 0.0, y: -70.0)].into();
        assert_eq!(close_polar_caps(&wkb(&square)).unwrap(), wkb(&square));
    }

    #[test]
    fn a_hole_around_the_pole_is_refused() {
        let outer = around(-60.0, 0.0, 1.0);
        let hole = around(-80.0, 0.0, 1.0).exterior().clone();
        let ring_band: Geometry = Polygon::new(outer.exterior().clone(), vec![hole]).into();
        let e = close_polar_caps(&wkb(&ring_band)).unwrap_err();
        assert_eq!(e.code, Code::InvalidParameter);
        assert!(e.message.contains("holes"), "{}", e.message);
    }
}
