//! An expire output's HTTP destination: each tile list POSTed as `text/plain` (osm2pgsql's `z/x/y`
//! lines), with the relay's TLS settings. A 2xx takes the list; anything else, or no answer within
//! the publish timeout, fails the whole delivery, which is tried again later (the lists' rows stay
//! queued). Plain Rust: no Postgres calls.

use std::time::Duration;

use ureq::Agent;

/// One kept-alive HTTP client for the tile lists, made again when its settings change.
pub struct ListPoster {
    agent: Agent,
    settings: (Duration, Option<String>),
}

impl ListPoster {
    /// The poster for `timeout` and `ca_file` (feature_outbox.tls_ca_file), reusing `kept` when it
    /// was made for the same.
    pub fn for_settings(kept: Option<ListPoster>, timeout: Duration, ca_file: Option<&str>) -> Result<ListPoster, String> {
        let settings = (timeout, ca_file.map(str::to_string));
        if let Some(p) = kept.filter(|p| p.settings == settings) {
            return Ok(p);
        }
        let config = Agent::config_builder()
            .timeout_global(Some(timeout))
            .max_redirects(0)
            .http_status_as_error(false)
            .tls_config(crate::sinks::http::tls_config(ca_file)?)
            .user_agent("feature_outbox relay")
            .build();
        Ok(ListPoster { agent: config.into(), settings })
    }

    /// POSTs `bodies` to `url` in order, each with `headers` and `Idempotency-Key: <key>/<n>` (the
    /// same key when a delivery is repeated after a crash, so a receiver can drop the copy).
    pub fn post(&self, url: &str, bodies: &[String], key: &str, headers: &[(&str, String)]) -> Result<(), String> {
        let shown = crate::settings::redact_urls(url.split('?').next().unwrap_or_default());
        for (n, body) in bodies.iter().enumerate() {
            let mut request =
                self.agent.post(url).header("Content-Type", "text/plain; charset=utf-8").header("Idempotency-Key", format!("{key}/{n}"));
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
