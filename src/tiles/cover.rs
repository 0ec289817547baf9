//! The tiles a shape touches at one zoom. A tile is touched when the shape intersects the tile's
//! square grown by `buffer` × the tile's width on every side (osm2pgsql's buffer; PostGIS's
//! `ST_TileEnvelope(z, x, y, margin => buffer)`). Exact, not sampled:
//! - a point touches the tiles whose grown square holds it;
//! - a line or ring touches, column by column, the rows its piece within the grown column spans;
//! - a polygon's area adds every tile whose centre lies inside it (even-odd, so holes and parts
//!   work): a tile whose grown square meets no ring lies wholly inside or wholly outside, and its
//!   centre tells which.
//!
//! Tile columns past the antimeridian (x beyond the world) wrap around; rows beyond the world's
//! edge do not exist and are skipped. Pure Rust.

use super::shape::{Shape, Xy, bounds};
use super::{Mode, Tile};

/// Slack in tile units against rounding: a shape exactly on a grown square's edge touches it
/// (ST_Intersects counts touching), and a tile more is never a stale tile.
const EPS: f64 = 1e-9;

/// `x.floor() as i64` without a call into libm: baseline x86-64 has no rounding instruction
/// (SSE4.1), and a county move's cover rounded some 300 times. Exact for |x| < 2^53.
#[inline]
fn floor(x: f64) -> i64 {
    let i = x as i64;
    i - ((i as f64) > x) as i64
}

/// `x.ceil() as i64`, as `floor`.
#[inline]
fn ceil(x: f64) -> i64 {
    let i = x as i64;
    i + ((i as f64) < x) as i64
}

/// The enumeration stopped: more tiles than the cap were pushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverCap;

/// Collects tiles of one zoom, counting against a cap so that a huge shape at a high zoom stops
/// early instead of filling memory.
pub struct Collector<'a> {
    pub zoom: u8,
    n: i64,
    out: &'a mut Vec<Tile>,
    left: usize,
}

impl<'a> Collector<'a> {
    pub fn new(zoom: u8, out: &'a mut Vec<Tile>, cap: usize) -> Self {
        Collector { zoom, n: 1i64 << zoom, out, left: cap }
    }

    fn push(&mut self, tx: i64, ty: i64) -> Result<(), OverCap> {
        if ty < 0 || ty >= self.n {
            return Ok(());
        }
        if self.left == 0 {
            return Err(OverCap);
        }
        self.left -= 1;
        self.out.push(Tile { zoom: self.zoom, x: tx.rem_euclid(self.n) as u32, y: ty as u32 });
        Ok(())
    }

    /// Tile rows (or columns) whose grown span [t - b, t + 1 + b] meets [lo, hi].
    fn span(lo: f64, hi: f64, b: f64) -> std::ops::RangeInclusive<i64> {
        ceil(lo - 1.0 - b - EPS)..=floor(hi + b + EPS)
    }

    fn rows(&self, lo: f64, hi: f64, b: f64) -> std::ops::RangeInclusive<i64> {
        let r = Self::span(lo, hi, b);
        (*r.start()).max(0)..=(*r.end()).min(self.n - 1)
    }
}

/// Scratch buffers one cover reuses across the zooms of a shape and the shapes of a chunk.
#[derive(Default)]
pub struct Scratch {
    /// Tile-unit coordinates of every line and ring of the shape, and where each ring starts.
    scaled: Vec<Xy>,
    starts: Vec<usize>,
    /// A row's crossings in `area`.
    xs: Vec<f64>,
}

/// The box of all of a shape's coordinates in world units; None for an empty shape.
pub fn shape_bounds(shape: &Shape) -> Option<[f64; 4]> {
    bounds(shape.points.iter().chain(shape.lines.iter().flatten()).chain(shape.polygons.iter().flatten().flatten()))
}

/// Pushes the tiles `shape` touches at the collector's zoom (the tests' entry; `cover_in` keeps
/// its box and buffers across zooms).
#[cfg(test)]
pub fn cover(shape: &Shape, buffer: f64, mode: Mode, c: &mut Collector) -> Result<(), OverCap> {
    cover_in(shape, shape_bounds(shape), buffer, mode, c, &mut Scratch::default())
}

