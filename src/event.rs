//! The event a relay publishes for one outbox row, and the Standard Webhooks signature.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use serde::Serialize;
use serde_json::value::RawValue;
use sha2::Sha256;

/// The event format this relay publishes (README, "Events"). 3: 0.2.0, with layer and properties.
pub const SCHEMA_VERSION: i32 = 3;

/// Whose outbox an event comes from: the database's name, which a rename changes, and its identity
/// (feature_outbox.database_identity, sql/identity.sql), which survives a rename, a promotion and
/// pg_upgrade but not a copy into another database once resolved as 'new'. The consumer's key
/// starts with the identity (the book, "Events": the consumer's key).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Source {
    pub database: String,
    /// The identity as canonical uuid text.
    pub database_id: String,
}

/// One outbox row and its feature's current row, as the relay's claim and its layer's read give them.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: i64,
    pub event_id: String,
    /// The layer (a subject token): 'features' for the built-in table.
    pub layer: String,
    /// The layer's registration (layer_registry.since_id): a table registered again under an old
    /// name gets a higher one, and its features' versions start again. 0 for the built-in table.
    pub registration_id: i64,
    /// The extension's number for the feature: its key for an integer-keyed layer, else the number
    /// drawn for its uuid or text key (`feature_key`). Per-feature order and partitions run on it.
    pub feature_id: i64,
    /// A uuid or text key, as the application stores it (canonical text); None for integer keys.
    pub feature_key: Option<String>,
    pub feature_version: i32,
    pub event_type: String,
    pub routing_key: String,
    pub previous_routing_key: Option<String>,
    /// Bounding box of the geometry before this edit, recorded at write time: [west, south, east,
    /// north] in degrees (RFC 7946 §5). None for created and snapshot events.
    pub previous_bbox: Option<Vec<f64>>,
    /// RFC 3339 UTC time of the edit (the outbox row's created_at).
    pub occurred_at: String,
    /// The feature's current version; None when the feature row was hard-deleted.
    pub geometry_version: Option<i32>,
    /// WKB of the current geometry in EPSG:4326; None when the feature row was hard-deleted.
    pub geometry: Option<Vec<u8>>,
    /// The registered properties' current values, a JSON object; None when the row is gone.
    pub properties: Option<Box<RawValue>>,
    /// Why the row's layer could not be read (table dropped or altered): the row fails alone.
    pub read_error: Option<String>,
    pub row_failures: i32,
    /// The writer's W3C traceparent and tracestate (feature_outbox.traceparent at write time).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// Where the event comes from (outbox.origin): application, captured or resync.
    pub origin: String,
}

impl Row {
    /// This row without its feature's geometry, properties and read error (the event's body
    /// carries them): what a sink needs beside the body, copied cheaply.
    pub fn without_content(&self) -> Row {
        Row {
            id: self.id,
            event_id: self.event_id.clone(),
            layer: self.layer.clone(),
            registration_id: self.registration_id,
            feature_id: self.feature_id,
            feature_key: self.feature_key.clone(),
            feature_version: self.feature_version,
            event_type: self.event_type.clone(),
            routing_key: self.routing_key.clone(),
            previous_routing_key: self.previous_routing_key.clone(),
            previous_bbox: self.previous_bbox.clone(),
            occurred_at: self.occurred_at.clone(),
            geometry_version: self.geometry_version,
            geometry: None,
            properties: None,
            read_error: None,
            row_failures: self.row_failures,
            traceparent: self.traceparent.clone(),
            tracestate: self.tracestate.clone(),
            origin: self.origin.clone(),
        }
    }

    /// The feature's key as events carry it: the application's own key, as text.
    pub fn key(&self) -> String {
        self.feature_key.clone().unwrap_or_else(|| self.feature_id.to_string())
    }
}

