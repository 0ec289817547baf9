//! HTTP webhook sink (ureq, rustls): POSTs with the Standard Webhooks headers over pooled keep-alive
//! connections, up to feature_outbox.http_concurrency at once, each carrying one event or, with
//! feature_outbox.http_batch above 1, a JSON array of up to that many. Only 2xx counts as delivered,
//! for every event of the request; redirects are never followed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use ureq::Agent;
use ureq::http::Uri;
use ureq::tls::{RootCerts, TlsConfig};
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use super::{Outcome, Sink, SinkConfig};
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
    source: crate::event::Source,
    prefix: String,
    concurrency: usize,
    batch: usize,
}

/// One POST: the rows it carries (indices into the publish call's rows) and its body.
struct Request {
    rows: Vec<usize>,
    body: Vec<u8>,
}

/// How long a host's addresses are kept (see KeptAddresses).
const ADDRESSES_KEPT: Duration = Duration::from_secs(1);

/// ureq looks the host up on every request, before it takes a kept-alive connection from its pool,
/// and, with a timeout set, does so on a thread it starts for the lookup: one thread per webhook
/// request (strace of a 100,000-event drain: 100,100 clone3 calls). This resolver keeps each host's
/// addresses for ADDRESSES_KEPT, so a host is looked up at most once a second and a DNS change is
/// followed within a second. The lookup itself stays ureq's, with its timeout.
#[derive(Debug, Default)]
struct KeptAddresses {
    lookup: DefaultResolver,
    kept: Mutex<HashMap<String, (Instant, ResolvedSocketAddrs)>>,
}

impl Resolver for KeptAddresses {
    fn resolve(&self, uri: &Uri, config: &ureq::config::Config, timeout: NextTimeout) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let key = (uri.scheme().zip(uri.authority()))
            .and_then(|(scheme, authority)| DefaultResolver::host_and_port(scheme, authority))
            .unwrap_or_else(|| uri.to_string());
        if let Some((at, addresses)) = self.kept.lock().unwrap_or_else(|e| e.into_inner()).get(&key)
            && at.elapsed() < ADDRESSES_KEPT
        {
            return Ok(addresses.clone());
        }
        let addresses = self.lookup.resolve(uri, config, timeout)?;
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|_, (at, _)| at.elapsed() < ADDRESSES_KEPT);
        kept.insert(key, (Instant::now(), addresses.clone()));
        Ok(addresses)
    }
}

