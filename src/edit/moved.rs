//! The built-in move: `edit_feature(id, geometry, 'moved')`, and its GeoJSON form (whose text is
//! parsed here first), of a valid, non-empty EPSG:4326 Point, LineString, Polygon or their Multi
//! form that does not cross the antimeridian, the edit most applications make most, written here
//! without `_edit` (issue 51).
//!
//! It takes `_edit`'s steps for that case (sql/edit.sql) with the same checks, statements and rows:
//! the Rust pass over the EWKB (`inspect`), PostGIS's validity and point on surface, the H3 cell,
//! then the state row (whose lock orders the feature's edits), the feature, the outbox row, the
//! tiles when the layer has an expire output, and the relay's wake-up. What it saves is PL/pgSQL's
//! SECURITY DEFINER call with a pinned search_path: on PostgreSQL 15 every call of a function with a
//! SET clause saves and restores the setting, walks every setting at exit and recomputes the search
//! path twice, 6-10 % of the edit rate. It runs as the extension's owner as that function did (the
//! entry point switches, `entry.rs`), and no name it uses goes through the caller's search_path:
//! PostGIS's functions are called by OID (`postgis.rs`) and its statements qualify every table,
//! function and operator, so that a caller's own schemas cannot put their objects in its plans.
//!
//! Anything else, and a move that finds nothing to write (a missing, retired or pre-0.3.0
//! feature), is `_edit`'s (`None`), which raises the error that fits. Regression test
//! `32_moved_fast_path` holds the rows of both paths equal.

use pgrx::datum::{DatumWithOid, Uuid};
use pgrx::pg_sys;
use pgrx::prelude::*;

use super::entry::Declared;
use super::postgis;
use crate::datum_bytes;
use crate::plans::prepared;

/// The state row: the old routing key, point and box handed back as previous_*, the new ones and
/// the digests set. $1 feature id, $2 routing key, $3 its resolution, $4 routing point, $5 bbox,
/// $6 geometry digest, $7 properties digest.
const STATE: &str = "UPDATE feature_outbox.feature_state s
   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
       previous_routing_point = s.routing_point, previous_bbox = s.bbox,
       routing_key = $2, h3_resolution = $3, routing_point = $4, bbox = $5,
       geometry_digest = $6, properties_digest = $7, version = s.version OPERATOR(pg_catalog.+) 1,
       last_event = 'moved'
 WHERE s.layer OPERATOR(pg_catalog.=) 'features' AND s.feature_id OPERATOR(pg_catalog.=) $1
   AND s.version IS NOT NULL
RETURNING s.previous_h3_resolution, s.previous_routing_key, s.previous_routing_point, s.previous_bbox";
const STATE_TYPES: [pg_sys::Oid; 7] = [
    pg_sys::INT8OID,
    pg_sys::TEXTOID,
    pg_sys::INT2OID,
    pg_sys::FLOAT8ARRAYOID,
    pg_sys::FLOAT8ARRAYOID,
    pg_sys::UUIDOID,
    pg_sys::UUIDOID,
];

/// The feature: $1 id, $2 geometry.
const FEATURE: &str = "UPDATE feature_outbox.features f
   SET geom = $2, version = f.version OPERATOR(pg_catalog.+) 1, updated_at = pg_catalog.now(), retired_at = NULL
 WHERE f.id OPERATOR(pg_catalog.=) $1 AND f.retired_at IS NULL
RETURNING f.version";

/// The outbox row: $1 feature id, $2 version, $3 routing key, $4 previous routing key, $5 previous
/// bbox, $6 geometry digest, $7 properties digest. Its other columns are the table's defaults.
const OUTBOX: &str = "INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key,
       previous_routing_key, layer, previous_bbox, geometry_digest, properties_digest)
VALUES ($1, $2, 'moved', $3, $4, 'features', $5, $6, $7)";
const OUTBOX_TYPES: [pg_sys::Oid; 7] = [
    pg_sys::INT8OID,
    pg_sys::INT4OID,
    pg_sys::TEXTOID,
    pg_sys::TEXTOID,
    pg_sys::FLOAT8ARRAYOID,
    pg_sys::UUIDOID,
    pg_sys::UUIDOID,
];

/// The tiles of the event just written (sql/tiles.sql): $1 feature id, $2 the shape's WKB, $3 the
/// properties digest.
const TILES: &str = "SELECT feature_outbox._tile_keep(
       pg_catalog.currval('feature_outbox.outbox_id_seq'::pg_catalog.regclass), $2, 'features', $1, 'moved', $3)";
