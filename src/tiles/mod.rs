//! Tile expiry: the Web Mercator XYZ tiles an edit changed, in osm2pgsql's terms (expire outputs,
//! modes `full-area`, `boundary-only` and `hybrid`, a buffer as a fraction of a tile, `diff_expire`,
//! `max_tiles_geometry`; osm2pgsql manual, "Expire"). Pure Rust: the relay reads the stored shapes
//! and hands them here; nothing in this module touches Postgres.

pub mod cache_purge;
pub mod cover;
pub mod diff;
pub mod functions;
pub mod http_post;
pub mod list;
pub mod mercator;
pub mod rule_cache;
pub mod shape;

use cover::{Collector, Scratch, cover_in, shape_bounds};
use crate::input_error::{Code, InputError};
use shape::{Shape, Xy};

/// The deepest zoom an output may ask for (osm2pgsql's limit too).
pub const MAX_ZOOM: u8 = 20;

/// The largest `max_tiles_geometry`: a cover holds up to four times its limit while it merges
/// (about 48 MB), outside PostgreSQL's memory accounting. Without a cap, any role's
/// tiles_touched of the world at zoom 20 took 24 GB and the kernel killed the backend.
pub const MAX_TILES_GEOMETRY: i64 = 1_000_000;

/// One XYZ tile: y counted from the north. Ordered by (zoom, x, y), the expire table's key order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tile {
    pub zoom: u8,
    pub x: u32,
    pub y: u32,
}

impl Tile {
    /// The tile as one integer in the same order: a sort by it compares once, where the derived
    /// order compares three fields (the sorts were a fifth of a county move's tile math).
    #[inline]
    pub fn key(&self) -> u64 {
        ((self.zoom as u64) << 42) | ((self.x as u64) << 21) | self.y as u64
    }
}

/// Sorts tiles in key order and drops duplicates.
pub fn sort_dedup(tiles: &mut Vec<Tile>) {
    tiles.sort_unstable_by_key(Tile::key);
    tiles.dedup();
}

/// `sort_dedup` for the tiles of one zoom: where their box holds few cells more than there are
/// tiles (a cover traced line by line pushes each tile a few times, close together), one bit a cell
/// sorts and merges them without comparisons. `bits` is kept between calls.
fn sort_dedup_one_zoom(tiles: &mut Vec<Tile>, bits: &mut Vec<u64>) {
    if tiles.len() < 32 {
        return sort_dedup(tiles);
    }
    let (mut x0, mut y0, mut x1, mut y1) = (u32::MAX, u32::MAX, 0, 0);
    for t in tiles.iter() {
        (x0, y0, x1, y1) = (x0.min(t.x), y0.min(t.y), x1.max(t.x), y1.max(t.y));
    }
    let (w, h) = ((x1 - x0) as usize + 1, (y1 - y0) as usize + 1);
    let cells = w.saturating_mul(h);
    if cells > tiles.len().saturating_mul(16).max(4096) {
        return sort_dedup(tiles);
    }
    bits.clear();
    bits.resize(cells.div_ceil(64), 0);
    // Row-major by x, then y: the key order within one zoom.
    for t in tiles.iter() {
        let i = (t.x - x0) as usize * h + (t.y - y0) as usize;
        bits[i / 64] |= 1 << (i % 64);
    }
    let zoom = tiles[0].zoom;
    tiles.clear();
    for (word_index, &word) in bits.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            let i = word_index * 64 + word.trailing_zeros() as usize;
            tiles.push(Tile { zoom, x: x0 + (i / h) as u32, y: y0 + (i % h) as u32 });
            word &= word - 1;
        }
    }
}

/// How a polygon expires (osm2pgsql's `mode`). Points and lines expire the same in every mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// The tiles of the polygon's area.
    FullArea,
    /// The tiles of its rings only.
    BoundaryOnly,
    /// Full area when the polygon's box is at most `full_area_limit_m` wide and high in EPSG:3857
    /// metres, its rings only when larger (osm2pgsql's `full_area_limit`).
    Hybrid { full_area_limit_m: f64 },
}

