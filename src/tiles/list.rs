//! Tile lists as osm2pgsql's expire file writes them: one `z/x/y` a line, each ending in a newline,
//! read by `render_expired` (mod_tile), `tegola cache purge tile-list` and `tilekiln`.

use super::Tile;

/// The lines of `tiles`, split into bodies of at most `max_bytes` each (a NATS server's
/// `max_payload`, an HTTP body limit); a line is never split.
pub fn bodies(tiles: &[Tile], max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut body = String::new();
    for t in tiles {
        let line = format!("{}/{}/{}\n", t.zoom, t.x, t.y);
        if !body.is_empty() && body.len() + line.len() > max_bytes {
            out.push(std::mem::take(&mut body));
        }
        body.push_str(&line);
    }
    if !body.is_empty() {
        out.push(body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_z_x_y_and_bodies_stay_under_the_limit() {
        let tiles: Vec<Tile> = (0..100).map(|i| Tile { zoom: 14, x: 8000 + i, y: 5000 }).collect();
        let b = bodies(&tiles, 100);
        assert!(b.iter().all(|s| s.len() <= 100 && s.ends_with('\n')));
        assert_eq!(b.concat().lines().count(), 100);
        assert_eq!(b[0].lines().next(), Some("14/8000/5000"));
    }
}
