//! NATS JetStream sink (async-nats): publishes a batch with all PubAcks in flight at once, and marks
//! a row only after its PubAck. `Nats-Msg-Id` carries the event_id, so JetStream drops a republished
//! event inside the stream's duplicate window (NATS docs, "JetStream: Message Deduplication").

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishErrorKind, object_store, stream};
use async_nats::{Client, ConnectOptions, HeaderMap};
use bytes::Bytes;
use futures::future::join_all;
use tokio::runtime::Runtime;

use super::{InFlight, Outcome, Sink, SinkConfig};
use crate::cloudevents::{self, Binding, Message};
use crate::event::{self, GeometryRef, Row, Source};
use crate::settings::Envelope;
use crate::subjects;

pub struct NatsSink {
    runtime: Runtime,
    client: Client,
    js: jetstream::Context,
    prefix: String,
    /// feature_outbox.subject_format = '0.1'.
    legacy_subjects: bool,
    /// feature_outbox.subject_resolutions.
    resolutions: Vec<u8>,
    envelope: Envelope,
    source: Source,
    timeout: Duration,
    bucket: object_store::Config,
    /// The object bucket, created or found on the first event over max_payload.
    objects: Option<object_store::ObjectStore>,
    /// Set when the stream existed with limits other than the settings ask for; the worker logs it.
    limits_differ: Option<String>,
    /// Tile-list streams found or created on this connection.
    tile_streams: std::collections::HashSet<String>,
    replicas: usize,
    duplicate_window: Duration,
    /// feature_outbox.nats_stream: the stream an idle worker's look asks about.
    stream: String,
}

/// Splits `scheme://[user[:password]@]host:port` into credentials and a credential-free address.
fn split_credentials(url: &str) -> (Option<(String, Option<String>)>, String) {
    let (scheme, rest) = url.split_once("://").unwrap_or(("nats", url));
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let creds = match userinfo.split_once(':') {
                Some((user, pass)) => (user.to_string(), Some(pass.to_string())),
                None => (userinfo.to_string(), None),
            };
            (Some(creds), format!("{scheme}://{host}"))
        }
        None => (None, url.to_string()),
    }
}

/// True when some server of a NATS `endpoint` (comma-separated URLs) greets a fresh connection with
/// its INFO line within `deadline`, as a NATS server does before anything else (for tls:// too:
/// INFO comes before the TLS handshake). A stopped server refuses the connection; a hung one
/// (SIGSTOPped, or behind a proxy that accepts TCP and forwards nothing) accepts it and stays
/// silent. The servers are tried at once, each on a thread of its own that resolves its name too,
/// so neither a silent server nor a slow DNS answer holds the caller past `deadline`.
pub fn answers(endpoint: &str, deadline: Duration) -> bool {
    let until = Instant::now() + deadline;
    let (tx, rx) = std::sync::mpsc::channel();
    for url in endpoint.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (tx, address) = (tx.clone(), probe_address(url));
        // Threads start with signals blocked (signals.rs); one that cannot start counts as silent.
        let _ = crate::signals::blocked(|| std::thread::Builder::new().name("nats probe".into()).spawn(move || {
            let _ = tx.send(greets(&address, until));
        }));
    }
    drop(tx);
    while let Ok(greeted) = rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
        if greeted {
            return true;
        }
    }
    false
}

/// `host:port` of a NATS URL, credentials taken out, port 4222 when it names none.
fn probe_address(url: &str) -> String {
    let (_, address) = split_credentials(url);
    let host = address.split_once("://").map_or(address.as_str(), |(_, h)| h).trim_end_matches('/');
    if host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) { host.to_string() } else { format!("{host}:4222") }
}

