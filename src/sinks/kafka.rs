//! Kafka: each event one message on its layer's topic
//! (`<prefix>.<layer>`, or one fixed topic), keyed by the feature's identity so that a feature's
//! events land in one partition in order. The partitioner is the Java client's (`murmur2_random`:
//! murmur2 of the key, as Java's default partitioner), so a Java consumer's assignment agrees.
//! A row counts as delivered only on a positive delivery report; the producer runs with
//! `acks=all` and idempotence (librdkafka through rdkafka, not a hand-written protocol). The
//! client's own delivery timeout (`message.timeout.ms`) is the relay's publish timeout, so an
//! outage shows as a sink that is down, not as late row failures. A broker that refuses the
//! idempotent producer gets a producer without it, said once in the log and in relay_last_error.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{Client, ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaType;

use super::{Outcome, Sink, SinkConfig};
use crate::cloudevents::{self, Binding, Message};
use crate::event::{Row, SCHEMA_VERSION, Source};
use crate::settings::{Envelope, KafkaSaslMechanism, KafkaSecurity};

/// librdkafka's callbacks, on its own threads: they keep the client's last error (a refused SASL
/// login, a certificate that does not verify) for the worker to report, and never call into
/// PostgreSQL or log.
#[derive(Clone, Default)]
pub struct Context {
    /// The client's distinct errors since the broker last answered, oldest first, at most KEPT:
    /// the cause (a refused login) comes before the summary (all brokers down).
    errors: Arc<Mutex<Vec<String>>>,
}

const KEPT: usize = 3;

impl Context {
    fn keep(&self, what: String) {
        if let Ok(mut errors) = self.errors.lock()
            && !errors.contains(&what)
        {
            if errors.len() == KEPT {
                errors.remove(0);
            }
            errors.push(what);
        }
    }

    /// Waits up to `limit` for librdkafka to report an error, when none is kept yet.
    fn wait_for_cause(&self, limit: Duration) {
        let start = std::time::Instant::now();
        while start.elapsed() < limit && self.errors.lock().map(|e| e.is_empty()).unwrap_or(false) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The broker answered: an earlier error no longer explains anything.
    fn forget(&self) {
        if let Ok(mut errors) = self.errors.lock() {
            errors.clear();
        }
    }

    /// `error`, with the client's last error when it says more (librdkafka's own reports of a
    /// transport failure name no cause).
    pub fn explain(&self, error: impl std::fmt::Display) -> String {
        let error = error.to_string();
        let errors = self.errors.lock().map(|e| e.clone()).unwrap_or_default();
        let news: Vec<&String> = errors.iter().filter(|e| !error.contains(e.as_str())).collect();
        if news.is_empty() { error } else { format!("{error} ({})", news.iter().map(|e| e.as_str()).collect::<Vec<_>>().join("; ")) }
    }
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        if matches!(level, RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error) {
            self.keep(format!("{facility}: {message}"));
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.keep(format!("{error}: {reason}"));
    }
}

/// Set once a broker of this worker refused the idempotent producer: later producers go without.
static IDEMPOTENCE_REFUSED: AtomicBool = AtomicBool::new(false);

/// The `security.protocol`, `sasl.*` and `ssl.ca.location` settings of `config`, with the SASL
/// password read from its file (never from SQL). An error names the setting to fix.
pub fn security_settings(config: &SinkConfig) -> Result<Vec<(&'static str, String)>, String> {
    let (protocol, sasl) = match config.kafka_security {
        KafkaSecurity::Plaintext => ("plaintext", false),
        KafkaSecurity::Ssl => ("ssl", false),
        KafkaSecurity::SaslPlaintext => ("sasl_plaintext", true),
        KafkaSecurity::SaslSsl => ("sasl_ssl", true),
    };
    let mut out = vec![("security.protocol", protocol.to_string())];
    if sasl {
        let mechanism = match config.kafka_sasl_mechanism {
            KafkaSaslMechanism::Plain => "PLAIN",
            KafkaSaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            KafkaSaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        };
        let user = config.kafka_sasl_username.as_deref().ok_or(format!(
            "feature_outbox.kafka_security_protocol is {protocol} but feature_outbox.kafka_sasl_username is not set"
        ))?;
        let path = config.kafka_sasl_password_file.as_deref().ok_or(format!(
            "feature_outbox.kafka_security_protocol is {protocol} but feature_outbox.kafka_sasl_password_file is not set"
        ))?;
        let password = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read feature_outbox.kafka_sasl_password_file {path}: {e}"))?;
        let password = password.trim_end_matches(['\n', '\r']);
        if password.is_empty() {
            return Err(format!("feature_outbox.kafka_sasl_password_file {path} is empty"));
        }
        out.push(("sasl.mechanism", mechanism.to_string()));
        out.push(("sasl.username", user.to_string()));
        out.push(("sasl.password", password.to_string()));
    }
    if matches!(config.kafka_security, KafkaSecurity::Ssl | KafkaSecurity::SaslSsl)
        && let Some(ca) = &config.tls_ca_file
    {
        out.push(("ssl.ca.location", ca.clone()));
    }
    Ok(out)
}

/// Whether a fatal error of an idempotent producer says the broker does not support it (brokers
/// before Kafka 0.11, or one that refuses InitProducerId), rather than a broken producer.
pub fn refuses_idempotence(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::UnsupportedFeature
            | RDKafkaErrorCode::UnsupportedVersion
            | RDKafkaErrorCode::ClusterAuthorizationFailed
            | RDKafkaErrorCode::UnsupportedForMessageFormat
    )
}

