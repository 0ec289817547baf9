//! Where the relay publishes: NATS JetStream, Kafka or an HTTP webhook, chosen by the endpoint's
//! scheme. Sinks are plain Rust (no Postgres calls): the worker reads settings and hands them over,
//! and knows a sink only through the `Sink` trait. A broker that hangs with its connection open
//! (stopped, or behind a proxy that accepts TCP and forwards nothing) is seen by a request with a
//! deadline: `Sink::health` on the connection in use, `answers` on a fresh one.

use std::time::Duration;

use crate::event::Row;

#[cfg(feature = "fault-injection")]
mod discard;
pub mod http;
pub mod kafka;
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
    /// The database whose outbox the worker relays: its name and identity (event body, headers,
    /// CloudEvents `source`).
    pub source: crate::event::Source,
    /// feature_outbox.http_concurrency: requests in flight per worker.
    pub http_concurrency: usize,
    /// feature_outbox.http_batch: events per request.
    pub http_batch: usize,
    /// feature_outbox.kafka_topic: one topic for every layer; None: a topic per layer.
    pub kafka_topic: Option<String>,
    /// feature_outbox.kafka_partitions and kafka_replication_factor, for topics the relay creates.
    pub kafka_partitions: i32,
    pub kafka_replication_factor: i32,
    /// feature_outbox.kafka_security_protocol, kafka_sasl_mechanism, kafka_sasl_username and
    /// kafka_sasl_password_file (the file is read at connect).
    pub kafka_security: crate::settings::KafkaSecurity,
    pub kafka_sasl_mechanism: crate::settings::KafkaSaslMechanism,
    pub kafka_sasl_username: Option<String>,
    pub kafka_sasl_password_file: Option<String>,
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

/// Where a relay worker sends its batches. A new sink is a new file in this directory and one line
/// in `connect`; the worker's loop never names one.
pub trait Sink {
    /// Sends one batch; `bodies[i]` is the event JSON of `rows[i]`, relayed at `relayed_at` (for an
    /// event rebuilt with its geometry by reference). Calls `meanwhile` exactly once, on this thread,
    /// while the batch is in flight: the worker claims and encodes its next batch then. Returns one
    /// outcome per row, in order.
    fn send(&mut self, rows: &[Row], bodies: &[&[u8]], relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome>;

    /// Starts sending rows before the batch before them is marked and committed, so the sink takes
    /// them in meanwhile; their outcomes come from the returned InFlight. None (the default): this
    /// sink does not send ahead, and the rows go out with `send` in their own transaction.
    fn send_ahead(&mut self, _rows: &[Row], _bodies: &[&[u8]], _relayed_at: &str) -> Option<InFlight> {
        None
    }

    /// Whether the sink is still usable while no batch goes through it, looked at by an idle worker
    /// each poll interval (sink health in metrics()): a request on the connection in use, answered
    /// within `deadline`, so that a server that hangs with the connection open counts as down.
    /// Ok(()) when it is usable; Err(why) when it is not, and the worker treats that as a sink
    /// failure (drops it, backs off, reconnects). None (the default): this sink cannot tell without
    /// a request (HTTP), so what the last request showed stands.
    fn health(&self, _deadline: Duration) -> Option<Result<(), String>> {
        None
    }

    /// Publishes an expire output's tile lists (osm2pgsql's `z/x/y` lines, src/tiles/list.rs) on
    /// `subject`, into the JetStream stream `stream` (created for that subject when missing, apart
    /// from the events' stream), each with `Nats-Msg-Id` `<msg_id>/<n>` and `headers`, and waits for
    /// every PubAck. None (the default): this sink cannot carry tile lists.
    fn publish_tile_lists(&mut self, _stream: &str, _subject: &str, _bodies: &[String], _msg_id: &str, _headers: &[(&str, String)]) -> Option<Result<(), String>> {
        None
    }

    /// The largest message this sink's server takes, in bytes, for splitting tile lists.
    fn max_message_bytes(&self) -> Option<usize> {
        None
    }

    /// Something about the destination the worker logs once after connecting (a JetStream stream
    /// found with other limits than the settings ask for).
    fn notice(&self) -> Option<String> {
        None
    }
}

/// The outcomes of rows a sink sent ahead, still to come.
pub struct InFlight(Box<dyn FnOnce() -> Vec<Outcome>>);

impl InFlight {
    pub fn new(outcomes: impl FnOnce() -> Vec<Outcome> + 'static) -> InFlight {
        InFlight(Box::new(outcomes))
    }

