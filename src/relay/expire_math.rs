//! The tile math of one chunk of queued edits: their shapes into one sorted set of tiles, with the
//! figures and log lines of the limits. Pure Rust, no Postgres: the relay runs it on a thread of
//! its own while its main thread relays events (src/relay/expire.rs), so nothing here may log or
//! touch SPI; what needs saying comes back as `notes`.

use crate::tiles::{self, Change, Expired, Mode, Rule, Tile, shape};

/// A chunk stops taking edits once it holds this many tiles (12 bytes each): the edits after stay
/// queued for the next chunk, so full covers of large shapes never hold gigabytes.
pub const CHUNK_TILES: usize = 2_000_000;

/// An expire output's zooms and limit, as the math needs them.
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Zooms {
    pub minzoom: i32,
    pub maxzoom: i32,
    pub max_tiles_geometry: i64,
}

/// One queued edit with the rule of its layer for this output.
pub struct Queued {
    pub outbox_id: i64,
    pub event_type: String,
    pub old: Option<Vec<u8>>,
    pub new: Option<Vec<u8>>,
    pub previous_bbox: Option<Vec<f64>>,
    pub properties_changed: bool,
    pub mode: String,
    pub buffer: f64,
    pub full_area_limit: Option<f64>,
    pub diff: bool,
}

/// What one chunk expired, for expire_progress and the log.
#[derive(Default, Debug)]
pub struct Figures {
    pub by_zoom: [i64; tiles::MAX_ZOOM as usize + 1],
    pub edits: i64,
    pub boundary_fallbacks: i64,
    pub dropped_zooms: i64,
    pub box_fallbacks: i64,
}

/// A chunk's tiles: sorted, without duplicates; `taken` edits of the chunk's rows gave them.
#[derive(Default, Debug)]
pub struct Computed {
    pub tiles: Vec<Tile>,
    pub taken: usize,
    pub figures: Figures,
    /// Lines for the server log (a fallback, an unreadable shape), written by the main thread.
    pub notes: Vec<String>,
}

/// The tiles of `rows` in order, until their tiles pass CHUNK_TILES (the first edit always goes,
/// so that the queue moves). `output` names the output in the notes.
pub fn compute(rows: &[Queued], zooms: Zooms, output: &str) -> Computed {
    let mut c = Computed::default();
    for row in rows {
        if c.tiles.len() >= CHUNK_TILES {
            tiles::sort_dedup(&mut c.tiles);
            if c.tiles.len() >= CHUNK_TILES / 2 {
                break;
            }
        }
        c.taken += 1;
        let (expired, boxed) = expire_row(row, zooms);
        if expired.fell_back_to_boundary {
            c.figures.boundary_fallbacks += 1;
            c.notes.push(format!(
                "expire output {output}: outbox row {} is over max_tiles_geometry ({}): only its boundary's tiles{}",
                row.outbox_id,
                zooms.max_tiles_geometry,
                expired.dropped_from_zoom.map(|z| format!(", and none from zoom {z} up")).unwrap_or_default()
            ));
        }
        if expired.overlay_failed {
            c.notes.push(format!(
                "expire output {output}: outbox row {}: the difference of its old and new shape failed; both shapes' tiles instead",
                row.outbox_id
            ));
        }
        if expired.tiles.is_empty() && boxed {
            c.notes.push(format!("expire output {output}: outbox row {} has no shape and no box: it expires no tile", row.outbox_id));
        } else if boxed && row.event_type == "moved" && row.old.is_none() && row.previous_bbox.is_none() {
            c.notes.push(format!(
                "expire output {output}: outbox row {} moves a feature whose old shape and box were never recorded: only its new shape's tiles",
                row.outbox_id
            ));
        }
        c.figures.dropped_zooms += expired.dropped_from_zoom.is_some() as i64;
        c.figures.box_fallbacks += boxed as i64;
        c.tiles.extend(expired.tiles);
    }
    tiles::sort_dedup(&mut c.tiles);
    for t in &c.tiles {
        c.figures.by_zoom[t.zoom as usize] += 1;
    }
    c.figures.edits = c.taken as i64;
    c
}

