//! Reference consumer for feature_outbox events on NATS JetStream.
//!
//! The relay inside PostgreSQL delivers *at least once* and, with more than one relay worker, not
//! necessarily in order. It also publishes the feature's *current* geometry, which may be newer than
//! the edit the event describes. This program shows the consumer side those guarantees assume:
//!
//! 1. a durable pull consumer, so a restart resumes where the last acknowledged message left off;
//! 2. deduplication by `event_id` (JetStream also drops republished `Nats-Msg-Id`s, but only inside
//!    its duplicate window; the consumer must not depend on that);
//! 3. the latest `geometry_version` applied per feature, so a late, older geometry is dropped;
//! 4. detection of `event_version < geometry_version`: the event describes an edit, but carries a
//!    later shape than that edit wrote (the seed guide's gotcha 1);
//! 5. an ack only after the event has been processed, so a crash mid-way gets it redelivered.
//!
//! State lives in memory here; a real consumer keeps `seen` and `latest` in its own store, updated in
//! the same transaction as whatever it derives from the event, and acks after that commits.
//!
//! With `--area <GeoJSON polygon>` it takes only the events of that area, by subject alone (see
//! `area`): one filter subject per covering H3 cell, departure notices included, and it keeps the
//! live set of features inside. With `--backfill-dsn` a consumer that starts empty asks PostgreSQL
//! for a snapshot of its area (`CALL feature_outbox.backfill`) once it is subscribed.
//!
//! Output: progress on stderr, and on exit one line of JSON on stdout (the demo's report reads it).

mod area;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use clap::Parser;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "Consume feature_outbox events from a JetStream stream and print a JSON summary")]
struct Args {
    /// NATS server URL.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    server: String,
    /// JetStream stream the relay publishes to (feature_outbox.nats_stream).
    #[arg(long, default_value = "FEATURES")]
    stream: String,
    /// Durable consumer name: the server remembers its acknowledged position across restarts.
    #[arg(long, default_value = "feature-consumer")]
    durable: String,
    /// Only subjects matching this filter, e.g. `features.parcels.moved.>` or `features.*.*.<h3 cell>`.
    #[arg(long)]
    filter: Option<String>,
    /// Stop once this many unique events have been processed.
    #[arg(long)]
    expect: Option<u64>,
    /// Stop when nothing has arrived for this many seconds (also bounds the wait for the stream).
    #[arg(long, default_value_t = 10.0)]
    idle_timeout: f64,
    /// Only this area: a file holding a GeoJSON Polygon or MultiPolygon (or a Feature or
    /// FeatureCollection of them), in longitude/latitude degrees.
    #[arg(long)]
    area: Option<std::path::PathBuf>,
    /// The layer to take (with --area); `*` takes every layer.
    #[arg(long, default_value = "*")]
    layer: String,
    /// feature_outbox.nats_subject_prefix.
    #[arg(long, default_value = "features")]
    prefix: String,
    /// feature_outbox.subject_resolutions: the parent cells each subject carries.
    #[arg(long, default_value = "3,5,7", value_delimiter = ',')]
    subject_resolutions: Vec<u8>,
    /// feature_outbox.h3_resolution: the routing keys' own resolution.
    #[arg(long, default_value_t = 8)]
    key_resolution: u8,
    /// The subject resolution to cover the area at; by default the finest needing at most --max-cells cells.
    #[arg(long)]
    area_resolution: Option<u8>,
    #[arg(long, default_value_t = 64)]
    max_cells: usize,
    /// PostgreSQL connection string: when this consumer starts empty (its durable consumers are new),
    /// it subscribes from now on and calls feature_outbox.backfill for its layer and area.
    #[arg(long, requires = "area")]
    backfill_dsn: Option<String>,
}

/// The event JSON the relay publishes (schema_version 3). Subject: `<prefix>.<layer>.<action>.<routing_key>`.
const DEPARTED: &str = "departed";