/// The broker list of a `kafka://host:port[,host:port...]` endpoint, as `bootstrap.servers`.
pub fn bootstrap_servers(endpoint: &str) -> Result<String, String> {
    // Errors quote the endpoint as SHOW does for other roles: never a password (last_error is
    // readable by pg_monitor).
    let shown = crate::settings::redact_urls(endpoint);
    let rest = endpoint
        .split_once("://")
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("kafka"))
        .map(|(_, rest)| rest.trim_end_matches('/'))
        .ok_or_else(|| format!("feature_outbox.endpoint \"{shown}\" is not kafka://host:port[,host:port...]"))?;
    let hosts: Vec<&str> = rest.split(',').map(str::trim).collect();
    if hosts.iter().any(|h| h.is_empty() || h.contains('@') || h.contains('/')) {
        return Err(format!(
            "feature_outbox.endpoint \"{shown}\": each broker is host:port (credentials come from feature_outbox.kafka_sasl_password_file, never the URL)"
        ));
    }
    if let Some(h) = hosts.iter().find(|h| h.rsplit_once(':').is_none_or(|(_, port)| port.parse::<u16>().is_err())) {
        return Err(format!("feature_outbox.endpoint \"{shown}\": broker \"{h}\" has no port (host:port, Kafka's is usually 9092)"));
    }
    Ok(hosts.join(","))
}

/// Whether a broker of the endpoint answers a metadata request (for the brokers alone) within
/// `deadline`, on a client of its own that connects afresh, with the settings' security (so that a
/// TLS or SASL listener can answer): a broker that is down refuses it, one that hangs never
/// answers. It retries a refused connection every PROBE_RECONNECT, so a broker that comes back
/// during the wait answers it. None when the settings give no client (a bad endpoint, an unreadable
/// password file): the connect says why.
pub fn answers(config: &SinkConfig, deadline: Duration) -> Option<bool> {
    let servers = bootstrap_servers(&config.endpoint).ok()?;
    let wait_ms = deadline.as_millis().max(1).to_string();
    let reconnect_ms = PROBE_RECONNECT.as_millis().to_string();
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &servers)
        .set("client.id", "feature_outbox probe")
        .set("socket.timeout.ms", &wait_ms)
        .set("reconnect.backoff.ms", &reconnect_ms)
        .set("reconnect.backoff.max.ms", &reconnect_ms);
    for (key, value) in security_settings(config).ok()? {
        c.set(key, value);
    }
    c.set_log_level(RDKafkaLogLevel::Error);
    // librdkafka's threads start with every signal blocked (signals.rs), and are gone once the
    // client is dropped, at the end of this function.
    let client = crate::signals::blocked(|| {
        let native = c.create_native_config().ok()?;
        Client::new(&c, native, RDKafkaType::RD_KAFKA_PRODUCER, DefaultClientContext).ok()
    })?;
    Some(brokers_answer(&client, deadline).is_ok())
}