impl Mode {
    /// Parses osm2pgsql's mode names; `hybrid` needs its limit in EPSG:3857 metres.
    pub fn parse(name: &str, full_area_limit_m: Option<f64>) -> Option<Mode> {
        match (name, full_area_limit_m) {
            ("full-area", _) => Some(Mode::FullArea),
            ("boundary-only", _) => Some(Mode::BoundaryOnly),
            ("hybrid", Some(l)) if l.is_finite() && l >= 0.0 => Some(Mode::Hybrid { full_area_limit_m: l }),
            _ => None,
        }
    }

    /// Whether a polygon (rings in world units) expires its area.
    pub fn full_area(&self, rings: &[Vec<Xy>]) -> bool {
        match *self {
            Mode::FullArea => true,
            Mode::BoundaryOnly => false,
            Mode::Hybrid { full_area_limit_m } => {
                shape::bounds(rings.iter().flatten()).is_some_and(|b| {
                    let w = (b[2] - b[0]) * mercator::WORLD_WIDTH_M;
                    let h = (b[3] - b[1]) * mercator::WORLD_WIDTH_M;
                    w <= full_area_limit_m && h <= full_area_limit_m
                })
            }
        }
    }
}

/// An output's rule for one layer: zooms, buffer, mode, difference on moves, and the tile limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    pub minzoom: u8,
    pub maxzoom: u8,
    /// A fraction of a tile's width added on every side (osm2pgsql's `buffer`; 0.1 = 10 %).
    pub buffer: f64,
    pub mode: Mode,
    /// Moves expire the tiles of the symmetric difference only (osm2pgsql's `diff_expire`).
    pub diff: bool,
    /// Tiles over all zooms one shape may expire before it falls back to its boundary.
    pub max_tiles_geometry: usize,
}

impl Rule {
    /// A rule from SQL arguments, checked: zooms within 0–20 and `minzoom <= maxzoom`, a finite
    /// buffer within [0, 1] tiles, osm2pgsql's mode names, `full_area_limit` (EPSG:3857 metres) for
    /// `hybrid` only, and a tile limit of at least 1. Each refusal is 22023 with the reason.
    pub fn checked(
        minzoom: i32,
        maxzoom: i32,
        buffer: f64,
        mode: &str,
        full_area_limit_m: Option<f64>,
        diff: bool,
        max_tiles_geometry: i64,
    ) -> Result<Rule, InputError> {
        let bad = |m: String, h: &str| Err(InputError::new(Code::InvalidParameter, m).hint(h));
        let zooms = format!("Zooms run from 0 to {MAX_ZOOM} (Web Mercator XYZ, as osm2pgsql's expire outputs).");
        if !(0..=MAX_ZOOM as i32).contains(&maxzoom) {
            return bad(format!("maxzoom {maxzoom} is outside 0–{MAX_ZOOM}"), &zooms);
        }
        if !(0..=maxzoom).contains(&minzoom) {
            return bad(format!("minzoom {minzoom} is outside 0–{maxzoom} (maxzoom)"), &zooms);
        }
        if !(buffer.is_finite() && (0.0..=1.0).contains(&buffer)) {
            return bad(format!("buffer {buffer} is outside 0–1"), "The buffer is a fraction of a tile's width added on every side: 0.1 is 10 %.");
        }
        if let Some(l) = full_area_limit_m.filter(|l| !(l.is_finite() && *l >= 0.0)) {
            return bad(format!("full_area_limit {l} is not a finite width of 0 or more"), "full_area_limit is the width or height of a polygon's box in EPSG:3857 metres up to which its whole area expires.");
        }
        if mode != "hybrid" && full_area_limit_m.is_some() {
            return bad(format!("full_area_limit applies to mode 'hybrid', not '{mode}'"), "Give mode => 'hybrid' with it, or leave it out.");
        }
        let Some(mode) = Mode::parse(mode, full_area_limit_m) else {
            return bad(
                if mode == "hybrid" { "mode 'hybrid' needs a full_area_limit".to_string() } else { format!("unknown expire mode '{mode}'") },
                "Modes: 'full-area', 'boundary-only', or 'hybrid' with full_area_limit (the width or height of a polygon's box in EPSG:3857 metres up to which its whole area expires).",
            );
        };
        if !(1..=MAX_TILES_GEOMETRY).contains(&max_tiles_geometry) {
            return bad(
                format!("max_tiles_geometry {max_tiles_geometry} is outside 1–{MAX_TILES_GEOMETRY}"),
                "It is the tiles, over all zooms, one shape may expire before it falls back to its boundary; the cap bounds the memory one cover may take (12 bytes a tile).",
            );
        }
        Ok(Rule {
            minzoom: minzoom as u8,
            maxzoom: maxzoom as u8,
            buffer,
            mode,
            diff,
            max_tiles_geometry: usize::try_from(max_tiles_geometry).unwrap_or(usize::MAX),
        })
    }
}