#[derive(Deserialize)]
#[allow(dead_code)] // every field is listed as documentation; not all are used below
struct Event {
    schema_version: i32,
    event_id: String,
    #[serde(default)]
    database: String, // the database whose outbox this is, by name (0.4.0)
    #[serde(default)]
    database_id: String, // its identity (0.4.0): the first part of the consumer's key (book, Events)
    layer: String,  // the layer (table) the feature belongs to; feature ids are unique per layer
    #[serde(default)]
    registration_id: i64, // the layer's registration: a table registered again under the name gets a higher one
    action: String, // created | moved | updated | retired | snapshot (backfill)
    feature_id: String,
    event_version: i32,            // the version this edit produced
    geometry_version: Option<i32>, // the version of `geometry`; null if the feature was hard-deleted
    routing_key: String,           // H3 cell of the edit's geometry, computed at write time
    previous_routing_key: Option<String>, // the cell before the edit; null for created
    crs: String,                   // always "EPSG:4326"
    geometry: Value,               // GeoJSON geometry at geometry_version, or null
    #[serde(default)]
    bbox: Option<Vec<f64>>,        // [west, south, east, north] of geometry (RFC 7946 §5; west > east across the antimeridian)
    #[serde(default)]
    previous_bbox: Option<Vec<f64>>, // the box before this edit: with bbox, the tiles to expire
    properties: Value,             // the layer's registered columns at geometry_version, or null
    // Set (with geometry null) when the event would exceed the NATS server's max_payload: the
    // geometry is an object in a JetStream Object Store bucket.
    geometry_ref: Option<GeometryRef>,
    occurred_at: String,
    relayed_at: String,
}

#[derive(Deserialize, Clone)]
struct GeometryRef {
    bucket: String,
    name: String, // the event_id
    size: usize,  // bytes of the GeoJSON geometry text
}

#[derive(Default)]
struct Consumer {
    seen: HashSet<String>,           // event_ids processed: the deduplication key
    latest: HashMap<(String, String, i64, String), i32>, // the consumer's key (database_id, layer, registration_id, feature_id) -> geometry_version applied
    cells: HashMap<String, u64>,     // routing_key -> unique events
    by_action: HashMap<String, u64>,
    unique_events: u64,
    duplicates: u64,
    stale_dropped: u64,
    later_geometry_seen: u64,
    content_null: u64, // created/moved/updated/snapshot without content: the row was deleted since (or a relay bug)
    redelivered: u64,     // JetStream delivered this message more than once (not acked in time)
    header_mismatches: u64, // headers or subject disagree with the body: a relay bug
    malformed: u64,
    geometry_refs_fetched: u64,
    departures: u64,          // departure notices (Nats-Msg-Id <event_id>:departed), deduplicated
    area: Option<area::Area>, // --area: the covering cells, and the live set below
    live: area::LiveSet,
    sample: Option<(usize, Value)>, // smallest moved event (falls back to any), for the report
}

enum Verdict {
    Applied,
    Duplicate,
    Stale,
    Malformed,
}