impl HttpSink {
    pub fn new(config: &SinkConfig) -> Result<HttpSink, String> {
        let tls = tls_config(config.tls_ca_file.as_deref())?;
        let concurrency = config.http_concurrency.max(1);
        let agent_config = Agent::config_builder()
            .timeout_global(Some(config.publish_timeout))
            .max_redirects(0)
            .max_redirects_will_error(false)
            .http_status_as_error(false)
            .tls_config(tls)
            .user_agent("feature_outbox relay")
            // One kept-alive connection per request in flight (ureq keeps 3 per host by default).
            .max_idle_connections(concurrency.max(10))
            .max_idle_connections_per_host(concurrency)
            .build();
        let agent = Agent::with_parts(agent_config, DefaultConnector::default(), KeptAddresses::default());
        let shown_url = crate::settings::redact_urls(config.endpoint.split('?').next().unwrap_or_default());
        let secret = match &config.http_secret_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map(|s| s.trim().to_string())
                    .map_err(|e| format!("feature_outbox.http_secret_file \"{path}\": {e}"))?,
            ),
            None => config.http_secret.clone(),
        };
        Ok(HttpSink {
            agent,
            url: config.endpoint.clone(),
            shown_url,
            secret,
            timeout: config.publish_timeout,
            max_body: config.http_max_body,
            envelope: config.envelope,
            source: config.source.clone(),
            prefix: config.subject_prefix.clone(),
            concurrency,
            batch: config.http_batch.max(1),
        })
    }

    /// Sends the rows, which belong to distinct features (the relay's rounds see to that), so any
    /// order is per-feature order. Up to `concurrency` requests are in flight on other threads while
    /// `meanwhile` runs on this one; after a sink-level failure, and once one publish_timeout has
    /// passed, no further request starts, so the claiming transaction stays short even with a slow
    /// receiver. The rows not tried are claimed again by the next batch.
    fn publish_while(&mut self, rows: &[Row], bodies: &[&[u8]], meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
        let deadline = Instant::now() + self.timeout;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; rows.len()];
        let requests = self.requests(rows, bodies, &mut outcomes);
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let done: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::with_capacity(requests.len()));
        let work = || {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(request) = requests.get(i) else { break };
                let outcome = if stop.load(Ordering::Relaxed) || Instant::now() > deadline {
                    Outcome::NotTried
                } else {
                    self.post(rows, request)
                };
                if matches!(outcome, Outcome::SinkFailed { .. }) {
                    stop.store(true, Ordering::Relaxed);
                }
                done.lock().unwrap_or_else(|e| e.into_inner()).push((i, outcome));
            }
        };
        // A thread that cannot be started only means fewer in flight; with none, this one sends.
        let threads = self.concurrency.min(requests.len());
        std::thread::scope(|scope| {
            let started = crate::signals::blocked(|| {
                (0..threads).filter(|_| std::thread::Builder::new().name("feature_outbox http".into()).spawn_scoped(scope, work).is_ok()).count()
            });
            meanwhile();
            if started == 0 {
                work();
            }
        });
        for (i, outcome) in done.into_inner().unwrap_or_else(|e| e.into_inner()) {
            for &row in &requests[i].rows {
                outcomes[row] = Some(outcome.clone());
            }
        }
        outcomes.into_iter().map(|o| o.unwrap_or(Outcome::NotTried)).collect()
    }

    /// Groups the rows into requests of up to `batch` events and max_body bytes, in order. A row that
    /// failed before goes alone, so that a refused batch is retried event by event and only the
    /// event the receiver refuses is parked. An event over max_body, as it would be sent (in an
    /// array, as a structured CloudEvent), is Undeliverable.
    fn requests(&self, rows: &[Row], bodies: &[&[u8]], outcomes: &mut [Option<Outcome>]) -> Vec<Request> {
        let mut requests = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let mut open_body: Vec<u8> = Vec::new();
        let flush = |open: &mut Vec<usize>, body: &mut Vec<u8>, requests: &mut Vec<Request>| {
            if !open.is_empty() {
                body.push(b']');
                requests.push(Request { rows: std::mem::take(open), body: std::mem::take(body) });
            }
        };
        for (i, (row, body)) in rows.iter().zip(bodies).enumerate() {
            let member = self.member(row, body);
            // `[`, `]` around a batch's members.
            let size = if self.batch > 1 { member.len() + 2 } else { member.len() };
            if size > self.max_body {
                outcomes[i] = Some(Outcome::Undeliverable(format!(
                    "event of {size} bytes exceeds feature_outbox.http_max_body ({} bytes)",
                    self.max_body
                )));
                continue;
            }
            if self.batch == 1 {
                requests.push(Request { rows: vec![i], body: member.into_owned() });
                continue;
            }
            let alone = row.row_failures > 0;
            if alone || open.len() == self.batch || open_body.len() + 1 + member.len() + 1 > self.max_body {
                flush(&mut open, &mut open_body, &mut requests);
            }
            open_body.push(if open.is_empty() { b'[' } else { b',' });
            open_body.extend_from_slice(&member);
            open.push(i);
            if alone {
                flush(&mut open, &mut open_body, &mut requests);
            }
        }
        flush(&mut open, &mut open_body, &mut requests);
        requests
    }

    /// How one event goes into a request: its body alone, or as a member of a batch (itself under
    /// native; a structured CloudEvent, the JSON batch format, under cloudevents).
    fn member<'a>(&self, row: &Row, body: &'a [u8]) -> std::borrow::Cow<'a, [u8]> {
        match self.envelope {
            // The event JSON was built by this relay, so it always parses back.
            Envelope::CloudEvents if self.batch > 1 => {
                std::borrow::Cow::Owned(cloudevents::structured(&self.source, &self.prefix, row, body).unwrap_or_default())
            }
            _ => std::borrow::Cow::Borrowed(body),
        }
    }

    fn post(&self, rows: &[Row], request: &Request) -> Outcome {
        let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        let batched = self.batch > 1;
        let first = &rows[request.rows[0]];
        // A batch's id names exactly its events, so a receiver that drops a repeated webhook-id
        // drops only a true repeat, never a batch of other events.
        let id = if batched { batch_id(request.rows.iter().map(|&i| rows[i].event_id.as_str())) } else { first.event_id.clone() };
        let content_type = if batched && self.envelope == Envelope::CloudEvents { "application/cloudevents-batch+json" } else { "application/json" };
        let mut request_builder = self
            .agent
            .post(&self.url)
            .header("Content-Type", content_type)
            .header("webhook-id", &id)
            .header("Idempotency-Key", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header(cloudevents::DATABASE_HEADER, cloudevents::database_header_value(&self.source.database))
            .header(cloudevents::DATABASE_ID_HEADER, &self.source.database_id);
        // Like the trace context below, one origin for the request only when its events share it.
        if request.rows.iter().all(|&i| rows[i].origin == first.origin) {
            request_builder = request_builder.header(cloudevents::ORIGIN_HEADER, &first.origin);
        }
        // A batch has one trace context when its events share it; under cloudevents each event
        // carries its own as attributes.
        let shared_trace = || request.rows.iter().all(|&i| rows[i].traceparent == first.traceparent && rows[i].tracestate == first.tracestate);
        let envelope = match (batched, self.envelope) {
            (false, envelope) => Some(envelope),
            (true, Envelope::Native) if shared_trace() => Some(Envelope::Native),
            (true, _) => None,
        };
        for (name, value) in envelope.map(|e| cloudevents::headers(e, Binding::Http, &self.source, &self.prefix, first, Message::Event)).unwrap_or_default() {
            request_builder = request_builder.header(name, value);
        }
        if let Some(secret) = &self.secret {
            match webhook_signature(secret, &id, timestamp, &request.body) {
                Ok(sig) => request_builder = request_builder.header("webhook-signature", sig),
                Err(e) => return Outcome::SinkFailed { error: e, retry_after: None },
            }
        }
        match request_builder.send(&request.body[..]) {
            Err(e) => Outcome::SinkFailed { error: format!("POST {}: {e}", self.shown_url), retry_after: None },
            Ok(mut response) => {
                let status = response.status().as_u16();
                let retry_after = retry_after(response.headers());
                let location = response.headers().get("location").and_then(|v| v.to_str().ok()).map(str::to_owned);
                // Read the body so the connection can be reused; keep a little of it for last_error.
                let text = response.body_mut().with_config().limit(64 * 1024).read_to_string().unwrap_or_default();
                let snippet: String = text.chars().take(200).collect();
                let of = match request.rows.len() {
                    _ if !batched => String::new(),
                    1 => " (a batch of 1 event)".to_string(),
                    n => format!(" (a batch of {n} events)"),
                };
                match status {
                    200..=299 => Outcome::Delivered { duplicate: false },
                    300..=399 => Outcome::SinkFailed {
                        error: format!(
                            "HTTP {status} redirect to {} not followed; point feature_outbox.endpoint at the final URL",
                            location.as_deref().unwrap_or("?")
                        ),
                        retry_after: None,
                    },
                    408 | 429 | 500..=599 => Outcome::SinkFailed { error: format!("HTTP {status}{of}: {snippet}"), retry_after },
                    _ => Outcome::RowFailed(format!("HTTP {status}{of}: {snippet}")),
                }
            }
        }
    }
}