/// Whether the server at `address` sends `INFO` on a fresh connection before `until`.
fn greets(address: &str, until: Instant) -> bool {
    use std::io::Read;
    use std::net::{TcpStream, ToSocketAddrs};
    let Ok(addrs) = address.to_socket_addrs() else { return false };
    addrs.into_iter().any(|a| {
        let left = |now: Instant| until.checked_duration_since(now).filter(|d| !d.is_zero());
        let Some(stream) = left(Instant::now()).and_then(|d| TcpStream::connect_timeout(&a, d).ok()) else { return false };
        let mut greeting = [0u8; 4];
        let mut got = 0;
        while got < greeting.len() {
            let Some(d) = left(Instant::now()) else { return false };
            if stream.set_read_timeout(Some(d)).is_err() {
                return false;
            }
            match (&stream).read(&mut greeting[got..]) {
                Ok(0) => return false,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        greeting.eq_ignore_ascii_case(b"INFO")
    })
}

impl NatsSink {
    pub fn connect(config: &SinkConfig, client_name: &str) -> Result<NatsSink, String> {
        // A multi-thread runtime with one worker keeps the connection serviced while the relay
        // sleeps on its latch (a current-thread runtime would not run between block_on calls).
        // Its threads, and the blocking-pool threads block_on may start, with signals blocked
        // (signals.rs): every block_on goes through block_on() below.
        let runtime = crate::signals::blocked(|| tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build())
            .map_err(|e| format!("cannot start the NATS runtime: {e}"))?;
        // Credentials the way production deployments hand them out: a .creds file (JWT and seed),
        // or an NKey seed. A file that cannot be read is a sink-level error naming the setting and
        // the path, never the content.
        let base = match (&config.nats_credentials_file, &config.nats_nkey_file) {
            (Some(path), _) => block_on(&runtime, ConnectOptions::with_credentials_file(path))
                .map_err(|e| format!("cannot use feature_outbox.nats_credentials_file {path}: {}", e.kind()))?,
            (None, Some(path)) => {
                let seed = std::fs::read_to_string(path).map_err(|e| format!("cannot read feature_outbox.nats_nkey_file {path}: {}", e.kind()))?;
                ConnectOptions::with_nkey(seed.trim().to_string())
            }
            (None, None) => ConnectOptions::new(),
        };
        let mut options = base
            .name(client_name)
            .connection_timeout(config.publish_timeout)
            .request_timeout(Some(config.publish_timeout));
        let mut addresses = Vec::new();
        for url in config.endpoint.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let (creds, address) = split_credentials(url);
            match creds {
                Some((user, Some(pass))) => options = options.user_and_password(user, pass),
                Some((token, None)) => options = options.token(token),
                None => {}
            }
            if address.to_ascii_lowercase().starts_with("tls://") {
                options = options.require_tls(true);
            }
            addresses.push(address.parse::<async_nats::ServerAddr>().map_err(|e| format!("bad NATS server address {address}: {e}"))?);
        }
        if let Some(ca) = &config.tls_ca_file {
            options = options.add_root_certificates(ca.into());
        }
        // Credential-free, for errors that reach the views and the log.
        let servers = addresses.iter().map(|a| format!("{}:{}", a.host(), a.port())).collect::<Vec<_>>().join(", ");
        let timeout = config.publish_timeout;
        let wanted = stream::Config {
            name: config.stream.clone(),
            subjects: vec![format!("{}.>", config.subject_prefix)],
            duplicate_window: config.duplicate_window,
            num_replicas: config.replicas,
            max_age: config.max_age,
            ..Default::default()
        };
        let (client, js, limits_differ) = block_on(&runtime, async {
            let client = tokio::time::timeout(timeout, options.connect(addresses.as_slice()))
                .await
                .map_err(|_| format!("timed out connecting to NATS at {servers}"))?
                .map_err(|e| format!("cannot connect to NATS at {servers}: {e}"))?;
            let mut js = jetstream::new(client.clone());
            js.set_timeout(timeout);
            // An existing stream is used as it is; the settings only shape a stream the relay creates.
            if let Ok(mut stream) = js.get_stream(&config.stream).await {
                let have = &stream.info().await.map_err(|e| format!("cannot read JetStream stream {}: {e}", config.stream))?.config;
                return Ok::<_, String>((client, js, limits_note(&wanted, have)));
            }
            // JetStream refuses a stream whose max_age is below its duplicate window.
            if !wanted.max_age.is_zero() && wanted.max_age < wanted.duplicate_window {
                return Err(format!(
                    "cannot create JetStream stream {}: feature_outbox.nats_max_age ({} s) must be at least feature_outbox.nats_duplicate_window ({} s), or 0",
                    config.stream,
                    wanted.max_age.as_secs(),
                    wanted.duplicate_window.as_secs()
                ));
            }
            js.get_or_create_stream(wanted.clone())
                .await
                .map_err(|e| format!("cannot create or find JetStream stream {}: {e}", config.stream))?;
            Ok((client, js, None))
        })?;
        let bucket = object_store::Config {
            bucket: config.object_bucket.clone(),
            max_age: config.max_age,
            num_replicas: config.replicas,
            ..Default::default()
        };
        Ok(NatsSink { runtime, client, js, prefix: config.subject_prefix.clone(), legacy_subjects: config.legacy_subjects, resolutions: config.subject_resolutions.clone(), envelope: config.envelope, source: config.source.clone(), timeout, bucket, objects: None, limits_differ, tile_streams: Default::default(), replicas: config.replicas, duplicate_window: config.duplicate_window, stream: config.stream.clone() })
    }

    /// Hands the batch to the runtime's thread, which builds each message (subjects, headers),
    /// sends it and collects the PubAcks, and returns at once: the worker's own thread meanwhile
    /// claims, encodes and marks (`finish` awaits the outcomes). Chunks of IN_FLIGHT messages: in a
    /// batch over IN_FLIGHT, a chunk is acknowledged before the next is sent. The geometry of an
    /// event over max_payload is stored in the object bucket first, on the worker's thread.
    fn begin(&mut self, rows: &[Row], bodies: &[&[u8]], relayed_at: &str) -> Pending {
        let max_payload = self.client.server_info().max_payload;
        // An event over max_payload carries its geometry by reference: the geometry goes into the
        // object bucket first, and the event follows only once the object is stored.
        // Once the bucket failed, later oversized rows are not tried: each store could wait out its
        // own timeouts, and the batch backs off anyway.
        let mut bucket_failed = false;
        let mut outgoing = Vec::with_capacity(rows.len());
        for (row, body) in rows.iter().zip(bodies) {
            let body = if too_large(body.len(), max_payload) {
                let stored = if bucket_failed { Err(Outcome::NotTried) } else { self.store_geometry(row, relayed_at, max_payload) };
                bucket_failed |= matches!(stored, Err(Outcome::SinkFailed { .. }));
                stored.map(Bytes::from)
            } else {
                Ok(Bytes::copy_from_slice(body))
            };
            outgoing.push((row.without_content(), body));
        }
        let sender = Sender {
            js: self.js.clone(),
            timeout: self.timeout,
            max_payload,
            prefix: self.prefix.clone(),
            legacy: self.legacy_subjects,
            resolutions: self.resolutions.clone(),
            envelope: self.envelope,
            source: self.source.clone(),
        };
        let n = outgoing.len();
        Pending(crate::signals::blocked(|| self.runtime.spawn(sender.send_all(outgoing))), n)
    }

}

/// A batch `begin` handed to the runtime: its outcomes to come, and its row count.
struct Pending(tokio::task::JoinHandle<Vec<Outcome>>, usize);

impl Pending {
    /// Awaits the outcomes: one per row, in order. Each await inside is bounded by publish_timeout,
    /// so a stalled server costs one timeout, never a stuck transaction.
    fn outcomes(self, runtime: &tokio::runtime::Handle) -> Vec<Outcome> {
        let n = self.1;
        match crate::signals::blocked(|| runtime.block_on(self.0)) {
            Ok(outcomes) => outcomes,
            // The task panicked or was cancelled: nothing is known of any row; send it all again.
            Err(e) => vec![Outcome::SinkFailed { error: format!("publishing failed: {e}"), retry_after: None }; n],
        }
    }
}

impl Sink for NatsSink {
    /// Publishes in chunks of at most IN_FLIGHT messages, each chunk sent at once and its PubAcks
    /// awaited together. After a sink-level failure the rest is not tried.
    fn send(&mut self, rows: &[Row], bodies: &[&[u8]], relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
        let pending = self.begin(rows, bodies, relayed_at);
        meanwhile();
        pending.outcomes(self.runtime.handle())
    }

    /// JetStream takes the rows in while the worker marks and commits the batch before them; their
    /// Nats-Msg-Id makes a copy sent again (a row the next transaction cannot lock) a duplicate.
    fn send_ahead(&mut self, rows: &[Row], bodies: &[&[u8]], relayed_at: &str) -> Option<InFlight> {
        let pending = self.begin(rows, bodies, relayed_at);
        let runtime = self.runtime.handle().clone();
        Some(InFlight::new(move || pending.outcomes(&runtime)))
    }

    /// Tile lists go to a stream of their own (the one that captures the subject already, or
    /// `stream_name`, created): consumers of the events never see them, and a tile pipeline
    /// subscribes to its subject alone (`nats sub --raw <subject> | render_expired`).
    fn publish_tile_lists(&mut self, stream_name: &str, subject: &str, bodies: &[String], msg_id: &str, extra: &[(&str, String)]) -> Option<Result<(), String>> {
        let (js, timeout) = (self.js.clone(), self.timeout);
        let ensure = !self.tile_streams.contains(stream_name);
        let wanted = stream::Config {
            name: stream_name.to_string(),
            subjects: vec![subject.to_string()],
            duplicate_window: self.duplicate_window,
            num_replicas: self.replicas,
            max_age: self.bucket.max_age,
            ..Default::default()
        };
        let sent = block_on(&self.runtime, async {
            // A stream that already captures the subject (the user's own) is used as it is.
            if ensure && js.stream_by_subject(subject.to_string()).await.is_err() {
                js.get_or_create_stream(wanted).await.map_err(|e| format!("cannot create or find JetStream stream {stream_name} for {subject}: {e}"))?;
            }
            // The events' own send and PubAck wait: the same timeouts, the same max_payload check.
            let max_payload = self.client.server_info().max_payload;
            let mut acks = Vec::new();
            for (n, body) in bodies.iter().enumerate() {
                let mut headers = HeaderMap::new();
                for (name, value) in extra {
                    headers.insert(*name, value.as_str());
                }
                let id = format!("{msg_id}/{n}");
                acks.push(send(&js, timeout, max_payload, headers, subject.to_string(), &id, Bytes::from(body.clone())).await);
            }
            for sent in acks {
                match acknowledged(sent, timeout).await {
                    Outcome::Delivered { .. } => {}
                    Outcome::RowFailed(e) | Outcome::Undeliverable(e) | Outcome::SinkFailed { error: e, .. } => {
                        return Err(format!("tile list on {subject}: {e}"));
                    }
                    Outcome::NotTried => return Err(format!("tile list on {subject}: not sent")),
                }
            }
            Ok::<_, String>(())
        });
        if sent.is_ok() {
            self.tile_streams.insert(stream_name.to_string());
        }
        Some(sent)
    }

    fn max_message_bytes(&self) -> Option<usize> {
        Some(self.client.server_info().max_payload)
    }

    fn notice(&self) -> Option<String> {
        self.limits_differ.clone()
    }

    /// First the client's own view of its connection (async-nats `Client::connection_state`): a lost
    /// connection, which the client may be retrying, at once. Then a round trip, since a server that
    /// hangs keeps the connection open and the state says Connected: JetStream's info of the
    /// events' stream (the request the connect makes, so any account that relays may make it),
    /// answered within `deadline`. (`Client::flush` only empties the client's write buffer into the
    /// socket; it waits for no answer.)
    fn health(&self, deadline: Duration) -> Option<Result<(), String>> {
        let state = self.client.connection_state();
        if !matches!(state, async_nats::connection::State::Connected) {
            return Some(Err(format!("the NATS connection is lost (client state: {state})")));
        }
        // The timer is made inside the runtime: tokio's timers need one.
        let answer = block_on(&self.runtime, async { tokio::time::timeout(deadline, self.js.get_stream(&self.stream)).await });
        Some(match answer {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("NATS: JetStream stream {} info failed: {e}", self.stream)),
            Err(_) => Err(format!(
                "NATS did not answer within {} ms (JetStream stream {} info): the server hangs or the network drops its packets",
                deadline.as_millis(),
                self.stream
            )),
        })
    }
}

