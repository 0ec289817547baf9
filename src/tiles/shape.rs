//! An edit's shape in world units, read from the WKB (EPSG:4326 degrees) the edit path stored.
//! Shapes across the antimeridian follow the edit path's rule (`edit::inspect`): an edge spanning
//! more than 180° of longitude crosses it, and the shape's negative longitudes are shifted by 360°,
//! so the shape continues past x = 1 instead of stretching across the world; the cover wraps those
//! tiles back (`cover`), which is the same as splitting the shape at the antimeridian.

use geo_traits::{
    CoordTrait, GeometryCollectionTrait, GeometryTrait, GeometryType, LineStringTrait, MultiLineStringTrait,
    MultiPointTrait, MultiPolygonTrait, PointTrait, PolygonTrait,
};

use super::mercator::world_xy;

pub type Xy = [f64; 2];

/// Points, lines and polygons (rings, the first the exterior) in world units.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shape {
    pub points: Vec<Xy>,
    pub lines: Vec<Vec<Xy>>,
    pub polygons: Vec<Vec<Vec<Xy>>>,
}

/// The box of `points` in world units, [min x, min y, max x, max y]; None for none.
pub fn bounds<'a>(points: impl IntoIterator<Item = &'a Xy>) -> Option<[f64; 4]> {
    points.into_iter().fold(None, |b: Option<[f64; 4]>, p| {
        Some(match b {
            None => [p[0], p[1], p[0], p[1]],
            Some(b) => [b[0].min(p[0]), b[1].min(p[1]), b[2].max(p[0]), b[3].max(p[1])],
        })
    })
}

/// Why a stored shape could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stored shape is not readable: {}", self.0)
    }
}

/// Reads a 2-D WKB geometry of EPSG:4326 degrees into world units. Non-finite ordinates and
/// unsupported types are errors; the edit path refuses them before they are stored.
pub fn from_wkb(bytes: &[u8]) -> Result<Shape, ShapeError> {
    let read = || -> Result<Shape, ShapeError> {
        let g = wkb::reader::read_wkb(bytes).map_err(|e| ShapeError(e.to_string()))?;
        let mut deg = Shape::default();
        collect(&g, &mut deg)?;
        Ok(project(deg))
    };
    // The lazy WKB reader panics on a truncated buffer; a bad row must not take the worker down.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read))
        .unwrap_or_else(|_| Err(ShapeError("truncated WKB".into())))
}

fn coord(c: &impl CoordTrait<T = f64>) -> Result<Xy, ShapeError> {
    let (x, y) = (c.x(), c.y());
    if x.is_finite() && y.is_finite() { Ok([x, y]) } else { Err(ShapeError(format!("non-finite ordinate ({x}, {y})"))) }
}

fn line(l: &impl LineStringTrait<T = f64>) -> Result<Vec<Xy>, ShapeError> {
    l.coords().map(|c| coord(&c)).collect()
}

fn polygon(p: &impl PolygonTrait<T = f64>) -> Result<Vec<Vec<Xy>>, ShapeError> {
    let mut rings = Vec::new();
    if let Some(e) = p.exterior() {
        rings.push(line(&e)?);
    }
    for r in p.interiors() {
        rings.push(line(&r)?);
    }
    rings.retain(|r| !r.is_empty());
    Ok(rings)
}

fn collect(g: &impl GeometryTrait<T = f64>, out: &mut Shape) -> Result<(), ShapeError> {
    match g.as_type() {
        GeometryType::Point(p) => out.points.extend(p.coord().map(|c| coord(&c)).transpose()?),
        GeometryType::LineString(l) => out.lines.push(line(l)?),
        GeometryType::Polygon(p) => out.polygons.push(polygon(p)?),
        GeometryType::MultiPoint(m) => {
            for p in m.points() {
                out.points.extend(p.coord().map(|c| coord(&c)).transpose()?);
            }
        }
        GeometryType::MultiLineString(m) => {
            for l in m.line_strings() {
                out.lines.push(line(&l)?);
            }
        }
        GeometryType::MultiPolygon(m) => {
            for p in m.polygons() {
                out.polygons.push(polygon(&p)?);
            }
        }
        GeometryType::GeometryCollection(c) => {
            for m in c.geometries() {
                collect(&m, out)?;
            }
        }
        _ => return Err(ShapeError("unsupported geometry type".into())),
    }
    out.lines.retain(|l| !l.is_empty());
    out.polygons.retain(|p| !p.is_empty());
    Ok(())
}

/// True when an edge spans more than 180° of longitude (not along a pole): the edit path's rule.
fn crosses_antimeridian(deg: &Shape) -> bool {
    let edges = deg.lines.iter().chain(deg.polygons.iter().flatten());
    edges.flat_map(|l| l.windows(2)).any(|w| (w[1][0] - w[0][0]).abs() > 180.0 && !(w[0][1].abs() == 90.0 && w[0][1] == w[1][1]))
}

fn project(deg: Shape) -> Shape {
    let shift = crosses_antimeridian(&deg);
    let p = |c: &Xy| world_xy(if shift && c[0] < 0.0 { c[0] + 360.0 } else { c[0] }, c[1]);
    Shape {
        points: deg.points.iter().map(p).collect(),
        lines: deg.lines.iter().map(|l| l.iter().map(p).collect()).collect(),
        polygons: deg.polygons.iter().map(|r| r.iter().map(|l| l.iter().map(p).collect()).collect()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::edit::inspect::tests::wkb;
    use geo::{Geometry, LineString, Point, polygon};

    #[test]
    fn reads_each_kind_in_world_units() {
        let s = from_wkb(&wkb(&Point::new(0.0, 0.0).into())).unwrap();
        assert_eq!(s.points, vec![[0.5, 0.5]]);
        let s = from_wkb(&wkb(&polygon![(x: 0., y: 0.), (x: 90., y: 0.), (x: 90., y: 10.), (x: 0., y: 0.)].into())).unwrap();
        assert_eq!(s.polygons.len(), 1);
        assert_eq!(s.polygons[0][0][1][0], 0.75);
    }

    #[test]
    fn a_line_across_the_antimeridian_continues_past_the_edge() {
        let s = from_wkb(&wkb(&LineString::from(vec![(179.0, 0.0), (-179.0, 0.0)]).into())).unwrap();
        let l = &s.lines[0];
        assert!((l[0][0] - 359.0 / 360.0).abs() < 1e-12);
        assert!((l[1][0] - 361.0 / 360.0).abs() < 1e-12);
    }

    #[test]
    fn parts_on_both_sides_without_a_crossing_edge_stay_put() {
        let g: Geometry = geo::MultiPoint::from(vec![(179.0, 0.0), (-179.0, 0.0)]).into();
        let s = from_wkb(&wkb(&g)).unwrap();
        assert!(s.points[1][0] < 0.01);
    }

    #[test]
    fn truncated_wkb_is_an_error_not_a_panic() {
        let mut b = wkb(&LineString::from(vec![(1.0, 2.0), (3.0, 4.0)]).into());
        b.truncate(b.len() - 5);
        assert!(from_wkb(&b).is_err());
    }
}
