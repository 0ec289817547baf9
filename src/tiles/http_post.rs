//! An expire output's HTTP destination: each tile list POSTed as `text/plain` (osm2pgsql's `z/x/y`
//! lines), with the relay's TLS settings. A 2xx takes the list; anything else, or no answer within
//! the publish timeout, fails the whole delivery, which is tried again later (the lists' rows stay
//! queued). Plain Rust: no Postgres calls.

use std::time::Duration;

use ureq::Agent;

/// A kept-alive HTTP client with the relay's timeout and TLS settings, made again when they change:
/// the tile lists' and the caches' (cache_purge.rs).
pub struct KeptAgent {
    pub agent: Agent,
    settings: (Duration, Option<String>),
}

impl KeptAgent {
    /// The client for `timeout` and `ca_file` (feature_outbox.tls_ca_file), reusing `kept` when it
    /// was made for the same. It sends any method (a cache's PURGE) and follows no redirect.
    pub fn for_settings(kept: Option<KeptAgent>, timeout: Duration, ca_file: Option<&str>) -> Result<KeptAgent, String> {
        let settings = (timeout, ca_file.map(str::to_string));
        if let Some(k) = kept.filter(|k| k.settings == settings) {
            return Ok(k);
        }
        let config = Agent::config_builder()
            .timeout_global(Some(timeout))
            .max_redirects(0)
            .http_status_as_error(false)
            .allow_non_standard_methods(true)
            .tls_config(crate::sinks::http::tls_config(ca_file)?)
            .user_agent("feature_outbox relay")
            .build();
        Ok(KeptAgent { agent: config.into(), settings })
    }
}

/// The tile lists' HTTP client.
pub struct ListPoster(pub KeptAgent);

impl ListPoster {
    /// POSTs `bodies` to `url` in order, each with `headers` and `Idempotency-Key: <key>/<n>` (the
    /// same key when a delivery is repeated after a crash, so a receiver can drop the copy).
    pub fn post(&self, url: &str, bodies: &[String], key: &str, headers: &[(&str, String)]) -> Result<(), String> {
        let shown = crate::settings::redact_urls(url.split('?').next().unwrap_or_default());
        for (n, body) in bodies.iter().enumerate() {
            let mut request =
                self.0.agent.post(url).header("Content-Type", "text/plain; charset=utf-8").header("Idempotency-Key", format!("{key}/{n}"));
            for (name, value) in headers {
                request = request.header(*name, value.as_str());
            }
            let mut response = request.send(body.as_bytes()).map_err(|e| format!("POST {shown}: {e}"))?;
            // Read to the end, so the connection is kept for the next list.
            let _ = response.body_mut().read_to_vec();
            let status = response.status().as_u16();
            if !(200..300).contains(&status) {
                return Err(format!("POST {shown}: HTTP {status}"));
            }
        }
        Ok(())
    }
}
