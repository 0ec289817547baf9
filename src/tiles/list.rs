//! Tile lists as osm2pgsql's expire file writes them: one `z/x/y` a line, each ending in a newline,
//! read by `render_expired` (mod_tile), `tegola cache purge tile-list` and `tilekiln`.

use super::Tile;

/// The lines of `tiles`, split into bodies of at most `max_bytes` each (a NATS server's
/// `max_payload`, an HTTP body limit); a line is never split.
pub fn bodies(tiles: &[Tile], max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut body = String::new();
    // One line buffer for all, numbers by itoa: a String per line was most of a 50,000-tile list's
    // cost.
    let mut line = String::with_capacity(24);
    let mut number = itoa::Buffer::new();
    for t in tiles {
        line.clear();
        line.push_str(number.format(t.zoom));
        line.push('/');
        line.push_str(number.format(t.x));
        line.push('/');
        line.push_str(number.format(t.y));
        line.push('\n');
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
        let edge = [Tile { zoom: 0, x: 0, y: 0 }, Tile { zoom: 20, x: 1_048_575, y: 10 }];
        assert_eq!(bodies(&edge, 1000), vec!["0/0/0\n20/1048575/10\n".to_string()]);
    }
}
