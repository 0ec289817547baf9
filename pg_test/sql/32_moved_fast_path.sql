-- edit_feature(id, geometry, 'moved') and its GeoJSON form write a valid EPSG:4326 move of the
-- built-in layer in Rust (src/edit/moved.rs, reading the shape's EWKB); the layer form naming
-- 'features' (ISO WKB) goes through _edit, as does every other case. All must write the same rows:
-- features 1, 2 and 3 take each move in those three forms, and everything but the feature's id
-- must match (the outbox rows, the state row, the feature, the tiles queued for an expire output).
-- The moves are of several shapes (a point, a city-sized polygon, one with a hole, a line, with
-- feature_outbox.h3_resolution changed between them), cross the antimeridian and give an invalid
-- shape (both _edit's in every form), and end in the errors _edit raises for a retired feature and
-- a missing one, with nothing written.
SELECT feature_outbox.define_expire_output('tiles', 12, "table" => 'public.expire_tiles');
SELECT feature_outbox.expire_layer('features', 'tiles');
SELECT feature_outbox.edit_feature(i, ST_GeomFromText('POINT(2.35 48.85)', 4326), 'created') FROM generate_series(1, 3) i;
CREATE TABLE moves (n int, res int, g geometry);
INSERT INTO moves VALUES
  (1, 8, ST_GeomFromText('POINT(2.36 48.86)', 4326)),
  (2, 6, ST_GeomFromText('POLYGON((-74.1 40.6,-73.7 40.6,-73.7 40.9,-74.1 40.9,-74.1 40.6))', 4326)),
  (3, 6, ST_GeomFromText('LINESTRING(13.3 52.5,13.5 52.55,13.6 52.4)', 4326)),
  (4, 9, ST_GeomFromText('MULTIPOLYGON(((179.5 -17,180 -17,180 -16.5,179.5 -16.5,179.5 -17)),((-180 -17,-179.5 -17,-179.5 -16.5,-180 -16.5,-180 -17)))', 4326)),
  (5, 9, ST_GeomFromText('POLYGON((0 0,1 1,1 0,0 1,0 0))', 4326)),
  (6, 7, ST_GeomFromText('MULTIPOINT((10 10),(10.5 10.2))', 4326)),
  (7, 8, ST_Transform(ST_GeomFromText('POINT(2.37 48.87)', 4326), 3857)),
  (8, 8, ST_GeomFromText('POLYGON((2.3 48.8,2.5 48.8,2.5 49,2.3 49,2.3 48.8),(2.35 48.85,2.35 48.9,2.4 48.9,2.35 48.85))', 4326)),
  (9, 10, ST_GeomFromText('POINT(2.38 48.88)', 4326));
SET feature_outbox.invalid_geometry = 'repair';
SET feature_outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SET feature_outbox.tracestate = 'rojo=00f067aa0ba902b7';
-- Each move at the resolution of its row (feature_outbox.h3_resolution): a move after a change of
-- it carries the previous routing point's cell at the new one.
SELECT m.n, set_config('feature_outbox.h3_resolution', m.res::text, false) AS res, feature_outbox.edit_feature(1::bigint, m.g, 'moved') AS geometry_form,
       feature_outbox.edit_feature(2::bigint, ST_AsGeoJSON(m.g, 15, 2), 'moved') AS geojson_form,
       feature_outbox.edit_feature('features', 3::bigint, m.g, 'moved') AS layer_form
  FROM moves m ORDER BY m.n;
RESET feature_outbox.invalid_geometry;
RESET feature_outbox.h3_resolution;
RESET feature_outbox.traceparent;
RESET feature_outbox.tracestate;
SELECT count(*) AS traced FROM feature_outbox.outbox WHERE traceparent IS NOT NULL AND tracestate IS NOT NULL;
-- Rows of feature a that differ from feature b's, other than in their id: none, for each pair.
CREATE FUNCTION differ(a bigint, b bigint) RETURNS TABLE (rows text, differ bigint) LANGUAGE sql AS $$
SELECT 'outbox', count(*) FROM (
    SELECT feature_version, event_type, routing_key, previous_routing_key, layer, previous_bbox, geometry_digest,
           properties_digest, origin, schema_version, feature_key, traceparent, tracestate
      FROM feature_outbox.outbox WHERE feature_id IN (a, b)
     GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13
    HAVING count(*) FILTER (WHERE feature_id = a) <> count(*) FILTER (WHERE feature_id = b)) d
UNION ALL
SELECT 'state', count(*) FROM (
    SELECT routing_key, h3_resolution, routing_point, bbox, previous_routing_key, previous_h3_resolution,
           previous_routing_point, previous_bbox, geometry_digest, properties_digest, version, last_event
      FROM feature_outbox.feature_state WHERE layer = 'features' AND feature_id IN (a, b)
     GROUP BY 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 HAVING count(*) <> 2) d
UNION ALL
SELECT 'feature', count(DISTINCT (ST_AsEWKB(geom), version, retired_at IS NULL)) - 1
  FROM feature_outbox.features WHERE id IN (a, b)
UNION ALL
SELECT 'tiles', count(*) FROM (
    SELECT q.output, q.event_type, q.old_shape, q.new_shape, q.previous_bbox, q.properties_changed, o.feature_version
      FROM feature_outbox.tile_queue q JOIN feature_outbox.outbox o ON o.id = q.outbox_id
     WHERE q.feature_id IN (a, b)
     GROUP BY 1, 2, 3, 4, 5, 6, 7 HAVING count(*) <> 2) d
$$;
SELECT 'geometry vs GeoJSON' AS forms, * FROM differ(1, 2)
UNION ALL
SELECT 'geometry vs layer form', * FROM differ(1, 3);
-- What the moves recorded, feature 1's: its key's resolution and its previous key's, per version.
-- (An H3 cell's second hex digit is its resolution.)
SELECT o.feature_version, o.event_type, substr(o.routing_key, 2, 1) AS resolution,
       substr(o.previous_routing_key, 2, 1) AS previous_resolution, q.new_shape IS NOT NULL AS tiles_queued
  FROM feature_outbox.outbox o
  LEFT JOIN feature_outbox.tile_queue q ON q.outbox_id = o.id
 WHERE o.feature_id = 1 ORDER BY o.feature_version;
-- A 3-D shape: the same refusal (the Rust pass's) from each form, and nothing written.
SELECT try($$SELECT feature_outbox.edit_feature(1::bigint, ST_GeomFromText('POINT Z(2.38 48.88 35.5)', 4326), 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('features', 1::bigint, ST_GeomFromText('POINT Z(2.38 48.88 35.5)', 4326), 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(1::bigint, '{"type":"Point","coordinates":[2.38,48.88,35.5]}', 'moved')$$);
-- Retired, then moved: 55000 from either form, and nothing written; a missing feature: P0002.
SELECT feature_outbox.edit_feature(1::bigint, NULL::geometry, 'retired');
SELECT count(*) AS outbox_rows_before FROM feature_outbox.outbox WHERE feature_id = 1;
SELECT try($$SELECT feature_outbox.edit_feature(1::bigint, ST_GeomFromText('POINT(3 49)', 4326), 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(99::bigint, ST_GeomFromText('POINT(3 49)', 4326), 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(NULL::bigint, ST_GeomFromText('POINT(3 49)', 4326), 'moved')$$);
SELECT count(*) AS outbox_rows_after, max(feature_version) AS last_version, min(s.version) AS state_version
  FROM feature_outbox.outbox o, feature_outbox.feature_state s
 WHERE o.feature_id = 1 AND s.layer = 'features' AND s.feature_id = 1;