/// Everything the runtime's thread needs to send a batch, owned: no Postgres call is made there.
struct Sender {
    js: jetstream::Context,
    timeout: Duration,
    max_payload: usize,
    prefix: String,
    legacy: bool,
    resolutions: Vec<u8>,
    envelope: Envelope,
    source: Source,
}

impl Sender {
    /// Sends each row's event (and departure notice), in chunks, and returns each row's outcome.
    /// After a sink-level failure the rest is not tried.
    async fn send_all(self, outgoing: Vec<(Row, Result<Bytes, Outcome>)>) -> Vec<Outcome> {
        let (js, timeout, max_payload) = (&self.js, self.timeout, self.max_payload);
        let mut done = Vec::with_capacity(outgoing.len());
        let mut in_flight = Vec::new();
        for chunk in outgoing.chunks(IN_FLIGHT) {
            if !in_flight.is_empty() {
                done.extend(acknowledge_all(std::mem::take(&mut in_flight), timeout).await);
            }
            if done.iter().any(|o| matches!(o, Outcome::SinkFailed { .. })) {
                done.extend(chunk.iter().map(|_| Outcome::NotTried));
                continue;
            }
            for (row, body) in chunk {
                let body = match body {
                    Ok(body) => body,
                    Err(outcome) => {
                        in_flight.push((Err(outcome.clone()), None));
                        continue;
                    }
                };
                let subjects = match subjects::of(&self.prefix, self.legacy, &self.resolutions, row) {
                    Ok(s) => s,
                    Err(e) => {
                        in_flight.push((Err(Outcome::RowFailed(e)), None));
                        continue;
                    }
                };
                let headers = |message| headers(self.envelope, &self.source, &self.prefix, row, message);
                let event = send(js, timeout, max_payload, headers(Message::Event), subjects.event, &row.event_id, body.clone()).await;
                // The departure notice goes out beside the event, under its own message id, so
                // that dedup keeps one of each; the row counts as delivered only with both PubAcks.
                let departed = match (&event, subjects.departed) {
                    (Ok(_), Some(subject)) => {
                        let id = subjects::departed_id(&row.event_id);
                        Some(send(js, timeout, max_payload, headers(Message::Departed), subject, &id, body.clone()).await)
                    }
                    _ => None,
                };
                in_flight.push((event, departed));
            }
        }
        done.extend(acknowledge_all(in_flight, timeout).await);
        done
    }
}