/// The tiles of one queued edit, and whether a box stood in for a shape that was never kept.
fn expire_row(row: &Queued, zooms: Zooms) -> (Expired, bool) {
    let rule = Rule {
        minzoom: zooms.minzoom.clamp(0, tiles::MAX_ZOOM as i32) as u8,
        maxzoom: zooms.maxzoom.clamp(0, tiles::MAX_ZOOM as i32) as u8,
        buffer: row.buffer,
        mode: Mode::parse(&row.mode, row.full_area_limit).unwrap_or(Mode::FullArea),
        diff: row.diff,
        max_tiles_geometry: zooms.max_tiles_geometry.clamp(1, tiles::MAX_TILES_GEOMETRY) as usize,
    };
    // A stored shape that does not read is treated as one never kept: its box stands in.
    let read = |w: &Option<Vec<u8>>| w.as_deref().and_then(|b| shape::from_wkb(b).ok());
    let (old, new) = (read(&row.old), read(&row.new));
    let boxed = row.previous_bbox.as_deref().and_then(|b| <[f64; 4]>::try_from(b).ok()).map(tiles::box_shape);
    let (change, used_box) = match (row.event_type.as_str(), &old, &new, &boxed) {
        ("retired", Some(o), _, _) => (Some(Change::Old(o)), false),
        ("retired", None, _, Some(b)) => (Some(Change::Old(b)), true),
        ("moved", Some(o), Some(n), _) => (Some(Change::Moved { old: o, new: n, properties_changed: row.properties_changed }), false),
        // The old side never kept (written before the layer had an output, or before 0.4.0): its box.
        ("moved", None, Some(n), Some(b)) => (Some(Change::Moved { old: b, new: n, properties_changed: true }), true),
        // Neither the old shape nor its box (a feature the extension never saw before this move):
        // the new shape alone, counted as a fallback so that it is never silent.
        ("moved", None, Some(n), None) => (Some(Change::New(n)), true),
        (_, _, Some(n), _) => (Some(Change::New(n)), false),
        (_, Some(o), None, _) => (Some(Change::New(o)), false),
        (_, None, None, Some(b)) => (Some(Change::New(b)), true),
        _ => (None, true),
    };
    (change.map(|c| tiles::expire(&c, &rule)).unwrap_or_default(), used_box)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(id: i64, lon: f64, lat: f64) -> Queued {
        let mut wkb = vec![1u8, 1, 0, 0, 0];
        wkb.extend(lon.to_le_bytes());
        wkb.extend(lat.to_le_bytes());
        Queued {
            outbox_id: id,
            event_type: "created".into(),
            old: None,
            new: Some(wkb),
            previous_bbox: None,
            properties_changed: false,
            mode: "full-area".into(),
            buffer: 0.0,
            full_area_limit: None,
            diff: true,
        }
    }

    #[test]
    fn a_chunk_merges_its_edits_tiles_and_counts_them_by_zoom() {
        let zooms = Zooms { minzoom: 0, maxzoom: 3, max_tiles_geometry: 100 };
        let rows = [point(1, 10.0, 10.0), point(2, 10.1, 10.1), point(3, -100.0, -10.0)];
        let c = compute(&rows, zooms, "t");
        assert_eq!(c.taken, 3);
        // Zoom 0 once for all three; the two near points share their tile at every zoom.
        assert_eq!(c.figures.by_zoom[..4], [1, 2, 2, 2]);
        assert!(c.tiles.windows(2).all(|w| w[0] < w[1]));
        assert!(c.notes.is_empty());
    }

    #[test]
    fn a_move_without_old_shape_or_box_expires_the_new_shape_and_counts_it() {
        let mut row = point(9, 10.0, 10.0);
        row.event_type = "moved".into();
        let c = compute(&[row], Zooms { minzoom: 0, maxzoom: 2, max_tiles_geometry: 100 }, "t");
        assert_eq!(c.tiles.len(), 3);
        assert_eq!(c.figures.box_fallbacks, 1);
        assert!(c.notes[0].contains("outbox row 9 moves a feature whose old shape and box were never recorded"), "{:?}", c.notes);
    }

    #[test]
    fn an_edit_without_shape_or_box_says_so() {
        let mut row = point(7, 0.0, 0.0);
        row.new = None;
        let c = compute(&[row], Zooms { minzoom: 0, maxzoom: 2, max_tiles_geometry: 100 }, "t");
        assert!(c.tiles.is_empty() && c.figures.box_fallbacks == 1);
        assert!(c.notes[0].contains("outbox row 7 has no shape and no box"), "{:?}", c.notes);
    }
}