/// Asks a broker of `client` for the cluster's brokers, answered within `deadline`. librdkafka's
/// `rd_kafka_metadata` with `all_topics` 0 names only the topics the client knows (none for a
/// fresh client, the relay's own for its producer), where rdkafka's `fetch_metadata(None)` asks for
/// every topic of the cluster: a large answer from a large cluster at each look.
fn brokers_answer<C: ClientContext>(client: &Client<C>, deadline: Duration) -> Result<(), KafkaError> {
    use rdkafka::bindings::{rd_kafka_metadata, rd_kafka_metadata_destroy, rd_kafka_resp_err_t};
    let mut metadata = std::ptr::null();
    let wait_ms = i32::try_from(deadline.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: the handle is valid while `client` lives; librdkafka sets `metadata` only on success,
    // and then it is ours to destroy, once.
    let code = unsafe { rd_kafka_metadata(client.native_ptr(), 0, std::ptr::null_mut(), &mut metadata, wait_ms) };
    if code != rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        return Err(KafkaError::MetadataFetch(code.into()));
    }
    unsafe { rd_kafka_metadata_destroy(metadata) };
    Ok(())
}

/// How often the probe of `answers` retries a broker that refused its connection.
const PROBE_RECONNECT: Duration = Duration::from_millis(100);

/// A layer's topic: the fixed topic when one is set, else `<prefix>.<layer>`.
pub fn topic_of(prefix: &str, fixed: Option<&str>, layer: &str) -> String {
    fixed.map_or_else(|| format!("{prefix}.{layer}"), str::to_string)
}

/// A message's key: the feature's identity within its layer, `<layer>/<id>` when one topic holds
/// several layers.
pub fn key_of(fixed_topic: bool, row: &Row) -> String {
    if fixed_topic { format!("{}/{}", row.layer, row.key()) } else { row.key() }
}

/// What a failed delivery report means for the row: a message the broker refuses is the row's
/// (retried, then parked; too large is parked at once, since no retry fits it), anything else is
/// the sink's (backoff, nothing counted against the row). An unknown error never parks a row.
pub fn outcome_of(error: &KafkaError, size: usize, max_bytes: usize) -> Outcome {
    let code = match error {
        KafkaError::MessageProduction(code) => Some(*code),
        _ => error.rdkafka_error_code(),
    };
    match code {
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => Outcome::Undeliverable(format!(
            "the event is {size} bytes, over the topic's max.message.bytes (the producer allows {max_bytes}); Kafka has no object store for its geometry"
        )),
        Some(
            RDKafkaErrorCode::InvalidTopic
            | RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::InvalidRecord
            | RDKafkaErrorCode::InvalidMessage,
        ) => Outcome::RowFailed(format!("the broker refused the event: {error}")),
        _ => Outcome::SinkFailed { error: format!("Kafka: {error}"), retry_after: None },
    }
}

/// The largest message the producer sends (librdkafka's `message.max.bytes`, Kafka's default).
const MAX_MESSAGE_BYTES: usize = 1_000_000;

pub struct KafkaSink {
    producer: FutureProducer<Context>,
    admin: AdminClient<Context>,
    context: Context,
    prefix: String,
    topic: Option<String>,
    partitions: i32,
    replication: i32,
    timeout: Duration,
    envelope: Envelope,
    source: Source,
    /// feature_outbox.subject_resolutions: the parent cells the headers carry.
    resolutions: Vec<u8>,
    idempotent: bool,
    /// Topics created (or found) since connecting.
    topics: HashSet<String>,
}