const TILES_TYPES: [pg_sys::Oid; 3] = [pg_sys::INT8OID, pg_sys::BYTEAOID, pg_sys::UUIDOID];

/// The move `edit_feature(feature_id bigint, geometry geometry, event_type text)` of `fcinfo`, when
/// it is the case above: its new version. Called by the entry point as the extension's owner.
/// Raises what `_edit` raises for the same input on the same path (inspect's class-22 errors,
/// H3's); None: `_edit`'s.
pub(super) unsafe fn try_moved(fcinfo: pg_sys::FunctionCallInfo, declared: &Declared) -> Option<pg_sys::Datum> {
    unsafe {
        let id = moved_id(fcinfo)?;
        move_shape(id, pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, 1), declared.types[1])
    }
}

/// The same for `edit_feature(feature_id bigint, geometry text, event_type text)`: the GeoJSON text
/// parsed as `_geojson_to_ewkb` parses it (its errors, 22P02 and 22023, raised alike) and made a
/// geometry by PostGIS's ST_GeomFromEWKB, of the type the built-in table stores.
pub(super) unsafe fn try_moved_geojson(fcinfo: pg_sys::FunctionCallInfo, _declared: &Declared) -> Option<pg_sys::Datum> {
    unsafe {
        let id = moved_id(fcinfo)?;
        // Text that is not UTF-8 (non-ASCII in a database of another encoding) is _edit's way.
        let text = crate::server_text::utf8_as_is(datum_bytes::arg(fcinfo, 1))?;
        let ewkb = super::ok_or_report(crate::geojson::to_ewkb(text), "edit_feature");
        let geometry = features_geometry_type()?;
        let geom = postgis::functions(geometry).from_ewkb(&ewkb);
        move_shape(id, geom, geometry)
    }
}

/// The feature id of a call `(feature_id, shape, event_type)` that may be the built-in move: none
/// of the three NULL, and event_type 'moved'.
unsafe fn moved_id(fcinfo: pg_sys::FunctionCallInfo) -> Option<i64> {
    unsafe {
        if (0..3).any(|i| pgrx::fcinfo::pg_arg_is_null(fcinfo, i)) {
            return None;
        }
        if datum_bytes::arg(fcinfo, 2) != b"moved" {
            return None;
        }
        pgrx::fcinfo::pg_getarg::<i64>(fcinfo, 0)
    }
}

/// The type of feature_outbox.features.geom: PostGIS's geometry, in whatever schema PostGIS is.
fn features_geometry_type() -> Option<pg_sys::Oid> {
    let relid = crate::own_schema::relid(c"features");
    if relid == pg_sys::InvalidOid {
        return None;
    }
    let typid = unsafe { pg_sys::get_atttype(relid, pg_sys::get_attnum(relid, c"geom".as_ptr())) };
    (typid != pg_sys::InvalidOid).then_some(typid)
}

