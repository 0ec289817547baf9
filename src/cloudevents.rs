//! The headers that go with one message of an event: the writer's W3C trace context on every
//! envelope, and under `feature_outbox.envelope = cloudevents` the binary-mode CloudEvents 1.0
//! attributes (CloudEvents HTTP protocol binding 3.1.3, NATS protocol binding 3.1.3). Pure Rust.

use percent_encoding::{AsciiSet, CONTROLS, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::event::{Row, SCHEMA_VERSION, Source};
use crate::settings::Envelope;

/// What a header value must percent-encode (both bindings, 3.1.3.2): space, double quote, percent,
/// and everything outside printable ASCII (CONTROLS covers 0x00-0x1F and 0x7F; non-ASCII always is).
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// What a URI path segment must percent-encode (RFC 3986 3.3: all but unreserved, sub-delims, : and @).
const PATH_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-').remove(b'.').remove(b'_').remove(b'~')
    .remove(b'!').remove(b'$').remove(b'&').remove(b'\'').remove(b'(').remove(b')')
    .remove(b'*').remove(b'+').remove(b',').remove(b';').remove(b'=').remove(b':').remove(b'@');

/// The protocol a message goes over: they differ in where `datacontenttype` goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Binding {
    /// HTTP: `datacontenttype` is the Content-Type header, which the sink sets anyway.
    Http,
    /// NATS: `datacontenttype` is `ce-datacontenttype`; a Content-Type of application/cloudevents
    /// would mean structured mode, so none is sent.
    Nats,
    /// Kafka (Kafka protocol binding 3.2.3, binary mode): attributes as `ce_` headers, UTF-8
    /// without percent-encoding, and `datacontenttype` as the `content-type` header.
    Kafka,
}

/// Which of an event's messages: the event itself, or its departure notice (NATS only).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Message {
    Event,
    Departed,
}

/// `dataschema`: names the event body's schema version (README, "Events").
pub fn dataschema() -> String {
    format!("urn:feature-outbox:event-schema:{SCHEMA_VERSION}")
}

/// `source`: `/<database_id>/<layer>`, each a URI path segment. The database's identity, not its
/// name: a rename keeps the source, and a copy resolved as a new source gets another (CloudEvents
/// 1.0 §3.1.1: `source` + `id` identify an event).
pub fn source(database_id: &str, layer: &str) -> String {
    format!("/{}/{}", utf8_percent_encode(database_id, PATH_SEGMENT), utf8_percent_encode(layer, PATH_SEGMENT))
}

/// The CloudEvents attributes of one message of `row`, unencoded, `datacontenttype` included:
/// `from` is the database the worker serves, `prefix` feature_outbox.nats_subject_prefix, which
/// `type` starts with on both sinks.
pub fn attributes(from: &Source, prefix: &str, row: &Row, message: Message) -> Vec<(&'static str, String)> {
    let (id, event_type) = match message {
        Message::Event => (row.event_id.clone(), row.event_type.as_str()),
        Message::Departed => (crate::subjects::departed_id(&row.event_id), crate::subjects::DEPARTED),
    };
    let mut a = vec![
        ("specversion", "1.0".to_string()),
        ("id", id),
        ("source", source(&from.database_id, &row.layer)),
        ("type", format!("{prefix}.{event_type}")),
        ("subject", row.key()),
        ("time", row.occurred_at.clone()),
        ("datacontenttype", "application/json".to_string()),
        ("dataschema", dataschema()),
        // An extension attribute of this project's: where the event comes from (the body's `origin`).
        (ORIGIN_ATTRIBUTE, row.origin.clone()),
    ];
    // The Distributed Tracing extension: the writer's W3C values as CloudEvents attributes.
    a.extend(trace(row));
    a
}