/// `cover` with the shape's box (`shape_bounds`) computed once for all zooms, and kept buffers.
pub fn cover_in(shape: &Shape, bounds: Option<[f64; 4]>, buffer: f64, mode: Mode, c: &mut Collector, scratch: &mut Scratch) -> Result<(), OverCap> {
    let scale = c.n as f64;
    // Where the shape's box meets one tile's grown square only, the shape lies inside that square
    // (the grown squares cover the world) and touches that tile alone: no tracing. A moved vertex's
    // difference is small, so this is most zooms of most moves.
    let Some([x0, y0, x1, y1]) = bounds else {
        return Ok(());
    };
    let (columns, rows) = (Collector::span(x0 * scale, x1 * scale, buffer), c.rows(y0 * scale, y1 * scale, buffer));
    if columns.start() == columns.end() && rows.start() == rows.end() {
        return c.push(*columns.start(), *rows.start());
    }
    let t = |p: &Xy| [p[0] * scale, p[1] * scale];
    for p in &shape.points {
        point(t(p), buffer, c)?;
    }
    let Scratch { scaled, starts, xs } = scratch;
    for l in &shape.lines {
        scaled.clear();
        scaled.extend(l.iter().map(t));
        line(scaled, buffer, c)?;
    }
    for poly in &shape.polygons {
        scaled.clear();
        starts.clear();
        for r in poly {
            starts.push(scaled.len());
            scaled.extend(r.iter().map(t));
        }
        starts.push(scaled.len());
        let rings = || starts.windows(2).map(|w| &scaled[w[0]..w[1]]);
        for r in rings() {
            line(r, buffer, c)?;
        }
        if mode.full_area(poly) {
            area(rings(), c, xs)?;
        }
    }
    Ok(())
}

fn point(p: Xy, b: f64, c: &mut Collector) -> Result<(), OverCap> {
    for ty in c.rows(p[1], p[1], b) {
        for tx in Collector::span(p[0], p[0], b) {
            c.push(tx, ty)?;
        }
    }
    Ok(())
}

fn line(l: &[Xy], b: f64, c: &mut Collector) -> Result<(), OverCap> {
    if l.len() == 1 {
        return point(l[0], b, c);
    }
    l.windows(2).try_for_each(|w| segment(w[0], w[1], b, c))
}

/// Column by column: the piece of the segment within the grown column, and the rows its y-extent
/// meets. A segment is monotone in x, so a piece's y-extent is that of its two ends.
fn segment(p: Xy, q: Xy, b: f64, c: &mut Collector) -> Result<(), OverCap> {
    let (p, q) = if p[0] <= q[0] { (p, q) } else { (q, p) };
    let dx = q[0] - p[0];
    for tx in Collector::span(p[0], q[0], b) {
        let (lo, hi) = (tx as f64 - b - EPS, tx as f64 + 1.0 + b + EPS);
        let (xa, xb) = (p[0].max(lo), q[0].min(hi));
        if xa > xb {
            continue;
        }
        let (ya, yb) = if dx <= 0.0 {
            (p[1], q[1])
        } else {
            let y = |x: f64| p[1] + (x - p[0]) * (q[1] - p[1]) / dx;
            (y(xa), y(xb))
        };
        for ty in c.rows(ya.min(yb), ya.max(yb), b) {
            c.push(tx, ty)?;
        }
    }
    Ok(())
}