/// The event JSON (schema 3): the guide's fields plus event_id, layer, previous_routing_key, bbox,
/// previous_bbox, properties and relayed_at; database and database_id since 0.4.0, origin since
/// 0.5.0 (additive).
#[derive(Serialize)]
struct Event<'a> {
    schema_version: i32,
    event_id: &'a str,
    /// The database whose outbox this is, by name (as a person reads it) and by identity (what a
    /// consumer keys on: a copy of the database resolved as a new source has another one).
    database: &'a str,
    database_id: &'a str,
    layer: &'a str,
    /// Versions are per (layer, registration_id, feature_id): a re-registered layer starts again.
    registration_id: i64,
    action: &'a str,
    feature_id: String,
    event_version: i32,
    geometry_version: Option<i32>,
    routing_key: &'a str,
    previous_routing_key: Option<&'a str>,
    crs: &'static str,
    geometry: Option<Box<RawValue>>,
    /// Of `geometry`: [west, south, east, north] in degrees, RFC 7946 §5 (west > east across the
    /// antimeridian). With previous_bbox, the tiles a tile builder must expire.
    bbox: Option<[f64; 4]>,
    previous_bbox: Option<&'a [f64]>,
    properties: Option<&'a RawValue>,
    /// Set instead of `geometry` when the event would exceed the NATS server's max_payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    geometry_ref: Option<&'a GeometryRef>,
    occurred_at: &'a str,
    relayed_at: &'a str,
    /// Where the event comes from: application (the extension's functions), captured (a write made
    /// outside them, decoded from the WAL) or resync.
    origin: &'a str,
}

/// Where a geometry too large for one NATS message was put: a JetStream Object Store object holding
/// the GeoJSON geometry text (NATS docs, "JetStream: Object Store").
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct GeometryRef {
    pub bucket: String,
    /// The event_id: one object per event, replaced (not duplicated) when the event is republished.
    pub name: String,
    /// Bytes of the object.
    pub size: usize,
}

/// Serializes the event for `row`, its geometry as GeoJSON at full precision. An error (a geometry
/// GeoJSON cannot carry) concerns this row only.
pub fn to_json(source: &Source, row: &Row, relayed_at: &str) -> Result<Vec<u8>, String> {
    build(source, row, relayed_at, geometry(row)?, None)
}

/// The event for `row` with `geometry: null` and `geometry_ref` pointing at its stored geometry.
pub fn to_json_by_ref(source: &Source, row: &Row, relayed_at: &str, geometry_ref: &GeometryRef) -> Result<Vec<u8>, String> {
    build(source, row, relayed_at, None, Some(geometry_ref))
}

/// The GeoJSON geometry text of `row` alone (what a geometry_ref object holds); None when deleted.
pub fn geometry_json(row: &Row) -> Result<Option<Vec<u8>>, String> {
    row.geometry.as_deref().map(crate::geojson::text_from_wkb).transpose().map_err(|e| e.message)
}

fn geometry(row: &Row) -> Result<Option<Box<RawValue>>, String> {
    match geometry_json(row)? {
        // The text is GeoJSON as written; RawValue checks it once, without building a tree.
        Some(text) => RawValue::from_string(String::from_utf8(text).map_err(|e| e.to_string())?).map(Some).map_err(|e| e.to_string()),
        None => Ok(None),
    }
}

fn build(source: &Source, row: &Row, relayed_at: &str, geometry: Option<Box<RawValue>>, geometry_ref: Option<&GeometryRef>) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&Event {
        schema_version: SCHEMA_VERSION,
        event_id: &row.event_id,
        database: &source.database,
        database_id: &source.database_id,
        layer: &row.layer,
        registration_id: row.registration_id,
        action: &row.event_type,
        feature_id: row.key(),
        event_version: row.feature_version,
        geometry_version: row.geometry_version,
        routing_key: &row.routing_key,
        previous_routing_key: row.previous_routing_key.as_deref(),
        crs: "EPSG:4326",
        geometry,
        bbox: row.geometry.as_deref().and_then(crate::edit::inspect::bbox),
        previous_bbox: row.previous_bbox.as_deref(),
        properties: row.properties.as_deref(),
        geometry_ref,
        occurred_at: &row.occurred_at,
        relayed_at,
        origin: &row.origin,
    })
    .map_err(|e| e.to_string())
}