/// The writer's W3C trace context of `row`: traceparent, and tracestate beside it.
fn trace(row: &Row) -> Vec<(&'static str, String)> {
    let mut t = Vec::new();
    if let Some(tp) = &row.traceparent {
        t.push(("traceparent", tp.clone()));
        if let Some(ts) = &row.tracestate {
            t.push(("tracestate", ts.clone()));
        }
    }
    t
}

/// The header that names the database whose outbox an event comes from, on NATS and HTTP alike,
/// under every envelope; the value is percent-encoded as the `ce-` headers are.
pub const DATABASE_HEADER: &str = "Feature-Outbox-Database";
/// Beside it, the database's identity (the events' `database_id`), which a rename does not change.
pub const DATABASE_ID_HEADER: &str = "Feature-Outbox-Database-Id";

/// The header that says where an event comes from, the body's `origin`, on every sink and envelope.
pub const ORIGIN_HEADER: &str = "Feature-Origin";
/// The same as a CloudEvents extension attribute: lowercase letters and digits, at most 20
/// (CloudEvents 1.0 §3.1.1), prefixed because `origin` alone could be another producer's extension.
pub const ORIGIN_ATTRIBUTE: &str = "featureorigin";

pub fn database_header_value(database: &str) -> String {
    utf8_percent_encode(database, HEADER_VALUE).to_string()
}

/// The headers of one message of `row`, in order: the W3C `traceparent` and `tracestate` (Trace
/// Context, section 3) under every envelope, then under `cloudevents` each attribute as a `ce-`
/// header, percent-encoded; on HTTP `datacontenttype` is the Content-Type the sink sets itself.
pub fn headers(envelope: Envelope, binding: Binding, from: &Source, prefix: &str, row: &Row, message: Message) -> Vec<(String, String)> {
    let mut h: Vec<(String, String)> = trace(row).into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    if envelope == Envelope::CloudEvents {
        for (name, value) in attributes(from, prefix, row, message) {
            match (binding, name) {
                (Binding::Http, "datacontenttype") => continue,
                (Binding::Kafka, "datacontenttype") => h.push(("content-type".to_string(), value)),
                (Binding::Kafka, _) => h.push((format!("ce_{name}"), value)),
                _ => h.push((format!("ce-{name}"), utf8_percent_encode(&value, HEADER_VALUE).to_string())),
            }
        }
    }
    h
}