impl Consumer {
    /// Processes one message. Everything here happens before the caller acks.
    fn process(&mut self, subject: &str, headers: Option<&async_nats::HeaderMap>, payload: &[u8]) -> Verdict {
        let event: Event = match serde_json::from_slice(payload) {
            Ok(e) => e,
            Err(e) => {
                eprintln!("consumer: malformed event on {subject}: {e}");
                self.malformed += 1;
                return Verdict::Malformed;
            }
        };
        // A departure notice: the event again, on the subjects of the cell the feature left.
        let departed = subject.split('.').nth(2) == Some("departed");
        self.check_envelope(subject, headers, &event, departed);

        // At-least-once delivery: the same event_id may come again (relay crash between publish and
        // commit, after the stream's duplicate window). Processing it twice must change nothing.
        let id = if departed { format!("{}:departed", event.event_id) } else { event.event_id.clone() };
        if !self.seen.insert(id) {
            self.duplicates += 1;
            return Verdict::Duplicate;
        }
        if let Some(area) = &self.area {
            self.live.apply(area, departed, &event.layer, &event.feature_id, &event.action, &event.routing_key);
        }
        if departed {
            self.departures += 1;
            return Verdict::Applied;
        }
        self.unique_events += 1;
        *self.cells.entry(event.routing_key.clone()).or_default() += 1;
        *self.by_action.entry(event.action.clone()).or_default() += 1;
        self.keep_sample(&event, payload);

        let Some(geometry_version) = event.geometry_version else {
            // The feature row is gone: there is no geometry to apply, only the fact of the edit. For
            // an action that says the row exists, that is worth a look: the row was deleted after
            // this edit, or (0.2.0's relay) the content was lost. Counted apart, never applied as a
            // feature without geometry.
            if event.action != "retired" {
                self.content_null += 1;
                eprintln!("consumer: {} event {} of {} {} carries no content", event.action, event.event_id, event.layer, event.feature_id);
            }
            return Verdict::Applied;
        };
        // Gotcha 1: the relay read the feature's current row, so a second edit committed before the
        // first event was relayed gives the first event the second edit's shape. Not an error, but
        // a consumer that keeps per-edit history must not file this shape under event_version.
        if geometry_version > event.event_version {
            self.later_geometry_seen += 1;
        }
        // Ordering per feature is reconstructed here, not assumed: a geometry older than the one
        // already applied arrived late (another relay worker's batch) and must not overwrite it.
        // Versions count per database and registration (the book's "consumer's key"): a layer
        // registered again starts again at 1, and a copy of the database resolved as a new source
        // has the same layer, registration and feature ids under another database_id.
        let key = (event.database_id.clone(), event.layer.clone(), event.registration_id, event.feature_id.clone());
        let latest = self.latest.entry(key).or_insert(0);
        if geometry_version < *latest {
            self.stale_dropped += 1;
            return Verdict::Stale;
        }
        *latest = geometry_version; // "apply": a real consumer would rebuild tiles, reindex, ...
        Verdict::Applied
    }