/// `webhook-signature` value per Standard Webhooks: `v1,` + base64(HMAC-SHA256(key, "id.timestamp.body")),
/// where the key is the base64 part of a `whsec_<base64>` secret.
pub fn webhook_signature(secret: &str, id: &str, timestamp: i64, body: &[u8]) -> Result<String, String> {
    let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
    let key = STANDARD
        .decode(encoded)
        .map_err(|e| format!("feature_outbox.http_secret is not whsec_<base64>: {e}"))?;
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|e| e.to_string())?;
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    Ok(format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes())))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::routing::tests::point_wkb;

    pub(crate) fn source() -> Source {
        Source { database: "gis".into(), database_id: "6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31".into() }
    }

    pub(crate) fn row() -> Row {
        Row {
            id: 1,
            event_id: "0b3f2c1e-0000-4000-8000-000000000001".into(),
            layer: "parcels".into(),
            registration_id: 7001,
            feature_id: 4471,
            feature_key: None,
            feature_version: 2,
            event_type: "moved".into(),
            routing_key: "881f1d4891fffff".into(),
            previous_routing_key: Some("881fb46753fffff".into()),
            previous_bbox: Some(vec![13.3, 52.5, 13.35, 52.55]),
            occurred_at: "2026-11-30T06:00:00.000000Z".into(),
            geometry_version: Some(3),
            geometry: Some(point_wkb(13.400000000000001, 52.52)),
            properties: Some(RawValue::from_string(r#"{"name": "Main St", "lanes": 2}"#.into()).unwrap()),
            read_error: None,
            row_failures: 0,
            traceparent: None,
            tracestate: None,
            origin: "application".into(),
        }
    }

    #[test]
    fn event_has_the_documented_fields() {
        let v: serde_json::Value = serde_json::from_slice(&to_json(&source(), &row(), "2026-11-30T06:00:01Z").unwrap()).unwrap();
        assert_eq!(v["feature_id"], "4471");
        assert_eq!(v["event_version"], 2);
        assert_eq!(v["geometry_version"], 3);
        assert_eq!(v["action"], "moved");
        assert_eq!(v["crs"], "EPSG:4326");
        assert_eq!(v["previous_routing_key"], "881fb46753fffff");
        // Full precision: the shortest decimal that reads back as the same double.
        assert_eq!(v["geometry"]["coordinates"][0].as_f64().unwrap(), 13.400000000000001);
        assert_eq!(v["geometry"]["type"], "Point");
        assert_eq!(v["schema_version"], 3);
        assert_eq!(v["layer"], "parcels");
        assert_eq!(v["registration_id"], 7001);
        assert_eq!(v["properties"], serde_json::json!({"name": "Main St", "lanes": 2}));
        assert_eq!(v["bbox"], serde_json::json!([13.400000000000001, 52.52, 13.400000000000001, 52.52]));
        assert_eq!(v["previous_bbox"], serde_json::json!([13.3, 52.5, 13.35, 52.55]));
        assert_eq!(v["database"], "gis");
        assert_eq!(v["database_id"], "6f1c4a52-9d7e-4b8a-a3c1-2e5f0d9b7c31");
        assert_eq!(v["origin"], "application");
        assert_eq!(v.as_object().unwrap().len(), 20);
    }

    #[test]
    fn event_by_reference_has_a_null_geometry_and_the_object_it_names() {
        let r = row();
        let object = geometry_json(&r).unwrap().unwrap();
        let reference = GeometryRef { bucket: "FEATURES_GEOMETRY".into(), name: r.event_id.clone(), size: object.len() };
        let v: serde_json::Value = serde_json::from_slice(&to_json_by_ref(&source(), &r, "t", &reference).unwrap()).unwrap();
        assert!(v["geometry"].is_null());
        assert_eq!(v["geometry_ref"], serde_json::json!({"bucket": "FEATURES_GEOMETRY", "name": r.event_id, "size": object.len()}));
        // The object is exactly the geometry the inline event would carry.
        let inline: serde_json::Value = serde_json::from_slice(&to_json(&source(), &r, "t").unwrap()).unwrap();
        assert_eq!(serde_json::from_slice::<serde_json::Value>(&object).unwrap(), inline["geometry"]);
        assert_eq!(v.as_object().unwrap().len(), 21);
    }

    #[test]
    fn deleted_feature_gives_null_geometry() {
        let mut r = row();
        r.geometry = None;
        r.geometry_version = None;
        r.properties = None;
        let v: serde_json::Value = serde_json::from_slice(&to_json(&source(), &r, "t").unwrap()).unwrap();
        assert!(v["geometry"].is_null() && v["geometry_version"].is_null() && v["properties"].is_null());
        assert!(v["bbox"].is_null());
    }

    #[test]
    fn signature_matches_the_standard_webhooks_example() {
        // Test vector from the Standard Webhooks specification's reference libraries.
        let sig = webhook_signature(
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            br#"{"test": 2432232314}"#,
        )
        .unwrap();
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert!(webhook_signature("whsec_???", "id", 1, b"").is_err());
    }
}