impl KafkaSink {
    /// A producer for the endpoint's brokers. Its threads (librdkafka's own) start with every
    /// signal blocked (signals.rs), and none of them calls into PostgreSQL.
    pub fn connect(config: &SinkConfig, client_name: &str) -> Result<KafkaSink, String> {
        let servers = bootstrap_servers(&config.endpoint)?;
        if config.kafka_replication_factor == 0 {
            return Err("feature_outbox.kafka_replication_factor is 0: a topic needs 1 or more replicas (-1 takes the broker's default)".into());
        }
        let timeout_ms = config.publish_timeout.as_millis().max(1).to_string();
        let idempotent = !IDEMPOTENCE_REFUSED.load(Ordering::Relaxed);
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &servers)
            .set("client.id", client_name)
            .set("acks", "all")
            .set("enable.idempotence", idempotent.to_string())
            .set("partitioner", "murmur2_random")
            .set("message.timeout.ms", &timeout_ms)
            .set("socket.timeout.ms", &timeout_ms)
            .set("message.max.bytes", MAX_MESSAGE_BYTES.to_string())
            .set("linger.ms", "1");
        for (key, value) in security_settings(config)? {
            c.set(key, value);
        }
        // Errors only, to Context::log (rdkafka would take the level from the `log` crate, which
        // has no logger here and so would silence the cause of a failed connect).
        c.set_log_level(RDKafkaLogLevel::Error);
        let context = Context::default();
        let (producer, admin) = crate::signals::blocked(|| {
            let producer: FutureProducer<Context> = c
                .create_with_context(context.clone())
                .map_err(|e| format!("cannot start a Kafka producer for {servers}: {e}"))?;
            let admin: AdminClient<Context> = c
                .create_with_context(context.clone())
                .map_err(|e| format!("cannot start a Kafka admin client for {servers}: {e}"))?;
            Ok::<_, String>((producer, admin))
        })?;
        // Reach a broker now: a connect that fails is the sink's, and the worker backs off.
        producer
            .client()
            .fetch_metadata(None, config.publish_timeout)
            .map_err(|e| {
                // The broker thread may log the cause (a refused login) just after the fetch gives up.
                context.wait_for_cause(Duration::from_millis(200));
                context.explain(format!("cannot reach a Kafka broker at {servers}: {e}"))
            })?;
        Ok(KafkaSink {
            producer,
            admin,
            context,
            prefix: config.subject_prefix.clone(),
            topic: config.kafka_topic.clone(),
            partitions: config.kafka_partitions,
            replication: config.kafka_replication_factor,
            timeout: config.publish_timeout,
            envelope: config.envelope,
            source: config.source.clone(),
            resolutions: config.subject_resolutions.clone(),
            idempotent,
            topics: HashSet::new(),
        })
    }

    /// Creates `topic` with the settings' partitions and replication factor unless it exists.
    fn ensure_topic(&mut self, topic: &str) -> Result<(), Outcome> {
        if self.topics.contains(topic) {
            return Ok(());
        }
        let replication = TopicReplication::Fixed(self.replication);
        let new = NewTopic::new(topic, self.partitions, replication);
        let options = AdminOptions::new().operation_timeout(Some(self.timeout)).request_timeout(Some(self.timeout));
        let created = crate::signals::blocked(|| futures::executor::block_on(self.admin.create_topics([&new], &options)));
        match created {
            Ok(results) => match results.into_iter().next() {
                Some(Ok(_)) | None => {}
                Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => {}
                Some(Err((name, code))) => {
                    let error = self.context.explain(format!("cannot create Kafka topic {name}: {code}"));
                    return Err(Outcome::SinkFailed { error, retry_after: None });
                }
            },
            Err(e) => {
                let error = self.context.explain(format!("cannot create Kafka topic {topic}: {e}"));
                return Err(Outcome::SinkFailed { error, retry_after: None });
            }
        }
        self.topics.insert(topic.to_string());
        Ok(())
    }

    fn headers(&self, row: &Row) -> OwnedHeaders {
        let mut pairs: Vec<(String, String)> = vec![
            ("id".into(), row.event_id.clone()),
            ("Feature-Event-Id".into(), row.event_id.clone()),
            ("Feature-Schema-Version".into(), SCHEMA_VERSION.to_string()),
            ("Feature-Layer".into(), row.layer.clone()),
            ("Feature-Id".into(), row.key()),
            ("Feature-Version".into(), row.feature_version.to_string()),
            (cloudevents::ORIGIN_HEADER.into(), row.origin.clone()),
            ("Routing-Key".into(), row.routing_key.clone()),
            (cloudevents::DATABASE_HEADER.into(), cloudevents::database_header_value(&self.source.database)),
            (cloudevents::DATABASE_ID_HEADER.into(), self.source.database_id.clone()),
        ];
        if let Some(prev) = &row.previous_routing_key {
            pairs.push(("Previous-Routing-Key".into(), prev.clone()));
        }
        pairs.extend(parent_cell_headers(&row.routing_key, &self.resolutions));
        pairs.extend(cloudevents::headers(self.envelope, Binding::Kafka, &self.source, &self.prefix, row, Message::Event));
        if self.envelope == Envelope::CloudEvents {
            // The Partitioning extension: the message key, so a consumer of the CloudEvent has it.
            pairs.push(("ce_partitionkey".into(), key_of(self.topic.is_some(), row)));
        }
        pairs.into_iter().fold(OwnedHeaders::new(), |h, (k, v)| h.insert(Header { key: &k, value: Some(&v) }))
    }
}