/// The built-in move of feature `id` to `geom` (a datum of PostGIS type `geometry`), when it is the
/// case above.
unsafe fn move_shape(id: i64, geom: pg_sys::Datum, geometry: pg_sys::Oid) -> Option<pg_sys::Datum> {
    unsafe {
        let pg = postgis::functions(geometry);
        if pg.is_empty(geom) {
            return None;
        }
        // One EWKB serves the type and SRID test, the Rust pass and the geometry digest.
        let ewkb = pg.as_ewkb(geom);
        if !simple_4326(ewkb) {
            return None;
        }
        let (facts, resolution) = super::inspect_edit(ewkb, true, 4326, None);
        if facts.crosses_antimeridian || !pg.is_valid(geom) {
            return None;
        }
        let [x, y] = pg.point_on_surface(geom);
        let key = super::_h3_cell(x, y, resolution);
        let geometry_digest = Uuid::from_bytes(super::digest::md5_bytes(ewkb));
        let properties_digest = Uuid::from_bytes(super::digest::md5_bytes(b"()"));
        let version = Spi::connect_mut(|client| {
            let plan = prepared(client, STATE, &STATE_TYPES, true);
            let args = [
                id.into(),
                key.as_str().into(),
                (resolution as i16).into(),
                vec![x, y].into(),
                facts.bbox.to_vec().into(),
                geometry_digest.into(),
                properties_digest.into(),
            ];
            let state = client.update(&*plan, None, &args).unwrap_or_else(|e| error!("{e}"));
            if state.is_empty() {
                return None;
            }
            let before = state.first();
            let previous_resolution = before.get::<i16>(1).ok().flatten();
            let previous_key = before.get::<String>(2).ok().flatten();
            let previous_point = before.get::<Vec<Option<f64>>>(3).ok().flatten().unwrap_or_default();
            let previous_bbox = before.get::<Vec<Option<f64>>>(4).ok().flatten();
            // The key before, at today's resolution (a change of feature_outbox.h3_resolution
            // between two edits must not show as a move to another cell): as _edit takes it,
            // _h3_cell(point[1], point[2]), NULL when either is.
            let previous_key = if previous_resolution.map(i32::from) == Some(resolution) {
                previous_key
            } else {
                match (previous_point.first().copied().flatten(), previous_point.get(1).copied().flatten()) {
                    (Some(lon), Some(lat)) => Some(super::_h3_cell(lon, lat, resolution)),
                    _ => None,
                }
            };

            let plan = prepared(client, FEATURE, &[pg_sys::INT8OID, geometry], true);
            let args = [id.into(), DatumWithOid::new(geom, geometry)];
            let feature = client.update(&*plan, None, &args).unwrap_or_else(|e| error!("{e}"));
            // Not found: the feature is retired or gone. _edit finds the same under the state
            // row's lock, which this transaction holds, and raises; that undoes this update.
            let version = feature.first().get::<i32>(1).ok().flatten()?;

            let plan = prepared(client, OUTBOX, &OUTBOX_TYPES, true);
            let args = [
                id.into(),
                version.into(),
                key.as_str().into(),
                previous_key.into(),
                previous_bbox.into(),
                geometry_digest.into(),
                properties_digest.into(),
            ];
            client.update(&*plan, None, &args).unwrap_or_else(|e| error!("{e}"));
            if crate::tiles::rule_cache::_layer_expires("features") {
                let plan = prepared(client, TILES, &TILES_TYPES, true);
                let args = [id.into(), pg.as_binary(geom).into(), properties_digest.into()];
                client.update(&*plan, None, &args).unwrap_or_else(|e| error!("{e}"));
            }
            Some(version)
        })?;
        crate::relay_state::_wake_relay_for(id);
        Some(pg_sys::Datum::from(version))
    }
}

/// Whether EWKB `ewkb` is a Point, LineString, Polygon or Multi form of them, with SRID 4326 and
/// without M (GeometryType's six simple names; Z passes, as `GeometryType` names it alike).
fn simple_4326(ewkb: &[u8]) -> bool {
    const SRID_FLAG: u32 = 0x2000_0000;
    const M_FLAG: u32 = 0x4000_0000;
    let word = |at: usize| -> Option<u32> {
        let b: [u8; 4] = ewkb.get(at..at + 4)?.try_into().ok()?;
        match ewkb.first() {
            Some(1) => Some(u32::from_le_bytes(b)),
            Some(0) => Some(u32::from_be_bytes(b)),
            _ => None,
        }
    };
    let Some(kind) = word(1) else { return false };
    kind & SRID_FLAG != 0 && kind & M_FLAG == 0 && (1..=6).contains(&(kind & 0x0fff_ffff)) && word(5) == Some(4326)
}

#[cfg(test)]
mod tests {
    use super::simple_4326;

    fn ewkb(little: bool, kind: u32, srid: Option<u32>) -> Vec<u8> {
        let word = |v: u32| if little { v.to_le_bytes() } else { v.to_be_bytes() };
        let mut out = vec![u8::from(little)];
        out.extend(word(kind | if srid.is_some() { 0x2000_0000 } else { 0 }));
        if let Some(s) = srid {
            out.extend(word(s));
        }
        out.extend([0u8; 16]);
        out
    }

    #[test]
    fn the_six_simple_types_in_4326_only() {
        for kind in 1..=6 {
            assert!(simple_4326(&ewkb(true, kind, Some(4326))), "type {kind}");
            assert!(simple_4326(&ewkb(false, kind, Some(4326))), "big-endian type {kind}");
            assert!(simple_4326(&ewkb(true, kind | 0x8000_0000, Some(4326))), "Z type {kind}");
            assert!(!simple_4326(&ewkb(true, kind | 0x4000_0000, Some(4326))), "M type {kind}");
            assert!(!simple_4326(&ewkb(true, kind, Some(3857))), "SRID 3857");
            assert!(!simple_4326(&ewkb(true, kind, None)), "no SRID");
        }
        for kind in [0, 7, 8, 9, 10, 15, 16, 17] {
            assert!(!simple_4326(&ewkb(true, kind, Some(4326))), "type {kind}");
        }
        assert!(!simple_4326(&[]));
        assert!(!simple_4326(&[1, 1, 0]));
        assert!(!simple_4326(&[2, 1, 0, 0, 0x20, 0xe6, 0x10, 0, 0]));
    }
}