/// A sent message's PubAck to come, or the row's outcome when it was not sent.
type Sent = Result<jetstream::context::PublishAckFuture, Outcome>;

/// Each row's outcome: delivered only with the PubAck of its event and, if any, of its departure.
async fn acknowledge_all(in_flight: Vec<(Sent, Option<Sent>)>, timeout: Duration) -> Vec<Outcome> {
    let acks = in_flight.into_iter().map(|(event, departed)| async move {
        let event = acknowledged(event, timeout).await;
        match departed {
            Some(departed) if matches!(event, Outcome::Delivered { .. }) => match acknowledged(departed, timeout).await {
                Outcome::Delivered { .. } => event,
                failed => failed,
            },
            _ => event,
        }
    });
    join_all(acks).await
}

impl NatsSink {
    /// Puts the row's GeoJSON geometry into the object bucket, named by event_id, and returns the
    /// event that refers to it. Failing to store is sink-level.
    ///
    /// The object of an event is written once. A republished event (after a crash between publish
    /// and mark, or a lost PubAck) reuses the object and its geometry_version, kept in the object's
    /// metadata, even when the feature changed since: the first publish may already be in the stream
    /// (JetStream drops the copy as a duplicate), and its geometry_ref must keep naming its geometry.
    fn store_geometry(&mut self, row: &Row, relayed_at: &str, max_payload: usize) -> Result<Vec<u8>, Outcome> {
        let sink_failed = |error: String| Outcome::SinkFailed { error, retry_after: None };
        let (js, bucket, timeout) = (&self.js, &self.bucket, self.timeout);
        let objects = match &self.objects {
            Some(objects) => objects.clone(),
            None => {
                let found = block_on(&self.runtime, async {
                    match tokio::time::timeout(timeout, js.get_object_store(&bucket.bucket)).await {
                        Ok(Ok(store)) => Ok(store),
                        _ => tokio::time::timeout(timeout, js.create_object_store(bucket.clone()))
                            .await
                            .map_err(|_| "timed out".to_string())
                            .and_then(|r| r.map_err(|e| e.to_string())),
                    }
                });
                let store = found.map_err(|e| sink_failed(format!("cannot create or find object bucket {}: {e}", bucket.bucket)))?;
                self.objects = Some(store.clone());
                store
            }
        };
        let existing = block_on(&self.runtime, async { tokio::time::timeout(timeout, objects.info(&row.event_id)).await });
        let stored_version = |info: &object_store::ObjectInfo| info.metadata.get(VERSION_KEY).and_then(|v| v.parse::<i32>().ok());
        if let Ok(Ok(info)) = &existing
            && !info.deleted
            && let Some(version) = stored_version(info)
        {
            let reference = GeometryRef { bucket: self.bucket.bucket.clone(), name: row.event_id.clone(), size: info.size };
            let as_stored = Row { geometry_version: Some(version), ..row.clone() };
            return event::to_json_by_ref(&self.source, &as_stored, relayed_at, &reference).map_err(Outcome::RowFailed);
        }
        let object = match event::geometry_json(row) {
            Ok(Some(object)) => object,
            Ok(None) => return Err(Outcome::RowFailed("event exceeds max_payload without a geometry".into())),
            Err(e) => return Err(Outcome::RowFailed(format!("cannot build the event: {e}"))),
        };
        // Chunks are acknowledged one by one; allow one publish_timeout per MiB, at least one.
        let budget = timeout * (1 + (object.len() >> 20) as u32);
        // Each chunk is one message: keep it under max_payload (the library's default is 128 KiB).
        let meta = object_store::ObjectMetadata {
            name: row.event_id.clone(),
            chunk_size: Some(max_payload.saturating_sub(HEADER_ROOM).clamp(256, 128 * 1024)),
            metadata: [(VERSION_KEY.to_string(), row.geometry_version.unwrap_or_default().to_string())].into(),
            ..Default::default()
        };
        let put = block_on(&self.runtime, async { tokio::time::timeout(budget, objects.put(meta, &mut object.as_slice())).await });
        match put {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(sink_failed(format!("cannot store the geometry in object bucket {}: {e}", self.bucket.bucket))),
            Err(_) => return Err(sink_failed(format!("storing the geometry in object bucket {} timed out", self.bucket.bucket))),
        }
        let reference = GeometryRef { bucket: self.bucket.bucket.clone(), name: row.event_id.clone(), size: object.len() };
        event::to_json_by_ref(&self.source, row, relayed_at, &reference).map_err(Outcome::RowFailed)
    }
}