impl Sink for KafkaSink {
    /// Enqueues every row's message, then awaits the delivery reports together (each bounded by
    /// message.timeout.ms). A row whose topic cannot be made, and every row after a sink-level
    /// failure, is not sent.
    fn send(&mut self, rows: &[Row], bodies: &[&[u8]], _relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
        let fixed = self.topic.is_some();
        let mut pending = Vec::with_capacity(rows.len());
        let mut down: Option<Outcome> = None;
        for (row, body) in rows.iter().zip(bodies) {
            if down.is_some() {
                pending.push(Err(Outcome::NotTried));
                continue;
            }
            let topic = topic_of(&self.prefix, self.topic.as_deref(), &row.layer);
            if let Err(outcome) = self.ensure_topic(&topic) {
                down = Some(outcome.clone());
                pending.push(Err(outcome));
                continue;
            }
            if body.len() > MAX_MESSAGE_BYTES {
                // What the broker's refusal would say, without the round trip.
                let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
                pending.push(Err(outcome_of(&too_large, body.len(), MAX_MESSAGE_BYTES)));
                continue;
            }
            let key = key_of(fixed, row);
            let record = FutureRecord::to(&topic).key(&key).payload(*body).headers(self.headers(row));
            match self.producer.send_result(record) {
                Ok(delivery) => pending.push(Ok((delivery, body.len()))),
                Err((e, _)) => {
                    let outcome = outcome_of(&e, body.len(), MAX_MESSAGE_BYTES);
                    if matches!(outcome, Outcome::SinkFailed { .. }) {
                        down = Some(outcome.clone());
                    }
                    pending.push(Err(outcome));
                }
            }
        }
        meanwhile();
        let reports = pending.into_iter().map(|p| async move {
            match p {
                Err(outcome) => outcome,
                Ok((delivery, size)) => match delivery.await {
                    Ok(Ok(_)) => Outcome::Delivered { duplicate: false },
                    Ok(Err((e, _))) => outcome_of(&e, size, MAX_MESSAGE_BYTES),
                    // The producer dropped the report (it is being torn down): nothing is known.
                    Err(_) => Outcome::SinkFailed { error: "Kafka: the delivery report was lost".into(), retry_after: None },
                },
            }
        });
        let mut outcomes = crate::signals::blocked(|| futures::executor::block_on(futures::future::join_all(reports)));
        if outcomes.iter().any(|o| matches!(o, Outcome::Delivered { .. })) {
            self.context.forget();
        }
        for o in outcomes.iter_mut() {
            if let Outcome::SinkFailed { error, .. } = o {
                *error = self.context.explain(&*error);
            }
        }
        if let Some(down) = self.fatal() {
            // A fatal producer error fails every unacknowledged row at the sink level; the worker
            // reconnects with a new producer.
            for o in outcomes.iter_mut().filter(|o| !matches!(o, Outcome::Delivered { .. })) {
                *o = down.clone();
            }
        }
        outcomes
    }