/// Tiles whose centre lies inside the polygon (even-odd over all its rings), row by row.
fn area<'r>(rings: impl Iterator<Item = &'r [Xy]> + Clone, c: &mut Collector, xs: &mut Vec<f64>) -> Result<(), OverCap> {
    let Some([_, ymin, _, ymax]) = bounds(rings.clone().flatten()) else {
        return Ok(());
    };
    let first = ceil(ymin - 0.5).max(0);
    let last = floor(ymax - 0.5).min(c.n - 1);
    for ty in first..=last {
        let yc = ty as f64 + 0.5;
        xs.clear();
        for w in rings.clone().flat_map(|r| r.windows(2)) {
            let (a, b) = (w[0], w[1]);
            if (a[1] <= yc) != (b[1] <= yc) {
                xs.push(a[0] + (yc - a[1]) * (b[0] - a[0]) / (b[1] - a[1]));
            }
        }
        xs.sort_by(f64::total_cmp);
        for pair in xs.chunks_exact(2) {
            for tx in ceil(pair[0] - 0.5)..=floor(pair[1] - 0.5) {
                c.push(tx, ty)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiles(shape: &Shape, zoom: u8, buffer: f64, mode: Mode) -> Vec<(u32, u32)> {
        let mut v = Vec::new();
        cover(shape, buffer, mode, &mut Collector::new(zoom, &mut v, usize::MAX)).unwrap();
        let mut t: Vec<_> = v.iter().map(|t| (t.x, t.y)).collect();
        t.sort();
        t.dedup();
        t
    }

    fn square(x0: f64, y0: f64, x1: f64, y1: f64) -> Vec<Vec<Xy>> {
        vec![vec![[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]]
    }

    #[test]
    fn floor_and_ceil_round_as_libm_does() {
        for x in [-2.5, -2.0, -1e-12, -0.0, 0.0, 1e-12, 0.5, 1.0, 3.999_999_999, 1048576.25, -1048576.25] {
            assert_eq!(floor(x), x.floor() as i64, "{x}");
            assert_eq!(ceil(x), x.ceil() as i64, "{x}");
        }
    }

    #[test]
    fn a_point_touches_its_tile_and_neighbours_within_the_buffer() {
        let s = Shape { points: vec![[0.51, 0.51]], ..Default::default() };
        // Zoom 2: tile width 0.25; 0.51 is 0.04 tiles into tile 2, inside a 0.1 buffer of tile 1.
        assert_eq!(tiles(&s, 2, 0.1, Mode::FullArea), vec![(1, 1), (1, 2), (2, 1), (2, 2)]);
        assert_eq!(tiles(&s, 2, 0.0, Mode::FullArea), vec![(2, 2)]);
    }

    #[test]
    fn a_diagonal_line_touches_a_staircase_not_its_box() {
        let s = Shape { lines: vec![vec![[0.001, 0.001], [0.999, 0.999]]], ..Default::default() };
        let t = tiles(&s, 4, 0.0, Mode::FullArea);
        // The diagonal through tile corners touches the diagonal tiles and, at each corner, the
        // two tiles that share it: 16 + 2 × 15.
        assert_eq!(t.len(), 46);
        assert!(t.iter().all(|&(x, y)| (x as i64 - y as i64).abs() <= 1));
    }

    #[test]
    fn full_area_fills_the_inside_and_boundary_only_does_not() {
        let s = Shape { polygons: vec![square(0.1, 0.1, 0.9, 0.9)], ..Default::default() };
        let full = tiles(&s, 3, 0.0, Mode::FullArea);
        assert_eq!(full.len(), 64);
        let ring = tiles(&s, 3, 0.0, Mode::BoundaryOnly);
        assert_eq!(ring.len(), 28);
    }

    #[test]
    fn holes_are_not_filled() {
        let mut rings = square(0.0, 0.0, 1.0, 1.0);
        rings.extend(square(0.3, 0.3, 0.7, 0.7));
        let s = Shape { polygons: vec![rings], ..Default::default() };
        let t = tiles(&s, 4, 0.0, Mode::FullArea);
        // The hole spans 4.8..11.2 tiles: its ring touches columns and rows 4 and 11, and the
        // 6 × 6 tiles between lie wholly inside the hole.
        assert!(!t.contains(&(5, 5)) && !t.contains(&(7, 7)) && !t.contains(&(10, 10)));
        assert!(t.contains(&(4, 4)) && t.contains(&(11, 11)) && t.contains(&(4, 7)));
        assert_eq!(t.len(), 256 - 36);
    }

    #[test]
    fn columns_past_the_antimeridian_wrap() {
        let s = Shape { lines: vec![vec![[0.99, 0.5], [1.01, 0.5]]], ..Default::default() };
        let t = tiles(&s, 3, 0.0, Mode::FullArea);
        assert_eq!(t, vec![(0, 3), (0, 4), (7, 3), (7, 4)]);
    }

    #[test]
    fn the_cap_stops_a_huge_cover() {
        let s = Shape { polygons: vec![square(0.0, 0.0, 1.0, 1.0)], ..Default::default() };
        let mut v = Vec::new();
        assert_eq!(cover(&s, 0.1, Mode::FullArea, &mut Collector::new(20, &mut v, 1000)), Err(OverCap));
        assert_eq!(v.len(), 1000);
    }

    #[test]
    fn hybrid_fills_small_polygons_only() {
        let small = Shape { polygons: vec![square(0.1, 0.1, 0.9, 0.9)], ..Default::default() };
        let limit = 0.81 * super::super::mercator::WORLD_WIDTH_M;
        assert_eq!(tiles(&small, 3, 0.0, Mode::Hybrid { full_area_limit_m: limit }).len(), 64);
        assert_eq!(tiles(&small, 3, 0.0, Mode::Hybrid { full_area_limit_m: limit / 2.0 }).len(), 28);
    }
}
