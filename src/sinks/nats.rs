//! NATS JetStream sink (async-nats): publishes a batch with all PubAcks in flight at once, and marks
//! a row only after its PubAck. `Nats-Msg-Id` carries the event_id, so JetStream drops a republished
//! event inside the stream's duplicate window (NATS docs, "JetStream: Message Deduplication").

use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, stream};
use async_nats::{Client, ConnectOptions, HeaderMap};
use futures::future::join_all;
use tokio::runtime::Runtime;

use super::{Outcome, SinkConfig};
use crate::event::Row;

pub struct NatsSink {
    runtime: Runtime,
    client: Client,
    js: jetstream::Context,
    prefix: String,
    timeout: Duration,
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

impl NatsSink {
    pub fn connect(config: &SinkConfig, client_name: &str) -> Result<NatsSink, String> {
        // A multi-thread runtime with one worker keeps the connection serviced while the relay
        // sleeps on its latch (a current-thread runtime would not run between block_on calls).
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start the NATS runtime: {e}"))?;
        let mut options = ConnectOptions::new()
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
        let timeout = config.publish_timeout;
        let (client, js) = runtime.block_on(async {
            let client = tokio::time::timeout(timeout, options.connect(addresses.as_slice()))
                .await
                .map_err(|_| "timed out connecting to NATS".to_string())?
                .map_err(|e| format!("cannot connect to NATS: {e}"))?;
            let mut js = jetstream::new(client.clone());
            js.set_timeout(timeout);
            js.get_or_create_stream(stream::Config {
                name: config.stream.clone(),
                subjects: vec![format!("{}.>", config.subject_prefix)],
                duplicate_window: config.duplicate_window,
                num_replicas: config.replicas,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("cannot create or find JetStream stream {}: {e}", config.stream))?;
            Ok::<_, String>((client, js))
        })?;
        Ok(NatsSink { runtime, client, js, prefix: config.subject_prefix.clone(), timeout })
    }

    /// Publishes in chunks of at most IN_FLIGHT messages, each chunk sent at once and its PubAcks
    /// awaited together. Every await is bounded by publish_timeout, so a stalled server costs one
    /// timeout, never a stuck transaction. After a sink-level failure the rest is not tried.
    pub fn publish(&mut self, rows: &[Row], bodies: &[Vec<u8>]) -> Vec<Outcome> {
        let max_payload = self.client.server_info().max_payload;
        let (js, prefix, timeout) = (&self.js, &self.prefix, self.timeout);
        self.runtime.block_on(async {
            let mut outcomes = Vec::with_capacity(rows.len());
            for (rows, bodies) in rows.chunks(IN_FLIGHT).zip(bodies.chunks(IN_FLIGHT)) {
                if outcomes.iter().any(|o| matches!(o, Outcome::SinkFailed { .. })) {
                    outcomes.extend(rows.iter().map(|_| Outcome::NotTried));
                    continue;
                }
                let mut pending = Vec::with_capacity(rows.len());
                for (row, body) in rows.iter().zip(bodies) {
                    pending.push(send(js, prefix, timeout, max_payload, row, body).await);
                }
                let acks = pending.into_iter().map(|p| async move {
                    match p {
                        Err(outcome) => outcome,
                        Ok(ack) => match tokio::time::timeout(timeout, ack).await {
                            Ok(Ok(ack)) => Outcome::Delivered { duplicate: ack.duplicate },
                            Ok(Err(e)) => Outcome::SinkFailed { error: format!("no PubAck: {e}"), retry_after: None },
                            Err(_) => Outcome::SinkFailed { error: "no PubAck within feature_outbox.publish_timeout".into(), retry_after: None },
                        },
                    }
                });
                outcomes.extend(join_all(acks).await);
            }
            outcomes
        })
    }
}

/// async-nats holds at most 5,000 PubAcks in flight and then waits for a free slot; chunks stay
/// well under that, so a large batch_size can never wait on itself.
const IN_FLIGHT: usize = 1000;

/// Sends one event; Err is the row's outcome when it was not sent.
async fn send(
    js: &jetstream::Context,
    prefix: &str,
    timeout: Duration,
    max_payload: usize,
    row: &Row,
    body: &[u8],
) -> Result<jetstream::context::PublishAckFuture, Outcome> {
    let subject = format!("{prefix}.{}.{}", row.event_type, row.routing_key);
    if !valid_subject(&subject) {
        return Err(Outcome::RowFailed(format!("invalid NATS subject \"{subject}\"")));
    }
    if body.len() + 256 > max_payload {
        return Err(Outcome::RowFailed(format!(
            "event of {} bytes exceeds the NATS server's max_payload of {max_payload} bytes",
            body.len()
        )));
    }
    let message = jetstream::message::PublishMessage::build()
        .payload(body.to_vec().into())
        .headers(headers(row))
        .message_id(&row.event_id);
    match tokio::time::timeout(timeout, js.send_publish(subject, message)).await {
        Ok(Ok(ack)) => Ok(ack),
        Ok(Err(e)) if e.kind() == PublishErrorKind::MaxPayloadExceeded => Err(Outcome::RowFailed(e.to_string())),
        Ok(Err(e)) => Err(Outcome::SinkFailed { error: format!("publish: {e}"), retry_after: None }),
        Err(_) => Err(Outcome::SinkFailed { error: "publish not accepted within feature_outbox.publish_timeout".into(), retry_after: None }),
    }
}

fn headers(row: &Row) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Feature-Id", row.feature_id.to_string().as_str());
    h.insert("Feature-Version", row.feature_version.to_string().as_str());
    if let Some(prev) = &row.previous_routing_key {
        h.insert("Previous-Routing-Key", prev.as_str());
    }
    h
}

/// A publish subject: dot-separated non-empty tokens, no whitespace, no wildcards.
fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| !t.is_empty() && t != "*" && t != ">" && !t.chars().any(|c| c.is_whitespace()))
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

    #[test]
    fn subjects_are_checked() {
        assert!(valid_subject("features.moved.881f1d4891fffff"));
        assert!(!valid_subject("features..x"));
        assert!(!valid_subject("my features.moved.x"));
        assert!(!valid_subject("features.>"));
    }
}
