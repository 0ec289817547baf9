//! Tile lists as osm2pgsql's expire file writes them: one `z/x/y` a line, each ending in a newline,
//! read by `render_expired` (mod_tile), `tegola cache purge tile-list` and `tilekiln`.

use super::Tile;

/// The lines of `tiles`, split into bodies of at most `max_bytes` each (a NATS server's
/// `max_payload`, an HTTP body limit); a line is never split.
pub fn bodies(tiles: &[Tile], max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut body = String::new();
    // One line buffer for all: a String per line was most of a 50,000-tile list's cost.
    let mut line = String::with_capacity(24);
    for t in tiles {
        line.clear();
        push_number(&mut line, t.zoom as u32);
        line.push('/');
        push_number(&mut line, t.x);
        line.push('/');
        push_number(&mut line, t.y);
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

/// `n` in decimal, without the formatting machinery.
fn push_number(s: &mut String, mut n: u32) {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    s.extend(digits[i..].iter().map(|&d| d as char));
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