/// Object metadata key holding the geometry_version of the geometry an object holds.
const VERSION_KEY: &str = "geometry_version";

/// Room for the headers next to an event's body in one message.
const HEADER_ROOM: usize = 256;

fn too_large(body: usize, max_payload: usize) -> bool {
    body + HEADER_ROOM > max_payload
}

/// Describes how an existing stream's limits differ from the settings; None when they agree.
/// The relay never changes a stream it did not just create: its owner may have chosen the limits.
fn limits_note(wanted: &stream::Config, have: &stream::Config) -> Option<String> {
    let mut differ = Vec::new();
    if have.max_age != wanted.max_age {
        differ.push(format!("max_age {} s (feature_outbox.nats_max_age {} s)", have.max_age.as_secs(), wanted.max_age.as_secs()));
    }
    if have.duplicate_window != wanted.duplicate_window {
        differ.push(format!(
            "duplicate_window {} s (feature_outbox.nats_duplicate_window {} s)",
            have.duplicate_window.as_secs(),
            wanted.duplicate_window.as_secs()
        ));
    }
    if have.num_replicas != wanted.num_replicas {
        differ.push(format!("replicas {} (feature_outbox.nats_replicas {})", have.num_replicas, wanted.num_replicas));
    }
    (!differ.is_empty()).then(|| format!("JetStream stream {} exists with other limits, left as they are: {}", have.name, differ.join(", ")))
}