    /// The subject and headers repeat parts of the body so routers need not parse it. They must agree.
    fn check_envelope(&mut self, subject: &str, headers: Option<&async_nats::HeaderMap>, e: &Event, departed: bool) {
        let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str().to_string());
        let mut problems = Vec::new();
        // <prefix>.<layer>.<action>.<parent cells>.<routing_key>, or for a departure notice
        // <prefix>.<layer>.departed.<parent cells>.<previous_routing_key>
        let tokens: Vec<&str> = subject.split('.').collect();
        let (action, key, msg_id) = if departed {
            (DEPARTED, e.previous_routing_key.as_deref().unwrap_or_default(), format!("{}:departed", e.event_id))
        } else {
            (e.action.as_str(), e.routing_key.as_str(), e.event_id.clone())
        };
        if tokens.len() < 4 || tokens[1] != e.layer || tokens[2] != action || tokens.last() != Some(&key) {
            problems.push(format!("subject {subject}"));
        }
        if header("Nats-Msg-Id").as_deref() != Some(msg_id.as_str()) {
            problems.push(format!("Nats-Msg-Id {:?}", header("Nats-Msg-Id")));
        }
        if header("Feature-Id").as_deref() != Some(e.feature_id.as_str()) {
            problems.push(format!("Feature-Id {:?}", header("Feature-Id")));
        }
        if header("Feature-Version") != Some(e.event_version.to_string()) {
            problems.push(format!("Feature-Version {:?}", header("Feature-Version")));
        }
        if header("Previous-Routing-Key") != e.previous_routing_key {
            problems.push(format!("Previous-Routing-Key {:?}", header("Previous-Routing-Key")));
        }
        let has_geometry = !e.geometry.is_null() || e.geometry_ref.is_some();
        if e.crs != "EPSG:4326" || has_geometry == e.geometry_version.is_none() {
            problems.push(format!("crs {} / geometry vs geometry_version", e.crs));
        }
        if !problems.is_empty() {
            self.header_mismatches += 1;
            eprintln!("consumer: event {} disagrees with its envelope: {}", e.event_id, problems.join(", "));
        }
    }

    /// Keeps the smallest event, preferring one that moved a feature into another cell.
    fn keep_sample(&mut self, e: &Event, payload: &[u8]) {
        let moved_cell = e.action == "moved" && e.previous_routing_key.as_ref() != Some(&e.routing_key);
        let rank = payload.len() + if moved_cell { 0 } else if e.action == "moved" { 1 << 29 } else { 1 << 30 };
        if self.sample.as_ref().is_none_or(|(r, _)| rank < *r) {
            self.sample = serde_json::from_slice(payload).ok().map(|v| (rank, v));
        }
    }

    fn summary(&self, window: Option<Duration>, stopped_by: &str) -> Value {
        let mut cells: Vec<_> = self.cells.iter().collect();
        cells.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let seconds = window.map(|d| d.as_secs_f64()).unwrap_or(0.0);
        json!({
            "unique_events": self.unique_events,
            "duplicates": self.duplicates,
            "stale_dropped": self.stale_dropped,
            "later_geometry_seen": self.later_geometry_seen,
            "content_null": self.content_null,
            "events_per_second": if seconds > 0.0 { (self.unique_events as f64 / seconds).round() } else { 0.0 },
            "receive_seconds": (seconds * 1000.0).round() / 1000.0,
            "busiest_cells": cells.iter().take(5).map(|(k, n)| json!({"routing_key": k, "events": n})).collect::<Vec<_>>(),
            "by_action": self.by_action,
            "features": self.latest.len(),
            "redelivered": self.redelivered,
            "header_mismatches": self.header_mismatches,
            "malformed": self.malformed,
            "geometry_refs_fetched": self.geometry_refs_fetched,
            "departures": self.departures,
            "area": self.area.as_ref().map(|a| json!({
                "resolution": u8::from(a.resolution),
                "cells": a.cells.len(),
                "live_features": self.live.features.len(),
                "entered": self.live.entered,
                "left": self.live.left,
                "departed_within": self.live.departed_within,
            })),
            "stopped_by": stopped_by,
            "sample_event": self.sample.as_ref().map(|(_, v)| v.clone()),
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), async_nats::Error> {
    let args = Args::parse();
    let idle = Duration::from_secs_f64(args.idle_timeout);
    let client = async_nats::ConnectOptions::new().name("feature_outbox reference consumer").connect(&args.server).await?;
    let js = jetstream::new(client.clone());

    // The relay creates the stream when it first connects; wait for it rather than create it here
    // with settings (duplicate window, replicas) that might differ from feature_outbox.nats_*.
    let waited = Instant::now();
    let stream = loop {
        match js.get_stream(&args.stream).await {
            Ok(s) => break s,
            Err(e) if waited.elapsed() < idle => {
                if waited.elapsed() < Duration::from_millis(500) {
                    eprintln!("consumer: waiting for stream {}: {e}", args.stream);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };

    let mut state = Consumer::default();
    let filters = match &args.area {
        None => vec![args.filter.clone().unwrap_or_default()],
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("--area {}: {e}", path.display()))?;
            let polygons = area::read_polygons(&text)?;
            let a = area::Area::new(&polygons, args.subject_resolutions.clone(), args.key_resolution, args.area_resolution, args.max_cells)?;
            eprintln!("consumer: area covered by {} cells at resolution {}", a.cells.len(), u8::from(a.resolution));
            let f = a.filters(&args.prefix, &args.layer);
            state.area = Some(a);
            f
        }
    };
    // nats-server 2.10+ takes every filter subject on one consumer; 2.9 (Debian's) takes one, so
    // there it is one durable consumer per filter, their messages merged.
    let version: Vec<u32> = client.server_info().version.split('.').filter_map(|p| p.parse().ok()).collect();
    let multi_filter = version.as_slice() >= [2, 10].as_slice();
    let groups: Vec<(String, Vec<String>)> = if multi_filter || filters.len() == 1 {
        vec![(args.durable.clone(), filters.clone())]
    } else {
        filters.iter().enumerate().map(|(i, f)| (format!("{}-{i}", args.durable), vec![f.clone()])).collect()
    };
    // Starting empty: none of the durable consumers exists yet.
    let fresh = stream.get_consumer::<pull::Config>(&groups[0].0).await.is_err();
    let backfill = args.backfill_dsn.as_ref().filter(|_| fresh);
    let mut streams = Vec::new();
    for (name, subjects) in &groups {
        // Durable + explicit acks: unacked messages are redelivered after ack_wait; acked ones never again.
        let mut config = pull::Config {
            durable_name: Some(name.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            // A consumer about to be backfilled takes the events from now on: the snapshots stand
            // for everything before.
            deliver_policy: if backfill.is_some() { jetstream::consumer::DeliverPolicy::New } else { jetstream::consumer::DeliverPolicy::All },
            ..Default::default()
        };
        match subjects.as_slice() {
            [one] => config.filter_subject = one.clone(),
            many => config.filter_subjects = many.to_vec(),
        }
        let consumer = stream.get_or_create_consumer(name, config).await?;
        streams.push(consumer.stream().max_messages_per_batch(500).messages().await?);
    }
    let mut messages = futures::stream::select_all(streams);
    eprintln!("consumer: pulling from stream {} with {} durable consumer(s) {}", args.stream, groups.len(), args.durable);
    if let Some(dsn) = backfill {
        let written = call_backfill(dsn, &args.layer, args.area.as_deref()).await?;
        eprintln!("consumer: backfill wrote {written} snapshot events for layer {}", args.layer);
    }

    let (mut first, mut last) = (None::<Instant>, Instant::now());
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let stopped_by = loop {
        if args.expect.is_some_and(|n| state.unique_events >= n) {
            break "expect";
        }
        let next = tokio::select! {
            _ = &mut ctrl_c => break "interrupt",
            next = tokio::time::timeout_at((last + idle).into(), messages.next()) => next,
        };
        let message = match next {
            Err(_) => break "idle_timeout",
            Ok(None) => break "stream_closed",
            Ok(Some(Err(e))) => {
                eprintln!("consumer: {e}"); // e.g. a missed heartbeat; the stream recovers by itself
                continue;
            }
            Ok(Some(Ok(m))) => m,
        };
        last = Instant::now();
        first.get_or_insert(last);
        if message.info().is_ok_and(|i| i.delivered > 1) {
            state.redelivered += 1;
        }
        // A large geometry travels by reference: read it from the bucket before processing. If that
        // fails, nothing is counted and the message is not acked: JetStream redelivers it.
        #[derive(Deserialize)]
        struct ByRef {
            geometry_ref: Option<GeometryRef>,
        }
        if let Some(r) = serde_json::from_slice::<ByRef>(&message.payload).ok().and_then(|e| e.geometry_ref) {
            match fetch_geometry(&js, &r).await {
                Ok(geometry) if geometry.len() == r.size => state.geometry_refs_fetched += 1,
                Ok(geometry) => {
                    // Not the geometry the event names: a relay bug. Do not apply it; stop redelivery.
                    eprintln!("consumer: object {} holds {} bytes, not {}", r.name, geometry.len(), r.size);
                    state.malformed += 1;
                    let _ = message.ack_with(AckKind::Term).await;
                    continue;
                }
                Err(e) => {
                    eprintln!("consumer: cannot fetch geometry {}/{}: {e}", r.bucket, r.name);
                    let _ = message.ack_with(AckKind::Nak(None)).await;
                    continue;
                }
            }
        }
        let verdict = state.process(message.subject.as_str(), message.headers.as_ref(), &message.payload);
        // Ack only now, after processing. A malformed event will not improve on redelivery: Term
        // tells JetStream to stop redelivering it (a real consumer would dead-letter it first).
        let ack = match verdict {
            Verdict::Applied | Verdict::Duplicate | Verdict::Stale => message.ack().await,
            Verdict::Malformed => message.ack_with(AckKind::Term).await,
        };
        if let Err(e) = ack {
            eprintln!("consumer: ack failed (the message will be redelivered): {e}");
        }
        if state.unique_events % 1000 == 0 && matches!(verdict, Verdict::Applied | Verdict::Stale) {
            eprintln!("consumer: {} unique events", state.unique_events);
        }
    };
    client.flush().await?; // the acks are fire-and-forget publishes: send them before exiting

    let window = first.map(|f| last.duration_since(f));
    eprintln!("consumer: stopped ({stopped_by}) after {} unique events", state.unique_events);
    println!("{}", state.summary(window, stopped_by));
    Ok(())
}

/// `CALL feature_outbox.backfill(layer, area)` on the database at `dsn`: one snapshot event per live
/// feature of the layer whose routing point lies in the area. Needs EXECUTE on the procedure.
async fn call_backfill(dsn: &str, layer: &str, area: Option<&std::path::Path>) -> Result<i64, async_nats::Error> {
    if layer == "*" {
        return Err("--backfill-dsn needs --layer: backfill writes the snapshots of one layer".into());
    }
    let geojson = match area {
        Some(path) => {
            // PostGIS reads a geometry; a Feature(Collection) is reduced to its polygons first.
            let polygons = area::read_polygons(&std::fs::read_to_string(path)?)?;
            Some(geojson::Geometry::from(&geo::Geometry::MultiPolygon(polygons)).to_string())
        }
        None => None,
    };
    let (db, connection) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    let driver = tokio::spawn(connection);
    let row = db
        .query_one(
            "CALL feature_outbox.backfill($1, ST_SetSRID(ST_GeomFromGeoJSON($2::text), 4326), NULL)",
            &[&layer, &geojson],
        )
        .await?;
    drop(db);
    let _ = driver.await;
    Ok(row.get::<_, i64>(0))
}

/// Reads a geometry_ref's object: the GeoJSON geometry text (needs read access to the bucket).
async fn fetch_geometry(js: &jetstream::Context, r: &GeometryRef) -> Result<Vec<u8>, async_nats::Error> {
    use tokio::io::AsyncReadExt;
    let store = js.get_object_store(&r.bucket).await?;
    let mut object = store.get(&r.name).await?;
    let mut bytes = Vec::with_capacity(r.size);
    object.read_to_end(&mut bytes).await?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    //! The three situations a consumer must handle, on hand-made events:
    //! cargo test --manifest-path examples/consumer/Cargo.toml --target-dir target/consumer
    use super::*;

    fn event(id: &str, event_version: i32, geometry_version: i32) -> (String, async_nats::HeaderMap, Vec<u8>) {
        let body = json!({
            "schema_version": 3, "event_id": id, "layer": "parcels", "action": "moved", "feature_id": "4471",
            "event_version": event_version, "geometry_version": geometry_version,
            "routing_key": "881f1d4891fffff", "previous_routing_key": "881fb46753fffff", "crs": "EPSG:4326",
            "geometry": {"type": "Point", "coordinates": [13.4, 52.52]}, "properties": {"name": "Main St"},
            "occurred_at": "2026-11-30T06:00:00.000000Z", "relayed_at": "2026-11-30T06:00:01.000000Z",
        });
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", id);
        h.insert("Feature-Id", "4471");
        h.insert("Feature-Version", event_version.to_string().as_str());
        h.insert("Previous-Routing-Key", "881fb46753fffff");
        ("features.parcels.moved.881f1d4891fffff".into(), h, serde_json::to_vec(&body).unwrap())
    }

    fn feed(c: &mut Consumer, (subject, headers, body): (String, async_nats::HeaderMap, Vec<u8>)) -> Verdict {
        c.process(&subject, Some(&headers), &body)
    }

    #[test]
    fn duplicates_stale_and_later_geometry() {
        let mut c = Consumer::default();
        // Edits v2 and v3 committed together: the relay sent v3's geometry with both events.
        assert!(matches!(feed(&mut c, event("a", 2, 3)), Verdict::Applied));
        assert!(matches!(feed(&mut c, event("b", 3, 3)), Verdict::Applied));
        // The same event again (a relay crash after publish, beyond the stream's duplicate window).
        assert!(matches!(feed(&mut c, event("a", 2, 3)), Verdict::Duplicate));
        // An older geometry arriving late (another relay worker's batch) must not overwrite v3.
        assert!(matches!(feed(&mut c, event("c", 2, 2)), Verdict::Stale));
        assert_eq!((c.unique_events, c.duplicates, c.stale_dropped, c.later_geometry_seen), (3, 1, 1, 1));
        assert_eq!((c.latest[&(String::new(), "parcels".to_string(), 0, "4471".to_string())], c.header_mismatches), (3, 0));
    }

    #[test]
    fn another_database_id_is_another_feature_and_not_stale() {
        let mut c = Consumer::default();
        assert!(matches!(feed(&mut c, event("a", 3, 3)), Verdict::Applied));
        let (subject, headers, body) = event("b", 2, 2);
        let mut v: Value = serde_json::from_slice(&body).unwrap();
        v["database_id"] = json!("6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31");
        assert!(matches!(c.process(&subject, Some(&headers), &serde_json::to_vec(&v).unwrap()), Verdict::Applied));
        assert_eq!(c.stale_dropped, 0);
    }

    #[test]
    fn a_re_registered_layer_starts_again_and_is_not_stale() {
        let mut c = Consumer::default();
        assert!(matches!(feed(&mut c, event("a", 3, 3)), Verdict::Applied));
        let (subject, headers, body) = event("b", 1, 1);
        let mut v: Value = serde_json::from_slice(&body).unwrap();
        v["registration_id"] = json!(42);
        assert!(matches!(c.process(&subject, Some(&headers), &serde_json::to_vec(&v).unwrap()), Verdict::Applied));
        assert_eq!(c.stale_dropped, 0);
    }

    #[test]
    fn content_null_on_an_action_that_says_the_row_exists_is_flagged() {
        let mut c = Consumer::default();
        let (subject, headers, body) = event("a", 2, 2);
        let mut v: Value = serde_json::from_slice(&body).unwrap();
        for field in ["geometry", "geometry_version", "properties"] {
            v[field] = Value::Null;
        }
        c.process(&subject, Some(&headers), &serde_json::to_vec(&v).unwrap());
        assert_eq!(c.content_null, 1);
        v["event_id"] = json!("b");
        v["action"] = json!("retired");
        c.process("features.parcels.retired.881f1d4891fffff", Some(&headers), &serde_json::to_vec(&v).unwrap());
        assert_eq!(c.content_null, 1, "a retired event without content is a deleted row, as expected");
    }

    #[test]
    fn envelope_disagreeing_with_body_is_counted() {
        let mut c = Consumer::default();
        let (subject, mut headers, body) = event("a", 2, 2);
        headers.insert("Feature-Version", "7");
        c.process(&subject, Some(&headers), &body);
        c.process("features.parcels.created.881f1d4891fffff", None, &event("b", 2, 2).2);
        assert_eq!(c.header_mismatches, 2);
        assert!(matches!(c.process("features.x.y", None, b"{"), Verdict::Malformed));
    }
}