/// What an event changed, with the shapes it is known by.
pub enum Change<'a> {
    /// `created`, `updated`, `snapshot`: the new shape's tiles.
    New(&'a Shape),
    /// `retired`: the old shape's tiles.
    Old(&'a Shape),
    /// `moved`: with `diff` and unchanged properties the difference's tiles, else both shapes'.
    Moved { old: &'a Shape, new: &'a Shape, properties_changed: bool },
}

/// The tiles of one change, sorted and without duplicates, and what the limits did to them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Expired {
    pub tiles: Vec<Tile>,
    /// The shape was over `max_tiles_geometry`: only its boundary's tiles were expired.
    pub fell_back_to_boundary: bool,
    /// Even the boundary was over the limit: the zooms from this one up were not expired.
    pub dropped_from_zoom: Option<u8>,
    /// The polygon overlay failed: both shapes were expired whole.
    pub overlay_failed: bool,
}

/// The tiles one change expires under `rule`.
pub fn expire(change: &Change, rule: &Rule) -> Expired {
    let mut overlay_failed = false;
    let diffed;
    let shapes: Vec<&Shape> = match change {
        Change::New(s) | Change::Old(s) => vec![s],
        Change::Moved { old, new, properties_changed } => {
            match (rule.diff && !properties_changed).then(|| diff::symmetric_difference(old, new)) {
                Some(Some(d)) => {
                    diffed = d;
                    vec![&diffed]
                }
                Some(None) => {
                    overlay_failed = true;
                    vec![old, new]
                }
                None => vec![old, new],
            }
        }
    };
    let mut out = cover_all(&shapes, rule, rule.mode);
    out.overlay_failed = overlay_failed;
    out
}

fn cover_all(shapes: &[&Shape], rule: &Rule, mode: Mode) -> Expired {
    let limit = rule.max_tiles_geometry;
    match covered(shapes, rule, mode, limit) {
        Ok(tiles) => Expired { tiles, ..Default::default() },
        Err(_) if mode != Mode::BoundaryOnly => {
            let mut e = cover_all(shapes, rule, Mode::BoundaryOnly);
            e.fell_back_to_boundary = true;
            e
        }
        Err((tiles, zoom)) => Expired { tiles, fell_back_to_boundary: true, dropped_from_zoom: Some(zoom), overlay_failed: false },
    }
}