/// One event in the structured JSON format (CloudEvents JSON event format, section 3): the
/// attributes as members, the event body as `data`. A batch of them is a JSON array.
pub fn structured(from: &Source, prefix: &str, row: &Row, body: &[u8]) -> Result<Vec<u8>, String> {
    #[derive(serde::Serialize)]
    struct Structured<'a> {
        #[serde(flatten)]
        attributes: std::collections::BTreeMap<&'static str, String>,
        data: &'a serde_json::value::RawValue,
    }
    let data: &serde_json::value::RawValue = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    serde_json::to_vec(&Structured { attributes: attributes(from, prefix, row, Message::Event).into_iter().collect(), data })
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::{row, source as src};

    fn named(database: &str) -> Source {
        Source { database: database.into(), database_id: "6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31".into() }
    }

    fn get<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn native_sends_only_the_trace_context() {
        let mut r = row();
        assert!(headers(Envelope::Native, Binding::Http, &named("db"), "features", &r, Message::Event).is_empty());
        r.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        r.tracestate = Some("congo=t61rcWkgMzE".into());
        let h = headers(Envelope::Native, Binding::Nats, &named("db"), "features", &r, Message::Event);
        assert_eq!(h, vec![("traceparent".into(), r.traceparent.clone().unwrap()), ("tracestate".into(), r.tracestate.clone().unwrap())]);
    }

    #[test]
    fn cloudevents_attributes_per_binding() {
        let mut r = row();
        r.feature_key = Some("Gate 7 \"north\" %".into());
        let http = headers(Envelope::CloudEvents, Binding::Http, &named("city db"), "acme.features", &r, Message::Event);
        assert_eq!(get(&http, "ce-specversion"), Some("1.0"));
        assert_eq!(get(&http, "ce-id"), Some(r.event_id.as_str()));
        // The identity, not the name: a rename keeps the source.
        assert_eq!(get(&http, "ce-source"), Some("/6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31/parcels"));
        assert_eq!(get(&http, "ce-type"), Some("acme.features.moved"));
        assert_eq!(get(&http, "ce-subject"), Some("Gate%207%20%22north%22%20%25"));
        assert_eq!(get(&http, "ce-time"), Some("2026-11-30T06:00:00.000000Z"));
        assert_eq!(get(&http, "ce-dataschema"), Some("urn:feature-outbox:event-schema:3"));
        assert_eq!(get(&http, "ce-featureorigin"), Some("application"));
        assert_eq!(get(&http, "ce-datacontenttype"), None);
        assert_eq!(get(&http, "ce-traceparent"), None);
        let nats = headers(Envelope::CloudEvents, Binding::Nats, &named("db"), "features", &r, Message::Departed);
        assert_eq!(get(&nats, "ce-datacontenttype"), Some("application/json"));
        assert_eq!(get(&nats, "ce-id"), Some(format!("{}:departed", r.event_id).as_str()));
        assert_eq!(get(&nats, "ce-type"), Some("features.departed"));
        // Every value is printable ASCII without spaces: safe as an HTTP or NATS header.
        assert!(http.iter().chain(&nats).all(|(_, v)| v.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"')));
        // Kafka: ce_ headers, UTF-8 as they are, and datacontenttype as content-type.
        let kafka = headers(Envelope::CloudEvents, Binding::Kafka, &named("db"), "features", &r, Message::Event);
        assert_eq!(get(&kafka, "ce_id"), Some(r.event_id.as_str()));
        assert_eq!(get(&kafka, "ce_subject"), Some("Gate 7 \"north\" %"));
        assert_eq!(get(&kafka, "ce_featureorigin"), Some("application"));
        assert_eq!(get(&kafka, "content-type"), Some("application/json"));
        assert!(kafka.iter().all(|(n, _)| !n.starts_with("ce-") && n != "ce_datacontenttype"));
    }

    #[test]
    fn a_tracestate_without_traceparent_is_not_sent() {
        let mut r = row();
        r.tracestate = Some("congo=t61rcWkgMzE".into());
        assert!(headers(Envelope::CloudEvents, Binding::Http, &named("db"), "features", &r, Message::Event).iter().all(|(n, _)| !n.contains("trace")));
    }

    #[test]
    fn structured_events_carry_the_attributes_unencoded_and_the_body_as_data() {
        let mut r = row();
        r.feature_key = Some("Gate 7".into());
        r.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        let body = crate::event::to_json(&src(), &r, "t").unwrap();
        let v: serde_json::Value = serde_json::from_slice(&structured(&src(), "features", &r, &body).unwrap()).unwrap();
        assert_eq!(v["subject"], "Gate 7");
        assert_eq!(v["source"], format!("/{}/parcels", src().database_id));
        assert_eq!(v["type"], "features.moved");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["traceparent"], r.traceparent.clone().unwrap());
        assert_eq!(v["featureorigin"], "application");
        assert_eq!(v["data"], serde_json::from_slice::<serde_json::Value>(&body).unwrap());
        assert_eq!(v.as_object().unwrap().len(), 11);
    }

    #[test]
    fn the_origin_attribute_is_a_valid_extension_name() {
        assert!(ORIGIN_ATTRIBUTE.len() <= 20 && ORIGIN_ATTRIBUTE.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
    }

    #[test]
    fn source_is_a_path_of_two_segments() {
        assert_eq!(source("6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31", "features"), "/6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31/features");
        assert_eq!(source("id", "a/b?c#d"), "/id/a%2Fb%3Fc%23d");
        assert_eq!(source("id", "Straßen"), "/id/Stra%C3%9Fen");
    }
}