impl Sink for HttpSink {
    fn send(&mut self, rows: &[Row], bodies: &[&[u8]], _relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
        self.publish_while(rows, bodies, meanwhile)
    }
}

/// `batch_` and the first 32 hex digits of SHA-256 over the batch's event ids, comma-separated.
/// A response's `Retry-After` in seconds (RFC 9110, 10.2.3; an HTTP-date is not read): how long a
/// receiver or cache that answered 429 or 503 asks the relay to wait, at least.
pub fn retry_after(headers: &ureq::http::HeaderMap) -> Option<Duration> {
    headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok()).map(Duration::from_secs)
}

/// TLS for the relay's HTTP requests: the system's roots, or feature_outbox.tls_ca_file's
/// certificates (a private CA) instead.
pub fn tls_config(ca_file: Option<&str>) -> Result<TlsConfig, String> {
    let mut tls = TlsConfig::builder();
    if let Some(path) = ca_file {
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
    Ok(tls.build())
}

fn batch_id<'a>(ids: impl Iterator<Item = &'a str>) -> String {
    let mut hash = Sha256::new();
    for (n, id) in ids.enumerate() {
        if n > 0 {
            hash.update(b",");
        }
        hash.update(id.as_bytes());
    }
    let hex: String = hash.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("batch_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::row;

    #[test]
    fn a_host_is_looked_up_again_only_after_its_addresses_were_kept_a_second() {
        let resolver = KeptAddresses::default();
        let config = Agent::config_builder().build();
        let timeout = || NextTimeout { after: Duration::from_secs(1).into(), reason: ureq::Timeout::Resolve, per_read: None, per_write: None };
        // .invalid never resolves (RFC 6761): an answer for it can only come from what was kept.
        let uri: Uri = "https://hooks.example.invalid/hook".parse().unwrap();
        let mut addresses = resolver.empty();
        addresses.push("192.0.2.7:443".parse().unwrap());
        resolver.kept.lock().unwrap().insert("hooks.example.invalid:443".into(), (Instant::now(), addresses));
        let got = resolver.resolve(&uri, &config, timeout()).expect("the kept addresses");
        assert_eq!(got.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["192.0.2.7:443"]);
        // Kept for longer than ADDRESSES_KEPT: the name is looked up again, and a DNS change is seen.
        resolver.kept.lock().unwrap().get_mut("hooks.example.invalid:443").unwrap().0 = Instant::now() - ADDRESSES_KEPT;
        assert!(resolver.resolve(&uri, &config, timeout()).is_err());
        // An address literal needs no name service; its answer is kept like any other.
        let local: Uri = "http://127.0.0.1:9/hook".parse().unwrap();
        let got = resolver.resolve(&local, &config, timeout()).expect("a literal");
        assert_eq!(got.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["127.0.0.1:9"]);
        assert!(resolver.kept.lock().unwrap().contains_key("127.0.0.1:9"));
    }

    fn sink(batch: usize, max_body: usize) -> HttpSink {
        let mut config = crate::sinks::test_config("http://127.0.0.1:9/hook");
        config.http_max_body = max_body;
        config.http_batch = batch;
        HttpSink::new(&config).unwrap()
    }

    fn refs(bodies: &[Vec<u8>]) -> Vec<&[u8]> {
        bodies.iter().map(Vec::as_slice).collect()
    }

    fn batch_of(n: usize) -> (Vec<Row>, Vec<Vec<u8>>) {
        let rows: Vec<Row> = (0..n).map(|i| Row { id: i as i64, event_id: format!("e{i}"), feature_id: i as i64, ..row() }).collect();
        let bodies = rows.iter().map(|r| format!(r#"{{"event_id":"{}"}}"#, r.event_id).into_bytes()).collect();
        (rows, bodies)
    }

    #[test]
    fn requests_hold_up_to_http_batch_events_and_a_row_that_failed_goes_alone() {
        let (mut rows, bodies) = batch_of(7);
        rows[3].row_failures = 1;
        let s = sink(2, 1 << 20);
        let mut outcomes = vec![None; rows.len()];
        let requests = s.requests(&rows, &refs(&bodies), &mut outcomes);
        let groups: Vec<Vec<usize>> = requests.iter().map(|r| r.rows.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2], vec![3], vec![4, 5], vec![6]]);
        let v: serde_json::Value = serde_json::from_slice(&requests[0].body).unwrap();
        assert_eq!(v, serde_json::json!([{"event_id": "e0"}, {"event_id": "e1"}]));
        assert!(outcomes.iter().all(Option::is_none));
    }

    #[test]
    fn a_batch_stays_under_http_max_body_and_an_event_over_it_is_undeliverable() {
        let (rows, mut bodies) = batch_of(4);
        bodies[2] = vec![b' '; 100];
        let each = bodies[0].len();
        // Two events in an array: `[`, one comma, `]`.
        let s = sink(100, 2 * each + 3);
        let mut outcomes = vec![None; rows.len()];
        let requests = s.requests(&rows, &refs(&bodies), &mut outcomes);
        assert!(matches!(outcomes[2], Some(Outcome::Undeliverable(_))));
        let groups: Vec<Vec<usize>> = requests.iter().map(|r| r.rows.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![3]]);
        assert!(requests.iter().all(|r| r.body.len() <= 2 * each + 3));
    }

    #[test]
    fn unbatched_bodies_are_the_event_itself() {
        let (rows, bodies) = batch_of(2);
        let mut outcomes = vec![None; rows.len()];
        let requests = sink(1, 1 << 20).requests(&rows, &refs(&bodies), &mut outcomes);
        assert_eq!(requests.iter().map(|r| r.body.clone()).collect::<Vec<_>>(), bodies);
    }

    #[test]
    fn a_batch_id_names_its_events() {
        let a = batch_id(["e1", "e2"].into_iter());
        assert_eq!(a, batch_id(["e1", "e2"].into_iter()));
        assert_ne!(a, batch_id(["e1", "e3"].into_iter()));
        assert_ne!(a, batch_id(["e1,e2"].into_iter().chain(["x"])));
        assert_eq!(a.len(), "batch_".len() + 32);
    }
}