/// async-nats holds at most 5,000 PubAcks in flight and then waits for a free slot; chunks stay
/// well under that, so a large batch_size can never wait on itself.
const IN_FLIGHT: usize = 1000;

/// Waits for one message's PubAck, at most publish_timeout.
async fn acknowledged(sent: Sent, timeout: Duration) -> Outcome {
    match sent {
        Err(outcome) => outcome,
        Ok(ack) => match tokio::time::timeout(timeout, ack).await {
            Ok(Ok(ack)) => Outcome::Delivered { duplicate: ack.duplicate },
            Ok(Err(e)) => Outcome::SinkFailed { error: format!("no PubAck: {e}"), retry_after: None },
            Err(_) => Outcome::SinkFailed { error: "no PubAck within feature_outbox.publish_timeout".into(), retry_after: None },
        },
    }
}

/// Sends one message with `headers` on `subject` with `Nats-Msg-Id` `msg_id`; Err is the row's
/// outcome when it was not sent.
async fn send(
    js: &jetstream::Context,
    timeout: Duration,
    max_payload: usize,
    headers: HeaderMap,
    subject: String,
    msg_id: &str,
    body: Bytes,
) -> Result<jetstream::context::PublishAckFuture, Outcome> {
    if too_large(body.len(), max_payload) {
        return Err(Outcome::RowFailed(format!(
            "event of {} bytes exceeds the NATS server's max_payload of {max_payload} bytes",
            body.len()
        )));
    }
    let message = jetstream::message::PublishMessage::build()
        .payload(body)
        .headers(headers)
        .message_id(msg_id);
    match tokio::time::timeout(timeout, js.send_publish(subject, message)).await {
        Ok(Ok(ack)) => Ok(ack),
        Ok(Err(e)) if e.kind() == PublishErrorKind::MaxPayloadExceeded => Err(Outcome::RowFailed(e.to_string())),
        Ok(Err(e)) => Err(Outcome::SinkFailed { error: format!("publish: {e}"), retry_after: None }),
        Err(_) => Err(Outcome::SinkFailed { error: "publish not accepted within feature_outbox.publish_timeout".into(), retry_after: None }),
    }
}