/// Every zoom's tiles, or on going over `limit` the tiles of the zooms that fitted and the zoom
/// that did not.
fn covered(shapes: &[&Shape], rule: &Rule, mode: Mode, limit: usize) -> Result<Vec<Tile>, (Vec<Tile>, u8)> {
    let mut all: Vec<Tile> = Vec::new();
    // One scratch list for every zoom: growing a fresh one per zoom was a fifth of a small cover.
    let mut this = Vec::with_capacity(256);
    let mut scratch = Scratch::default();
    let mut bits = Vec::new();
    let boxes: Vec<Option<[f64; 4]>> = shapes.iter().map(|s| shape_bounds(s)).collect();
    for zoom in rule.minzoom..=rule.maxzoom.min(MAX_ZOOM) {
        this.clear();
        // Duplicates are pushed before they are merged: allow some, then count what is distinct.
        let cap = (limit - all.len()).saturating_mul(4).saturating_add(1024);
        let over = {
            let mut c = Collector::new(zoom, &mut this, cap);
            shapes.iter().zip(&boxes).try_for_each(|(s, b)| cover_in(s, *b, rule.buffer, mode, &mut c, &mut scratch)).is_err()
        };
        sort_dedup_one_zoom(&mut this, &mut bits);
        if over || all.len() + this.len() > limit {
            return Err((all, zoom));
        }
        all.extend_from_slice(&this);
    }
    Ok(all)
}