    /// The producer's fatal error, if any; else a metadata request (brokers and the relay's topics)
    /// on the producer's own connections, answered within `deadline`: a broker that hangs with its
    /// connections open answers nothing, and the request times out.
    fn health(&self, deadline: Duration) -> Option<Result<(), String>> {
        if let Some(Outcome::SinkFailed { error, .. }) = self.fatal() {
            return Some(Err(error));
        }
        Some(brokers_answer(self.producer.client(), deadline).map_err(|e| {
            self.context.explain(format!("Kafka: no metadata from the broker within {} ms: {e}", deadline.as_millis()))
        }))
    }

    fn notice(&self) -> Option<String> {
        (!self.idempotent).then(|| {
            "the Kafka broker refused the idempotent producer; producing with acks=all without it, so a broker failure can duplicate a message (consumers deduplicate by the id header)".to_string()
        })
    }
}

impl KafkaSink {
    /// The producer's fatal error, if it has one, as a sink failure. One that says the broker does
    /// not support idempotence makes the next producer of this worker go without it.
    fn fatal(&self) -> Option<Outcome> {
        let (code, reason) = self.producer.client().fatal_error()?;
        let error = if self.idempotent && refuses_idempotence(code) {
            IDEMPOTENCE_REFUSED.store(true, Ordering::Relaxed);
            format!("Kafka: the broker does not support the idempotent producer ({code}: {reason}); reconnecting without it")
        } else {
            format!("Kafka: the producer failed ({code}: {reason}); reconnecting")
        };
        Some(Outcome::SinkFailed { error, retry_after: None })
    }
}