/// This project's headers of one message of `row`, then the trace context and, under the
/// cloudevents envelope, the CloudEvents attributes (src/cloudevents.rs).
fn headers(envelope: Envelope, source: &Source, prefix: &str, row: &Row, message: Message) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Feature-Id", row.key().as_str());
    h.insert("Feature-Version", row.feature_version.to_string().as_str());
    h.insert(cloudevents::ORIGIN_HEADER, row.origin.as_str());
    h.insert(cloudevents::DATABASE_HEADER, cloudevents::database_header_value(&source.database).as_str());
    h.insert(cloudevents::DATABASE_ID_HEADER, source.database_id.as_str());
    if let Some(prev) = &row.previous_routing_key {
        h.insert("Previous-Routing-Key", prev.as_str());
    }
    for (name, value) in cloudevents::headers(envelope, Binding::Nats, source, prefix, row, message) {
        h.insert(name, value.as_str());
    }
    h
}


/// `runtime.block_on(f)` with this thread's signals blocked, so that any thread the runtime starts
/// meanwhile inherits them blocked (signals.rs).
fn block_on<F: std::future::Future>(runtime: &tokio::runtime::Runtime, f: F) -> F::Output {
    crate::signals::blocked(|| runtime.block_on(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_out_of_the_url() {
        assert_eq!(split_credentials("nats://a:b@h:4222"), (Some(("a".into(), Some("b".into()))), "nats://h:4222".into()));
        assert_eq!(split_credentials("tls://tok@h:4222"), (Some(("tok".into(), None)), "tls://h:4222".into()));
        assert_eq!(split_credentials("nats://h:4222"), (None, "nats://h:4222".into()));
    }

    /// A server on a free local port: `greeting` sends that on each connection; None accepts
    /// connections (the kernel does, into the backlog) and says nothing, as a SIGSTOPped server.
    fn server(greeting: Option<&'static [u8]>) -> (std::net::TcpListener, String) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("nats://127.0.0.1:{}", listener.local_addr().unwrap().port());
        if let Some(greeting) = greeting {
            let l = listener.try_clone().unwrap();
            std::thread::spawn(move || {
                for mut conn in l.incoming().flatten() {
                    use std::io::Write;
                    let _ = conn.write_all(greeting);
                }
            });
        }
        (listener, url)
    }

    #[test]
    fn a_server_answers_only_when_it_greets_a_fresh_connection_with_info() {
        const WAIT: Duration = Duration::from_millis(300);
        let (_nats, nats) = server(Some(b"INFO {\"server_id\":\"x\"}\r\n"));
        assert!(answers(&nats, WAIT));
        let (_silent, silent) = server(None);
        let start = Instant::now();
        assert!(!answers(&silent, WAIT), "a hung server accepts TCP and says nothing");
        assert!(start.elapsed() < WAIT + Duration::from_millis(200), "the wait is bounded: {:?}", start.elapsed());
        let (_http, http) = server(Some(b"HTTP/1.1 400 Bad Request\r\n"));
        assert!(!answers(&http, WAIT), "something else on the port is no NATS server");
        let closed = {
            let (listener, url) = server(None);
            drop(listener);
            url
        };
        assert!(!answers(&closed, WAIT));
        // Of a cluster, the first to answer counts; a silent one does not hold the others up.
        let start = Instant::now();
        assert!(answers(&format!("{silent}, {closed},{nats}"), WAIT));
        assert!(start.elapsed() < WAIT, "{:?}", start.elapsed());
    }

    #[test]
    fn probes_go_to_host_and_port_without_credentials() {
        assert_eq!(probe_address("nats://u:p@h:4333"), "h:4333");
        assert_eq!(probe_address("tls://token@nats.example"), "nats.example:4222");
        assert_eq!(probe_address("127.0.0.1:4223/"), "127.0.0.1:4223");
    }

    #[test]
    fn differing_stream_limits_are_named() {
        let wanted = stream::Config { name: "FEATURES".into(), max_age: Duration::from_secs(604800), duplicate_window: Duration::from_secs(600), num_replicas: 1, ..Default::default() };
        assert_eq!(limits_note(&wanted, &wanted.clone()), None);
        let have = stream::Config { max_age: Duration::ZERO, ..wanted.clone() };
        assert_eq!(
            limits_note(&wanted, &have).unwrap(),
            "JetStream stream FEATURES exists with other limits, left as they are: max_age 0 s (feature_outbox.nats_max_age 604800 s)"
        );
    }
}
