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

/// The symmetric difference of polygons whose parts and rings have the same vertex counts (a
/// vertex or a few moved), without an overlay: a point lies in O xor N when it lies inside an odd
/// number of all their rings (even-odd), and the rings differ only along each run of changed
/// vertices. So O xor N is, by the same even-odd rule, the loops that each run's old path and new
/// path close between the unchanged vertices on either side: small polygons near the moved
/// vertices, as cover() fills them (even-odd over a polygon's rings). None when the structure
/// differs, or when every vertex of a ring changed (a ring moved whole): its old and new ring
/// would close the difference by parity, but their edges that slide along their own line (a
/// rectangle moved along an axis) would be traced where the difference has no width, 33 tiles
/// for 29 (found by a new user's trial); the overlay is exact there.
fn changed_loops(old: &[Vec<Vec<Xy>>], new: &[Vec<Vec<Xy>>]) -> Option<Vec<Vec<Vec<Xy>>>> {
    let same_counts = |a: &Vec<Vec<Xy>>, b: &Vec<Vec<Xy>>| a.len() == b.len() && a.iter().zip(b).all(|(r, s)| r.len() == s.len());
    if old.len() != new.len() || !old.iter().zip(new).all(|(a, b)| same_counts(a, b)) {
        return None;
    }
    let mut loops = Vec::new();
    for (r, s) in old.iter().flatten().zip(new.iter().flatten()) {
        // Closed rings: vertex n is vertex 0.
        let n = r.len().saturating_sub(1);
        if n < 3 {
            return None;
        }
        let changed = |i: usize| key(&r[i % n]) != key(&s[i % n]);
        let start = (0..n).find(|&i| !changed(i))?;
        let mut k = 1;
        while k <= n {
            if !changed(start + k) {
                k += 1;
                continue;
            }
            let first = start + k;
            while changed(start + k) {
                k += 1;
            }
            // Vertices first..start+k changed; first - 1 and start + k did not.
            let (a, b) = (r[(first - 1) % n], r[(start + k) % n]);
            let mut ring = vec![a];
            ring.extend((first..start + k).map(|i| r[i % n]));
            ring.push(b);
            ring.extend((first..start + k).rev().map(|i| s[i % n]));
            ring.push(a);
            loops.push(vec![ring]);
        }
    }
    Some(loops)
}

/// The polygons' XOR by geo's overlay; None when it failed.
fn overlay_xor(old: &[Vec<Vec<Xy>>], new: &[Vec<Vec<Xy>>]) -> Option<Vec<Vec<Vec<Xy>>>> {
    let (a, b) = (to_geo(old), to_geo(new));
    let xor = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.xor(&b))).ok()?;
    Some(from_geo(&xor))
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
        (false, false) if let Some(loops) = changed_loops(&old.polygons, &new.polygons) => loops,
        (false, false) => overlay_xor(&old.polygons, &new.polygons)?,
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
        let area = to_geo(&overlay_xor(&a.polygons, &b.polygons).unwrap()).unsigned_area();
        assert!((area - 0.0075).abs() < 1e-9, "{area}");
        // The loop of the moved corner's run holds the corner's two neighbours and both positions.
        assert_eq!(d.polygons, vec![vec![vec![[0.5, 0.0], [0.5, 0.5], [0.0, 0.5], [0.51, 0.52], [0.5, 0.0]]]]);
    }

    /// Tiles of a shape at `zoom`, sorted.
    fn tiles(s: &Shape, zoom: u8) -> Vec<crate::tiles::Tile> {
        let mut out = Vec::new();
        let mut c = super::super::cover::Collector::new(zoom, &mut out, usize::MAX);
        super::super::cover::cover(s, 0.1, crate::tiles::Mode::FullArea, &mut c).unwrap();
        out.sort_unstable();
        out.dedup();
        out
    }

    #[test]
    fn changed_loops_cover_the_tiles_the_overlay_covers() {
        // A ring of 40 vertices around a hole of 12, with runs of one, two and all vertices moved,
        // the run across the ring's closing vertex among them.
        let ring = |n: usize, r: f64, c: [f64; 2]| -> Vec<Xy> {
            let mut v: Vec<Xy> = (0..n)
                .map(|i| {
                    let t = i as f64 / n as f64 * std::f64::consts::TAU;
                    let wobble = 1.0 + 0.15 * ((i * 7 % 5) as f64 / 5.0);
                    [c[0] + r * wobble * t.cos(), c[1] + r * wobble * t.sin()]
                })
                .collect();
            v.push(v[0]);
            v
        };
        let c = [0.3141, 0.2718];
        let old = vec![vec![ring(40, 0.002, c), ring(12, 0.0005, c)]];
        let nudge = |p: Xy, d: f64| [p[0] + d, p[1] - d * 0.7];
        let mut cases: Vec<Vec<Vec<Vec<Xy>>>> = Vec::new();
        for moved in [vec![5], vec![0], vec![39, 0, 1], vec![10, 11, 20]] {
            let mut p = old.clone();
            for &i in &moved {
                p[0][0][i] = nudge(p[0][0][i], 0.00004);
            }
            p[0][0][40] = p[0][0][0];
            cases.push(p);
        }
        let shape = |p: &Vec<Vec<Vec<Xy>>>| Shape { polygons: p.clone(), ..Default::default() };
        for (i, new) in cases.iter().enumerate() {
            let loops = changed_loops(&old, new).unwrap();
            let overlay = overlay_xor(&old, new).unwrap();
            for zoom in [8, 12, 14, 16, 18] {
                let (a, b) = (tiles(&shape(&loops), zoom), tiles(&shape(&overlay), zoom));
                assert!(!b.is_empty(), "case {i} zoom {zoom}: an empty difference");
                assert_eq!(a, b, "case {i} zoom {zoom}");
            }
        }
        // A vertex more or less is a different structure, and a ring moved whole has no unchanged
        // vertex to close a loop at: the overlay's job.
        let mut fewer = old.clone();
        fewer[0][0].remove(3);
        assert!(changed_loops(&old, &fewer).is_none());
        let mut hole_moved = old.clone();
        hole_moved[0][1] = hole_moved[0][1].iter().map(|&p| nudge(p, 0.00002)).collect();
        assert!(changed_loops(&old, &hole_moved).is_none());
    }

    #[test]
    fn a_rectangle_moved_along_an_axis_expires_only_its_two_slivers() {
        // Lyon's 0.06 x 0.04 degree box moved 0.003 degrees east, in world units: its top and
        // bottom edges slide along themselves, where the difference has no width.
        let w = |lon: f64, lat: f64| crate::tiles::mercator::world_xy(lon, lat);
        let rect = |x0: f64| vec![vec![w(x0, 45.74), w(x0 + 0.06, 45.74), w(x0 + 0.06, 45.78), w(x0, 45.78), w(x0, 45.74)]];
        let (a, b) = (Shape { polygons: vec![rect(4.80)], ..Default::default() }, Shape { polygons: vec![rect(4.803)], ..Default::default() });
        let d = symmetric_difference(&a, &b).unwrap();
        // The difference is the two 0.003-degree slivers at the west and east ends.
        let sliver = |x0: f64| vec![vec![w(x0, 45.74), w(x0 + 0.003, 45.74), w(x0 + 0.003, 45.78), w(x0, 45.78), w(x0, 45.74)]];
        let slivers = Shape { polygons: vec![sliver(4.80), sliver(4.86)], ..Default::default() };
        for zoom in [10, 12, 14] {
            assert_eq!(tiles(&d, zoom), tiles(&slivers, zoom), "zoom {zoom}");
        }
    }
}
