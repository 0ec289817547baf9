//! An expire output's cache destination: the expired tiles purged from an HTTP tile cache (Varnish
//! in front of Martin, pg_tileserv or tegola), once their edits committed. Two methods:
//! - `xkey`: Varnish's xkey vmod (Debian's varnish-modules). The cache tags each tile it stores
//!   with its URL's path (the VCL on the Tiles page), and one `PURGE` request with an `xkey-purge`
//!   header of space-separated paths purges every one of them, and nothing else: hundreds of tiles
//!   per request.
//! - `purge`: one `PURGE` request per tile URL, Varnish's built-in `return (purge)` and what most
//!   other caches accept; one request per tile.
//!
//! Failures follow the webhook sink's rules: no answer, 408, 429 and 5xx are the cache's (retried
//! after a backoff, at least Retry-After's seconds), another 4xx refuses the edits' tiles (counted
//! against them, parked after feature_outbox.max_attempts). Plain Rust: no Postgres calls.

use std::time::Duration;

use super::Tile;
use super::http_post::KeptAgent;

/// How an output purges its cache (expire_outputs.cache_method).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Xkey,
    Purge,
}

impl Method {
    pub fn parse(name: &str) -> Option<Method> {
        match name {
            "xkey" => Some(Method::Xkey),
            "purge" => Some(Method::Purge),
            _ => None,
        }
    }
}

/// The largest `xkey-purge` header value per request: under Varnish's default `http_req_hdr_len`
/// (8 KB) with room for the request line and the other headers.
pub const XKEY_HEADER_BYTES: usize = 7000;

/// Why a purge did not go through.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The cache is down, slow or overloaded: retry after a backoff, at least `retry_after`.
    Retry { error: String, retry_after: Option<Duration> },
    /// The cache refused the request (a 4xx other than 408 and 429): the edits' tiles count a failure.
    Refused(String),
}

/// `template` with `{z}`, `{x}` and `{y}` replaced by the tile's.
pub fn tile_url(template: &str, t: &Tile) -> String {
    template.replace("{z}", &t.zoom.to_string()).replace("{x}", &t.x.to_string()).replace("{y}", &t.y.to_string())
}

/// The template's origin (`scheme://host[:port]`) and its path template without the query: a
/// tile's xkey is its URL's path, as the VCL tags it.
pub fn split(template: &str) -> Result<(&str, &str), String> {
    let after_scheme = template.find("://").map(|i| i + 3).ok_or_else(|| format!("cache_url {template} has no scheme"))?;
    let path_at = template[after_scheme..].find('/').map(|i| i + after_scheme).ok_or_else(|| format!("cache_url {template} has no path"))?;
    let path = &template[path_at..];
    let path = path.split(['?', '#']).next().unwrap_or(path);
    Ok((&template[..path_at], path))
}

/// The `xkey-purge` header values for `tiles`: their paths by `path_template`, space-separated,
/// each value at most `max_bytes` (a path is never split).
pub fn xkey_values(path_template: &str, tiles: &[Tile], max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut value = String::new();
    for t in tiles {
        let key = tile_url(path_template, t);
        if !value.is_empty() && value.len() + 1 + key.len() > max_bytes {
            out.push(std::mem::take(&mut value));
        }
        if !value.is_empty() {
            value.push(' ');
        }
        value.push_str(&key);
    }
    if !value.is_empty() {
        out.push(value);
    }
    out
}

/// What an HTTP status means for a purge (the webhook sink's classes).
pub fn classify(status: u16, what: &str, retry_after: Option<Duration>, body: &str) -> Result<(), Failure> {
    let snippet: String = body.chars().take(200).collect();
    match status {
        200..=299 => Ok(()),
        300..=399 => Err(Failure::Retry { error: format!("{what}: HTTP {status}, a redirect (not followed)"), retry_after: None }),
        408 | 429 | 500..=599 => Err(Failure::Retry { error: format!("{what}: HTTP {status}: {snippet}"), retry_after }),
        _ => Err(Failure::Refused(format!("{what}: HTTP {status}: {snippet}"))),
    }
}

/// An output's cache purges, over the relay's kept-alive client (http_post.rs).
pub struct CachePurger(pub KeptAgent);

