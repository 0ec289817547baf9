//! Where the relay publishes: NATS JetStream or an HTTP webhook, chosen by the endpoint's scheme.
//! Sinks are plain Rust (no Postgres calls): the worker reads settings and hands them over.

use std::time::Duration;

use crate::event::Row;

pub mod http;
pub mod nats;

/// Settings a sink needs, read from the GUCs on the worker's main thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SinkConfig {
    pub endpoint: String,
    pub publish_timeout: Duration,
    pub tls_ca_file: Option<String>,
    /// feature_outbox.nats_credentials_file: a .creds file (user JWT + NKey seed).
    pub nats_credentials_file: Option<String>,
    /// feature_outbox.nats_nkey_file: a file holding a user NKey seed.
    pub nats_nkey_file: Option<String>,
    pub http_secret: Option<String>,
    /// feature_outbox.http_secret_file: read at connect, used instead of http_secret.
    pub http_secret_file: Option<String>,
    pub subject_prefix: String,
    /// feature_outbox.subject_format = '0.1': the built-in layer keeps its 0.1.0 subjects.
    pub legacy_subjects: bool,
    /// feature_outbox.subject_resolutions: the parent cells each subject carries.
    pub subject_resolutions: Vec<u8>,
    pub stream: String,
    pub duplicate_window: Duration,
    pub replicas: usize,
    /// JetStream stream and object bucket max_age; zero keeps messages forever.
    pub max_age: Duration,
    pub object_bucket: String,
    pub http_max_body: usize,
    /// feature_outbox.envelope.
    pub envelope: crate::settings::Envelope,
    /// The database whose outbox the worker relays (CloudEvents `source`).
    pub database: String,
    /// feature_outbox.http_concurrency: requests in flight per worker.
    pub http_concurrency: usize,
    /// feature_outbox.http_batch: events per request.
    pub http_batch: usize,
}

/// What happened to one row of a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Acknowledged by the sink (for JetStream, `duplicate` is true when the PubAck said so).
    Delivered { duplicate: bool },
    /// This row failed on its own (a 4xx, a bad subject): retried per row, parked after max_attempts.
    RowFailed(String),
    /// No retry can deliver this row under the current settings (over feature_outbox.http_max_body):
    /// parked at once; retry_parked() after the setting changed.
    Undeliverable(String),
    /// The sink is down or overloaded; retry everything later, parking nothing.
    SinkFailed { error: String, retry_after: Option<Duration> },
    /// Not sent because the sink failed earlier in the batch.
    NotTried,
}

pub enum Sink {
    Nats(nats::NatsSink),
    Http(http::HttpSink),
    /// Test and benchmark builds only (`discard://`): acknowledges every event without sending it,
    /// so `make bench` can measure the worker's own claim and mark (the in-worker floor).
    #[cfg(feature = "fault-injection")]
    Discard,
}

impl SinkConfig {
    /// The endpoint's scheme, lowercased: `nats`, `tls`, `http`, `https` (or what the user wrote).
    pub fn scheme(&self) -> String {
        self.endpoint.split("://").next().unwrap_or("").to_ascii_lowercase()
    }
}

impl Sink {
    /// Connects to the endpoint. An error is sink-level (transient): the caller backs off.
    pub fn connect(config: &SinkConfig, client_name: &str) -> Result<Sink, String> {
        match config.scheme().as_str() {
            "nats" | "tls" => nats::NatsSink::connect(config, client_name).map(Sink::Nats),
            "http" | "https" => http::HttpSink::new(config).map(Sink::Http),
            #[cfg(feature = "fault-injection")]
            "discard" => Ok(Sink::Discard),
            _ => Err(format!(
                "feature_outbox.endpoint \"{}\" must start with nats://, tls://, http:// or https://",
                config.endpoint
            )),
        }
    }

    /// Publishes one claimed batch; `bodies[i]` is the event JSON of `rows[i]`, relayed at
    /// `relayed_at` (for an event rebuilt with its geometry by reference). One outcome per row.
    pub fn publish(&mut self, rows: &[Row], bodies: &[&[u8]], relayed_at: &str) -> Vec<Outcome> {
        match self {
            Sink::Nats(s) => s.publish(rows, bodies, relayed_at),
            Sink::Http(s) => s.publish(rows, bodies),
            #[cfg(feature = "fault-injection")]
            Sink::Discard => rows.iter().map(|_| Outcome::Delivered { duplicate: false }).collect(),
        }
    }
}