/// `Parent-Cell-<r>` headers: the routing key's H3 parent at each of feature_outbox.subject_resolutions
/// coarser than the key, the cells a NATS subject carries, so a consumer can filter by area. A key
/// that is no H3 cell has none.
pub fn parent_cell_headers(routing_key: &str, resolutions: &[u8]) -> Vec<(String, String)> {
    resolutions
        .iter()
        .filter_map(|&r| crate::routing::parent(routing_key, i32::from(r)).ok().map(|cell| (format!("Parent-Cell-{r}"), cell)))
        .filter(|(_, cell)| cell != routing_key)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::row;

    #[test]
    fn endpoints_list_brokers_and_refuse_credentials_in_the_url() {
        assert_eq!(bootstrap_servers("kafka://a:9092,b:9093/").unwrap(), "a:9092,b:9093");
        assert_eq!(bootstrap_servers("KAFKA://127.0.0.1:9092").unwrap(), "127.0.0.1:9092");
        assert!(bootstrap_servers("nats://a:4222").is_err());
        let refused = bootstrap_servers("kafka://user:pw@a:9092").unwrap_err();
        assert!(refused.contains("kafka_sasl_password_file") && !refused.contains("pw@"), "{refused}");
        assert!(bootstrap_servers("kafka://127.0.0.1").unwrap_err().contains("no port"));
        assert!(bootstrap_servers("kafka://a:9092,,b:1").is_err());
    }

    #[test]
    fn topics_per_layer_and_keys_name_the_layer_when_one_topic_holds_several() {
        let r = row();
        assert_eq!(topic_of("features", None, "parcels"), "features.parcels");
        assert_eq!(topic_of("features", Some("all-edits"), "parcels"), "all-edits");
        assert_eq!(key_of(false, &r), r.key());
        assert_eq!(key_of(true, &r), format!("{}/{}", r.layer, r.key()));
    }

    #[test]
    fn parent_cell_headers_name_their_resolution_and_skip_finer_levels() {
        let key = "881f1d4891fffff";
        let h = parent_cell_headers(key, &[3, 5, 8, 9]);
        assert_eq!(
            h,
            vec![
                ("Parent-Cell-3".to_string(), crate::routing::parent(key, 3).unwrap()),
                ("Parent-Cell-5".to_string(), crate::routing::parent(key, 5).unwrap()),
            ]
        );
        assert!(parent_cell_headers("not-a-cell", &[3]).is_empty());
    }

    fn config_with(security: KafkaSecurity, user: Option<&str>, password_file: Option<&str>) -> SinkConfig {
        let mut c = crate::sinks::test_config("kafka://127.0.0.1:9092");
        c.kafka_security = security;
        c.kafka_sasl_mechanism = KafkaSaslMechanism::ScramSha512;
        c.kafka_sasl_username = user.map(Into::into);
        c.kafka_sasl_password_file = password_file.map(Into::into);
        c.tls_ca_file = Some("/etc/ca.pem".into());
        c
    }

    #[test]
    fn security_reads_the_password_from_its_file_and_names_what_is_missing() {
        let plain = security_settings(&config_with(KafkaSecurity::Plaintext, None, None)).unwrap();
        assert_eq!(plain, vec![("security.protocol", "plaintext".to_string())]);
        let ssl = security_settings(&config_with(KafkaSecurity::Ssl, None, None)).unwrap();
        assert!(ssl.contains(&("ssl.ca.location", "/etc/ca.pem".to_string())));
        let missing = security_settings(&config_with(KafkaSecurity::SaslSsl, None, None)).unwrap_err();
        assert!(missing.contains("kafka_sasl_username"), "{missing}");
        let dir = std::env::temp_dir().join(format!("fo-kafka-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("pw");
        std::fs::write(&file, "s3cret\n").unwrap();
        let sasl = security_settings(&config_with(KafkaSecurity::SaslSsl, Some("relay"), file.to_str())).unwrap();
        assert!(sasl.contains(&("sasl.password", "s3cret".to_string())));
        assert!(sasl.contains(&("sasl.mechanism", "SCRAM-SHA-512".to_string())));
        let unreadable = security_settings(&config_with(KafkaSecurity::SaslPlaintext, Some("relay"), Some("/nonexistent/pw"))).unwrap_err();
        assert!(unreadable.contains("kafka_sasl_password_file"), "{unreadable}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_broker_that_accepts_and_says_nothing_does_not_answer_within_the_wait() {
        const WAIT: Duration = Duration::from_millis(500);
        // Bound and listening, never read: the kernel accepts the connection, as for a SIGSTOPped broker.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = crate::sinks::test_config(&format!("kafka://{}", silent.local_addr().unwrap()));
        let start = std::time::Instant::now();
        assert_eq!(answers(&config, WAIT), Some(false));
        // The client's threads are gone as soon after the wait as librdkafka tears them down.
        assert!(start.elapsed() < WAIT + Duration::from_secs(1), "{:?}", start.elapsed());
        drop(silent);
        assert_eq!(answers(&config, WAIT), Some(false), "refused");
        assert_eq!(answers(&crate::sinks::test_config("kafka://no-port"), WAIT), None);
    }

    #[test]
    fn only_unsupported_features_turn_idempotence_off() {
        assert!(refuses_idempotence(RDKafkaErrorCode::UnsupportedFeature));
        assert!(!refuses_idempotence(RDKafkaErrorCode::OutOfOrderSequenceNumber));
    }

    #[test]
    fn refusals_are_the_rows_and_outages_the_sinks() {
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        match outcome_of(&too_large, 2_000_000, MAX_MESSAGE_BYTES) {
            Outcome::Undeliverable(e) => assert!(e.contains("2000000 bytes") && e.contains("1000000"), "{e}"),
            o => panic!("{o:?}"),
        }
        let invalid = KafkaError::MessageProduction(RDKafkaErrorCode::InvalidTopic);
        assert!(matches!(outcome_of(&invalid, 10, MAX_MESSAGE_BYTES), Outcome::RowFailed(_)));
        for code in [RDKafkaErrorCode::MessageTimedOut, RDKafkaErrorCode::AllBrokersDown, RDKafkaErrorCode::QueueFull] {
            assert!(matches!(outcome_of(&KafkaError::MessageProduction(code), 10, MAX_MESSAGE_BYTES), Outcome::SinkFailed { .. }));
        }
    }
}
