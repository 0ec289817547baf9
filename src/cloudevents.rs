//! The headers that go with one message of an event: the writer's W3C trace context on every
//! envelope, and under `feature_outbox.envelope = cloudevents` the binary-mode CloudEvents 1.0
//! attributes (CloudEvents HTTP protocol binding 3.1.3, NATS protocol binding 3.1.3). Pure Rust.

use percent_encoding::{AsciiSet, CONTROLS, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::event::{Row, SCHEMA_VERSION};
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

/// `source`: `/<database>/<layer>`, each a URI path segment.
pub fn source(database: &str, layer: &str) -> String {
    format!("/{}/{}", utf8_percent_encode(database, PATH_SEGMENT), utf8_percent_encode(layer, PATH_SEGMENT))
}

/// The headers of one message of `row`, in order. `database` is the database the worker serves;
/// `prefix` is feature_outbox.nats_subject_prefix, which `type` starts with on both sinks.
pub fn headers(envelope: Envelope, binding: Binding, database: &str, prefix: &str, row: &Row, message: Message) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    // W3C Trace Context headers (section 3), for any consumer's propagator.
    if let Some(tp) = &row.traceparent {
        h.push(("traceparent", tp.clone()));
        if let Some(ts) = &row.tracestate {
            h.push(("tracestate", ts.clone()));
        }
    }
    if envelope == Envelope::Native {
        return h;
    }
    let (id, event_type) = match message {
        Message::Event => (row.event_id.clone(), row.event_type.as_str()),
        Message::Departed => (format!("{}:{}", row.event_id, crate::subjects::DEPARTED), crate::subjects::DEPARTED),
    };
    let mut attribute = |name: &'static str, value: &str| h.push((name, utf8_percent_encode(value, HEADER_VALUE).to_string()));
    attribute("ce-specversion", "1.0");
    attribute("ce-id", &id);
    attribute("ce-source", &source(database, &row.layer));
    attribute("ce-type", &format!("{prefix}.{event_type}"));
    attribute("ce-subject", &row.key());
    attribute("ce-time", &row.occurred_at);
    attribute("ce-dataschema", &dataschema());
    if binding == Binding::Nats {
        attribute("ce-datacontenttype", "application/json");
    }
    // The Distributed Tracing extension: the same values as CloudEvents attributes.
    if let Some(tp) = &row.traceparent {
        attribute("ce-traceparent", tp);
        if let Some(ts) = &row.tracestate {
            attribute("ce-tracestate", ts);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::row;

    fn get<'a>(h: &'a [(&str, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn native_sends_only_the_trace_context() {
        let mut r = row();
        assert!(headers(Envelope::Native, Binding::Http, "db", "features", &r, Message::Event).is_empty());
        r.traceparent = Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
        r.tracestate = Some("congo=t61rcWkgMzE".into());
        let h = headers(Envelope::Native, Binding::Nats, "db", "features", &r, Message::Event);
        assert_eq!(h, vec![("traceparent", r.traceparent.clone().unwrap()), ("tracestate", r.tracestate.clone().unwrap())]);
    }

    #[test]
    fn cloudevents_attributes_per_binding() {
        let mut r = row();
        r.feature_key = Some("Gate 7 \"north\" %".into());
        let http = headers(Envelope::CloudEvents, Binding::Http, "city db", "acme.features", &r, Message::Event);
        assert_eq!(get(&http, "ce-specversion"), Some("1.0"));
        assert_eq!(get(&http, "ce-id"), Some(r.event_id.as_str()));
        // The URI's own %20, then the header's encoding of that %.
        assert_eq!(get(&http, "ce-source"), Some("/city%2520db/parcels"));
        assert_eq!(get(&http, "ce-type"), Some("acme.features.moved"));
        assert_eq!(get(&http, "ce-subject"), Some("Gate%207%20%22north%22%20%25"));
        assert_eq!(get(&http, "ce-time"), Some("2026-11-30T06:00:00.000000Z"));
        assert_eq!(get(&http, "ce-dataschema"), Some("urn:feature-outbox:event-schema:3"));
        assert_eq!(get(&http, "ce-datacontenttype"), None);
        assert_eq!(get(&http, "ce-traceparent"), None);
        let nats = headers(Envelope::CloudEvents, Binding::Nats, "db", "features", &r, Message::Departed);
        assert_eq!(get(&nats, "ce-datacontenttype"), Some("application/json"));
        assert_eq!(get(&nats, "ce-id"), Some(format!("{}:departed", r.event_id).as_str()));
        assert_eq!(get(&nats, "ce-type"), Some("features.departed"));
        // Every value is printable ASCII without spaces: safe as an HTTP or NATS header.
        assert!(http.iter().chain(&nats).all(|(_, v)| v.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"')));
    }

    #[test]
    fn a_tracestate_without_traceparent_is_not_sent() {
        let mut r = row();
        r.tracestate = Some("congo=t61rcWkgMzE".into());
        assert!(headers(Envelope::CloudEvents, Binding::Http, "db", "features", &r, Message::Event).iter().all(|(n, _)| !n.contains("trace")));
    }

    #[test]
    fn source_is_a_path_of_two_segments() {
        assert_eq!(source("postgres", "features"), "/postgres/features");
        assert_eq!(source("a/b?c#d", "x"), "/a%2Fb%3Fc%23d/x");
        assert_eq!(source("Stadt-Köln", "roads"), "/Stadt-K%C3%B6ln/roads");
    }
}