/// A box `[west, south, east, north]` in EPSG:4326 degrees as a polygon shape (west > east across
/// the antimeridian, RFC 7946 §5.2): the fallback when an event's old shape was never kept.
pub fn box_shape(b: [f64; 4]) -> Shape {
    let [w, s, e, n] = b;
    let e = if e < w { e + 360.0 } else { e };
    let c = |x: f64, y: f64| mercator::world_xy(x, y);
    Shape { polygons: vec![vec![vec![c(w, s), c(e, s), c(e, n), c(w, n), c(w, s)]]], ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(maxzoom: u8) -> Rule {
        Rule { minzoom: 0, maxzoom, buffer: 0.1, mode: Mode::FullArea, diff: true, max_tiles_geometry: 100_000 }
    }

    fn square(x0: f64, y0: f64, s: f64) -> Shape {
        Shape { polygons: vec![vec![vec![[x0, y0], [x0 + s, y0], [x0 + s, y0 + s], [x0, y0 + s], [x0, y0]]]], ..Default::default() }
    }

    #[test]
    fn the_key_orders_as_zoom_x_y() {
        let a = [Tile { zoom: 3, x: 7, y: 0 }, Tile { zoom: 4, x: 0, y: 0 }, Tile { zoom: 20, x: (1 << 20) - 1, y: 5 }, Tile { zoom: 20, x: (1 << 20) - 1, y: 6 }];
        for w in a.windows(2) {
            assert!(w[0] < w[1] && w[0].key() < w[1].key());
        }
    }

    #[test]
    fn one_zoom_merges_by_bitmap_as_by_sorting() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let mut bits = Vec::new();
        for (spread, n) in [(5, 40), (40, 200), (3000, 100), (1 << 14, 64)] {
            let tiles: Vec<Tile> = (0..n).map(|_| Tile { zoom: 14, x: 9000 + next() % spread, y: 5000 + next() % spread }).collect();
            let (mut by_bits, mut by_sort) = (tiles.clone(), tiles);
            sort_dedup_one_zoom(&mut by_bits, &mut bits);
            sort_dedup(&mut by_sort);
            assert_eq!(by_bits, by_sort, "spread {spread}");
        }
    }

    #[test]
    fn tiles_are_sorted_by_key_without_duplicates() {
        let e = expire(&Change::New(&square(0.3, 0.3, 0.01)), &rule(10));
        let mut sorted = e.tiles.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(e.tiles, sorted);
        assert_eq!(e.tiles[0], Tile { zoom: 0, x: 0, y: 0 });
    }

    /// A square of side `s` whose edges have `k` vertices each, as county rings have many.
    fn fine_square(x0: f64, y0: f64, s: f64, k: usize) -> Shape {
        let mut ring = Vec::new();
        for side in 0..4 {
            for i in 0..k {
                let f = s * i as f64 / k as f64;
                ring.push(match side {
                    0 => [x0 + f, y0],
                    1 => [x0 + s, y0 + f],
                    2 => [x0 + s - f, y0 + s],
                    _ => [x0, y0 + s - f],
                });
            }
        }
        ring.push(ring[0]);
        Shape { polygons: vec![vec![ring]], ..Default::default() }
    }

    #[test]
    fn one_moved_vertex_expires_only_tiles_near_it() {
        let old = fine_square(0.3, 0.3, 0.01, 200);
        let mut new = old.clone();
        let v = old.polygons[0][0][100];
        new.polygons[0][0][100] = [v[0] + 1e-6, v[1] + 2e-6];
        let e = expire(&Change::Moved { old: &old, new: &new, properties_changed: false }, &rule(16));
        let z16: Vec<_> = e.tiles.iter().filter(|t| t.zoom == 16).collect();
        // The vertex's neighbours are 0.01 / 200 = 5e-5 world units away: about 3 tiles at zoom 16.
        let (vx, vy) = (v[0] * 65536.0, v[1] * 65536.0);
        assert!(!z16.is_empty() && z16.len() <= 16, "{}", z16.len());
        assert!(z16.iter().all(|t| (t.x as f64 - vx).abs() <= 5.0 && (t.y as f64 - vy).abs() <= 5.0));
        let whole = expire(&Change::Moved { old: &old, new: &new, properties_changed: true }, &rule(16));
        assert!(e.tiles.iter().all(|t| whole.tiles.binary_search(t).is_ok()));
        assert!(e.tiles.len() * 20 < whole.tiles.len(), "{} vs {}", e.tiles.len(), whole.tiles.len());
    }

    #[test]
    fn over_the_limit_falls_back_to_the_boundary_then_drops_zooms_with_a_record() {
        let big = square(0.1, 0.1, 0.5);
        let mut r = rule(12);
        r.max_tiles_geometry = 20_000;
        let e = expire(&Change::New(&big), &r);
        assert!(e.fell_back_to_boundary && e.dropped_from_zoom.is_none());
        r.max_tiles_geometry = 2_000;
        let e = expire(&Change::New(&big), &r);
        assert!(e.fell_back_to_boundary);
        let z = e.dropped_from_zoom.expect("zooms dropped");
        assert!(e.tiles.iter().all(|t| t.zoom < z) && e.tiles.len() <= 2_000);
    }

    #[test]
    fn limits_and_widths_out_of_range_are_refused() {
        let r = |limit: i64, l: Option<f64>| Rule::checked(0, 20, 0.1, if l.is_some() { "hybrid" } else { "full-area" }, l, true, limit);
        assert!(r(MAX_TILES_GEOMETRY, None).is_ok());
        assert!(r(MAX_TILES_GEOMETRY + 1, None).is_err() && r(i64::MAX, None).is_err() && r(0, None).is_err());
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            let e = r(100, Some(bad)).unwrap_err();
            assert!(e.message.contains("not a finite width"), "{}", e.message);
        }
        assert!(r(100, Some(0.0)).is_ok());
    }

    #[test]
    fn mode_names_are_osm2pgsqls() {
        assert_eq!(Mode::parse("full-area", None), Some(Mode::FullArea));
        assert_eq!(Mode::parse("boundary-only", None), Some(Mode::BoundaryOnly));
        assert_eq!(Mode::parse("hybrid", Some(20_000.0)), Some(Mode::Hybrid { full_area_limit_m: 20_000.0 }));
        assert_eq!(Mode::parse("hybrid", None), None);
        assert_eq!(Mode::parse("full_area", None), None);
    }

    #[test]
    fn a_box_across_the_antimeridian_wraps_instead_of_spanning_the_world() {
        let e = expire(&Change::New(&box_shape([179.0, -1.0, -179.0, 1.0])), &rule(3));
        let z3: Vec<_> = e.tiles.iter().filter(|t| t.zoom == 3).map(|t| t.x).collect();
        assert!(z3.iter().all(|&x| x == 0 || x == 7), "{z3:?}");
    }
}
