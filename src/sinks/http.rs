//! HTTP webhook sink (ureq, rustls): one POST per event on a keep-alive connection, with the
//! Standard Webhooks headers. Only 2xx counts as delivered; redirects are never followed.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ureq::Agent;
use ureq::tls::{RootCerts, TlsConfig};

use super::{Outcome, SinkConfig};
use crate::cloudevents::{self, Binding, Message};
use crate::event::{Row, webhook_signature};
use crate::settings::Envelope;

pub struct HttpSink {
    agent: Agent,
    url: String,
    /// The URL without credentials or query string, for error messages (they reach views and logs).
    shown_url: String,
    secret: Option<String>,
    timeout: Duration,
    max_body: usize,
    envelope: Envelope,
    database: String,
    prefix: String,
}

impl HttpSink {
    pub fn new(config: &SinkConfig) -> Result<HttpSink, String> {
        let mut tls = TlsConfig::builder();
        if let Some(path) = &config.tls_ca_file {
            let pem = std::fs::read(path).map_err(|e| format!("cannot read feature_outbox.tls_ca_file {path}: {e}"))?;
            let certs = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect::<Vec<_>>();
            if certs.is_empty() {
                return Err(format!("feature_outbox.tls_ca_file {path} holds no PEM certificate"));
            }
            tls = tls.root_certs(RootCerts::new_with_certs(&certs));
        }
        let agent: Agent = Agent::config_builder()
            .timeout_global(Some(config.publish_timeout))
            .max_redirects(0)
            .max_redirects_will_error(false)
            .http_status_as_error(false)
            .tls_config(tls.build())
            .user_agent("feature_outbox relay")
            .build()
            .into();
        let shown_url = crate::settings::redact_urls(config.endpoint.split('?').next().unwrap_or_default());
        Ok(HttpSink { agent, url: config.endpoint.clone(), shown_url, secret: config.http_secret.clone(), timeout: config.publish_timeout, max_body: config.http_max_body, envelope: config.envelope, database: config.database.clone(), prefix: config.subject_prefix.clone() })
    }

    /// POSTs the batch in order, stopping at the first sink-level failure. No request starts after
    /// one publish_timeout has passed, so the claiming transaction stays short even with a slow
    /// receiver; the rows not tried are claimed again by the next batch.
    pub fn publish(&mut self, rows: &[Row], bodies: &[Vec<u8>]) -> Vec<Outcome> {
        let deadline = Instant::now() + self.timeout;
        let mut outcomes = Vec::with_capacity(rows.len());
        for (row, body) in rows.iter().zip(bodies) {
            let stop = outcomes.iter().any(|o| matches!(o, Outcome::SinkFailed { .. }));
            let outcome = if stop || Instant::now() > deadline {
                Outcome::NotTried
            } else if body.len() > self.max_body {
                Outcome::Undeliverable(format!(
                    "event of {} bytes exceeds feature_outbox.http_max_body ({} bytes)",
                    body.len(),
                    self.max_body
                ))
            } else {
                self.post(row, body)
            };
            outcomes.push(outcome);
        }
        outcomes
    }

    fn post(&self, row: &Row, body: &[u8]) -> Outcome {
        let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let mut request = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json")
            .header("webhook-id", &row.event_id)
            .header("Idempotency-Key", &row.event_id)
            .header("webhook-timestamp", timestamp.to_string());
        for (name, value) in cloudevents::headers(self.envelope, Binding::Http, &self.database, &self.prefix, row, Message::Event) {
            request = request.header(name, value);
        }
        if let Some(secret) = &self.secret {
            match webhook_signature(secret, &row.event_id, timestamp, body) {
                Ok(sig) => request = request.header("webhook-signature", sig),
                Err(e) => return Outcome::SinkFailed { error: e, retry_after: None },
            }
        }
        match request.send(body) {
            Err(e) => Outcome::SinkFailed { error: format!("POST {}: {e}", self.shown_url), retry_after: None },
            Ok(mut response) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                let location = response.headers().get("location").and_then(|v| v.to_str().ok()).map(str::to_owned);
                // Read the body so the connection can be reused; keep a little of it for last_error.
                let text = response.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
                let snippet: String = text.chars().take(200).collect();
                match status {
                    200..=299 => Outcome::Delivered { duplicate: false },
                    300..=399 => Outcome::SinkFailed {
                        error: format!(
                            "HTTP {status} redirect to {} not followed; point feature_outbox.endpoint at the final URL",
                            location.as_deref().unwrap_or("?")
                        ),
                        retry_after: None,
                    },
                    408 | 429 | 500..=599 => Outcome::SinkFailed { error: format!("HTTP {status}: {snippet}"), retry_after },
                    _ => Outcome::RowFailed(format!("HTTP {status}: {snippet}")),
                }
            }
        }
    }
}