impl CachePurger {
    /// Purges `tiles` by `template` and `method`, with `Authorization: Bearer <secret>` when a
    /// secret is given (feature_outbox.cache_secret_file); returns the requests the cache
    /// acknowledged. Stops at the first request that fails.
    pub fn purge(&self, template: &str, method: Method, tiles: &[Tile], secret: Option<&str>) -> Result<i64, Failure> {
        let (origin, path) = split(template).map_err(Failure::Refused)?;
        let shown_origin = crate::settings::redact_urls(origin);
        let mut sent = 0;
        match method {
            Method::Xkey => {
                let url = format!("{origin}/");
                for value in xkey_values(path, tiles, XKEY_HEADER_BYTES) {
                    self.request(&url, &format!("PURGE {shown_origin}/ (xkey)"), Some(&value), secret)?;
                    sent += 1;
                }
            }
            Method::Purge => {
                for t in tiles {
                    let url = tile_url(template, t);
                    let shown = crate::settings::redact_urls(&url);
                    self.request(&url, &format!("PURGE {shown}"), None, secret)?;
                    sent += 1;
                }
            }
        }
        Ok(sent)
    }

    fn request(&self, url: &str, what: &str, xkey: Option<&str>, secret: Option<&str>) -> Result<(), Failure> {
        let request = ureq::http::Request::builder().method("PURGE").uri(url);
        let request = match xkey {
            Some(keys) => request.header("xkey-purge", keys),
            None => request,
        };
        let request = match secret {
            Some(s) => request.header("Authorization", format!("Bearer {s}")),
            None => request,
        };
        let request = request.body(()).map_err(|e| Failure::Refused(format!("{what}: {e}")))?;
        let mut response = self.0.agent.run(request).map_err(|e| Failure::Retry { error: format!("{what}: {e}"), retry_after: None })?;
        let retry_after = crate::sinks::http::retry_after(response.headers());
        // Read to the end, so the connection is kept for the next request.
        let body = response.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
        classify(response.status().as_u16(), what, retry_after, &body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_keys_come_from_the_template() {
        let t = Tile { zoom: 14, x: 4823, y: 6160 };
        assert_eq!(tile_url("http://c:6081/parcels/{z}/{x}/{y}.pbf", &t), "http://c:6081/parcels/14/4823/6160.pbf");
        assert_eq!(split("http://c:6081/parcels/{z}/{x}/{y}?v=2").unwrap(), ("http://c:6081", "/parcels/{z}/{x}/{y}"));
        assert_eq!(split("https://u:p@tiles.example.org/a/{z}/{x}/{y}").unwrap().0, "https://u:p@tiles.example.org");
        assert!(split("http://c:6081").is_err());
    }

    #[test]
    fn xkey_values_hold_every_path_once_under_the_limit() {
        let tiles: Vec<Tile> = (0..500).map(|i| Tile { zoom: 14, x: 4000 + i, y: 6000 }).collect();
        let values = xkey_values("/parcels/{z}/{x}/{y}", &tiles, 1000);
        assert!(values.len() > 1 && values.iter().all(|v| v.len() <= 1000));
        let keys: Vec<&str> = values.iter().flat_map(|v| v.split(' ')).collect();
        assert_eq!(keys.len(), 500);
        assert_eq!(keys[0], "/parcels/14/4000/6000");
        assert_eq!(keys[499], "/parcels/14/4499/6000");
    }

    #[test]
    fn statuses_follow_the_webhook_rules() {
        assert_eq!(classify(200, "PURGE", None, ""), Ok(()));
        let ra = Some(Duration::from_secs(3));
        assert!(matches!(classify(503, "PURGE", ra, "busy"), Err(Failure::Retry { retry_after, .. }) if retry_after == ra));
        assert!(matches!(classify(429, "PURGE", None, ""), Err(Failure::Retry { .. })));
        assert!(matches!(classify(408, "PURGE", None, ""), Err(Failure::Retry { .. })));
        assert!(matches!(classify(301, "PURGE", None, ""), Err(Failure::Retry { .. })));
        assert!(matches!(classify(403, "PURGE", None, "Forbidden"), Err(Failure::Refused(e)) if e.contains("403")));
        assert!(matches!(classify(405, "PURGE", None, ""), Err(Failure::Refused(_))));
    }
}
