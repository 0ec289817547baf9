//! What changed between an edit's old shape O and new shape N, as a shape: their symmetric
//! difference (osm2pgsql 2.3's `diff_expire`). Polygons by boolean XOR (geo's `BooleanOps`); lines
//! by their segments (a segment of O that N does not have, and the other way round); points by
//! position. So one vertex moved on a large polygon leaves two slivers near that vertex, and a line
//! keeps only the segments next to the moved vertex. Everything in world units, exact where the
//! shapes share vertices and never smaller than the true difference otherwise.

use std::collections::HashSet;

use geo::{BooleanOps, Coord, LineString, MultiPolygon, Polygon};

use super::shape::{Shape, Xy};

fn key(p: &Xy) -> (u64, u64) {
    (p[0].to_bits(), p[1].to_bits())
}

fn segment_key(a: &Xy, b: &Xy) -> ((u64, u64), (u64, u64)) {
    let (a, b) = (key(a), key(b));
    if a <= b { (a, b) } else { (b, a) }
}

fn segments(lines: &[Vec<Xy>]) -> HashSet<((u64, u64), (u64, u64))> {
    lines.iter().flat_map(|l| l.windows(2)).map(|w| segment_key(&w[0], &w[1])).collect()
}

/// The segments of `lines` that `other` does not have, each as a two-point line.
fn segments_not_in(lines: &[Vec<Xy>], other: &HashSet<((u64, u64), (u64, u64))>) -> Vec<Vec<Xy>> {
    let mut out = Vec::new();
    for l in lines {
        if l.len() == 1 {
            out.push(l.clone());
        }
        for w in l.windows(2) {
            if !other.contains(&segment_key(&w[0], &w[1])) {
                out.push(vec![w[0], w[1]]);
            }
        }
    }
    out
}

fn to_geo(polygons: &[Vec<Vec<Xy>>]) -> MultiPolygon {
    let ring = |r: &Vec<Xy>| LineString::from(r.iter().map(|p| Coord { x: p[0], y: p[1] }).collect::<Vec<_>>());
    MultiPolygon::new(
        polygons
            .iter()
            .filter(|p| !p.is_empty())
            .map(|p| Polygon::new(ring(&p[0]), p[1..].iter().map(ring).collect()))
            .collect(),
    )
}

fn from_geo(m: &MultiPolygon) -> Vec<Vec<Vec<Xy>>> {
    let ring = |l: &LineString| l.coords().map(|c| [c.x, c.y]).collect::<Vec<_>>();
    m.iter().map(|p| std::iter::once(ring(p.exterior())).chain(p.interiors().iter().map(ring)).collect()).collect()
}

/// The symmetric difference of `old` and `new`. None when the polygon overlay failed (it must
/// not take the worker down); the caller then covers both shapes whole.
pub fn symmetric_difference(old: &Shape, new: &Shape) -> Option<Shape> {
    let old_points: HashSet<_> = old.points.iter().map(key).collect();
    let new_points: HashSet<_> = new.points.iter().map(key).collect();
    let mut points: Vec<Xy> = old.points.iter().filter(|p| !new_points.contains(&key(p))).copied().collect();
    points.extend(new.points.iter().filter(|p| !old_points.contains(&key(p))));

    let mut lines = segments_not_in(&old.lines, &segments(&new.lines));
    lines.extend(segments_not_in(&new.lines, &segments(&old.lines)));

    let polygons = match (old.polygons.is_empty(), new.polygons.is_empty()) {
        (true, true) => Vec::new(),
        (false, true) => old.polygons.clone(),
        (true, false) => new.polygons.clone(),
        (false, false) if old.polygons == new.polygons => Vec::new(),
        (false, false) => {
            let (a, b) = (to_geo(&old.polygons), to_geo(&new.polygons));
            let xor = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.xor(&b))).ok()?;
            from_geo(&xor)
        }
    };
    Some(Shape { points, lines, polygons })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn square(x0: f64, y0: f64, s: f64) -> Vec<Vec<Xy>> {
        vec![vec![[x0, y0], [x0 + s, y0], [x0 + s, y0 + s], [x0, y0 + s], [x0, y0]]]
    }

    #[test]
    fn unchanged_shapes_differ_in_nothing() {
        let s = Shape { polygons: vec![square(0.1, 0.1, 0.2)], lines: vec![vec![[0.0, 0.0], [0.1, 0.1]]], points: vec![[0.5, 0.5]] };
        assert_eq!(symmetric_difference(&s, &s).unwrap(), Shape::default());
    }

    #[test]
    fn one_moved_vertex_of_a_line_keeps_its_two_segments() {
        let a = Shape { lines: vec![vec![[0.0, 0.0], [0.1, 0.0], [0.2, 0.0], [0.3, 0.0]]], ..Default::default() };
        let b = Shape { lines: vec![vec![[0.0, 0.0], [0.1, 0.0], [0.2, 0.01], [0.3, 0.0]]], ..Default::default() };
        let d = symmetric_difference(&a, &b).unwrap();
        assert_eq!(d.lines.len(), 4);
        assert!(d.lines.iter().flatten().all(|p| p[0] >= 0.1));
    }

    #[test]
    fn one_moved_vertex_of_a_polygon_leaves_a_sliver_near_it() {
        let a = Shape { polygons: vec![square(0.0, 0.0, 0.5)], ..Default::default() };
        let mut moved = square(0.0, 0.0, 0.5);
        moved[0][2] = [0.51, 0.52];
        let b = Shape { polygons: vec![moved], ..Default::default() };
        let d = symmetric_difference(&a, &b).unwrap();
        // Two thin triangles along the moved corner's edges: 0.0025 + 0.005 of the square's 0.25.
        use geo::Area;
        let area = to_geo(&d.polygons).unsigned_area();
        assert!((area - 0.0075).abs() < 1e-9, "{area}");
    }
}