    /// Waits for them (each sink bounds the wait by its publish timeout).
    pub fn outcomes(self) -> Vec<Outcome> {
        (self.0)()
    }
}

impl SinkConfig {
    /// The settings in effect, read from the GUCs (on the worker's main thread: a GUC read
    /// elsewhere panics), for the worker relaying `source`'s outbox.
    pub fn from_settings(source: crate::event::Source) -> SinkConfig {
        use crate::settings;
        let optional = |s: String| (!s.is_empty()).then_some(s);
        SinkConfig {
            endpoint: settings::string(&settings::ENDPOINT),
            publish_timeout: settings::millis(&settings::PUBLISH_TIMEOUT_MS),
            tls_ca_file: optional(settings::string(&settings::TLS_CA_FILE)),
            nats_credentials_file: optional(settings::string(&settings::NATS_CREDENTIALS_FILE)),
            nats_nkey_file: optional(settings::string(&settings::NATS_NKEY_FILE)),
            http_secret: optional(settings::string(&settings::HTTP_SECRET)),
            http_secret_file: optional(settings::string(&settings::HTTP_SECRET_FILE)),
            subject_prefix: settings::string(&settings::NATS_SUBJECT_PREFIX),
            legacy_subjects: settings::SUBJECT_FORMAT.get() == settings::SubjectFormat::Legacy,
            subject_resolutions: settings::subject_resolutions(),
            stream: settings::string(&settings::NATS_STREAM),
            duplicate_window: Duration::from_secs(settings::NATS_DUPLICATE_WINDOW_S.get() as u64),
            replicas: settings::NATS_REPLICAS.get() as usize,
            max_age: Duration::from_secs(settings::NATS_MAX_AGE_S.get().max(0) as u64),
            object_bucket: settings::string(&settings::NATS_OBJECT_BUCKET),
            http_max_body: settings::HTTP_MAX_BODY_KB.get().max(1) as usize * 1024,
            envelope: settings::ENVELOPE.get(),
            source,
            http_concurrency: settings::HTTP_CONCURRENCY.get().max(1) as usize,
            http_batch: settings::HTTP_BATCH.get().max(1) as usize,
            kafka_topic: optional(settings::string(&settings::KAFKA_TOPIC)),
            kafka_partitions: settings::KAFKA_PARTITIONS.get().max(1),
            kafka_replication_factor: settings::KAFKA_REPLICATION_FACTOR.get(),
            kafka_security: settings::KAFKA_SECURITY_PROTOCOL.get(),
            kafka_sasl_mechanism: settings::KAFKA_SASL_MECHANISM.get(),
            kafka_sasl_username: optional(settings::string(&settings::KAFKA_SASL_USERNAME)),
            kafka_sasl_password_file: optional(settings::string(&settings::KAFKA_SASL_PASSWORD_FILE)),
        }
    }

    /// The endpoint's scheme, lowercased: `nats`, `tls`, `http`, `https` (or what the user wrote).
    pub fn scheme(&self) -> String {
        self.endpoint.split("://").next().unwrap_or("").to_ascii_lowercase()
    }
}

/// Connects to the endpoint, by its scheme. An error is sink-level (transient): the caller backs off.
pub fn connect(config: &SinkConfig, client_name: &str) -> Result<Box<dyn Sink>, String> {
    match config.scheme().as_str() {
        "nats" | "tls" => Ok(Box::new(nats::NatsSink::connect(config, client_name)?)),
        "http" | "https" => Ok(Box::new(http::HttpSink::new(config)?)),
        "kafka" => Ok(Box::new(kafka::KafkaSink::connect(config, client_name)?)),
        #[cfg(feature = "fault-injection")]
        "discard" => Ok(Box::new(discard::Discard)),
        _ => Err(format!(
            "feature_outbox.endpoint \"{}\" must start with nats://, tls://, http://, https:// or kafka://",
            config.endpoint
        )),
    }
}

/// Whether a server of the endpoint answers a fresh connection within `deadline` (NATS: greets it
/// with INFO; Kafka: answers a metadata request); None for a sink that has no such probe (HTTP), or
/// whose probe cannot be set up. A worker backing off ends its backoff when a server that did not
/// answer answers again: refusing a connection and accepting one without a word are both no answer.
pub fn answers(config: &SinkConfig, deadline: Duration) -> Option<bool> {
    match config.scheme().as_str() {
        "nats" | "tls" => Some(nats::answers(&config.endpoint, deadline)),
        "kafka" => kafka::answers(config, deadline),
        _ => None,
    }
}

/// Settings for a sink's unit tests: `endpoint`, defaults elsewhere.
#[cfg(test)]
pub(crate) fn test_config(endpoint: &str) -> SinkConfig {
    SinkConfig {
        endpoint: endpoint.into(),
        publish_timeout: Duration::from_secs(1),
        tls_ca_file: None,
        nats_credentials_file: None,
        nats_nkey_file: None,
        http_secret: None,
        http_secret_file: None,
        subject_prefix: "features".into(),
        legacy_subjects: false,
        subject_resolutions: vec![],
        stream: "FEATURES".into(),
        duplicate_window: Duration::from_secs(1),
        replicas: 1,
        max_age: Duration::ZERO,
        object_bucket: "B".into(),
        http_max_body: 10 * 1024 * 1024,
        envelope: crate::settings::Envelope::Native,
        source: crate::event::tests::source(),
        http_concurrency: 8,
        http_batch: 1,
        kafka_topic: None,
        kafka_partitions: 1,
        kafka_replication_factor: -1,
        kafka_security: crate::settings::KafkaSecurity::Plaintext,
        kafka_sasl_mechanism: crate::settings::KafkaSaslMechanism::Plain,
        kafka_sasl_username: None,
        kafka_sasl_password_file: None,
    }
}
