//! An expire output's HTTP destination: each tile list POSTed as `text/plain` (osm2pgsql's `z/x/y`
//! lines), with the relay's TLS settings. A 2xx takes the list; anything else, or no answer within
//! the publish timeout, fails the whole delivery, which is tried again later (the lists' rows stay
//! queued). Plain Rust: no Postgres calls.

use std::time::Duration;

use ureq::Agent;

/// POSTs `bodies` to `url` in order, each with `headers` and `Idempotency-Key: <key>/<n>` (the same
/// key when a delivery is repeated after a crash, so a receiver can drop the copy).
pub fn post_lists(url: &str, bodies: &[String], key: &str, headers: &[(&str, String)], timeout: Duration, ca_file: Option<&str>) -> Result<(), String> {
    let config = Agent::config_builder()
        .timeout_global(Some(timeout))
        .max_redirects(0)
        .http_status_as_error(false)
        .tls_config(crate::sinks::http::tls_config(ca_file)?)
        .user_agent("feature_outbox relay")
        .build();
    let agent: Agent = config.into();
    let shown = crate::settings::redact_urls(url.split('?').next().unwrap_or_default());
    for (n, body) in bodies.iter().enumerate() {
        let mut request = agent.post(url).header("Content-Type", "text/plain; charset=utf-8").header("Idempotency-Key", format!("{key}/{n}"));
        for (name, value) in headers {
            request = request.header(*name, value.as_str());
        }
        let response = request.send(body.as_bytes()).map_err(|e| format!("POST {shown}: {e}"))?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(format!("POST {shown}: HTTP {status}"));
        }
    }
    Ok(())
}
