-- edit_feature across a feature's life: created -> moved -> moved -> retired.
\set sq1 '{"type":"Polygon","coordinates":[[[13.40,52.52],[13.40,52.53],[13.41,52.53],[13.41,52.52],[13.40,52.52]]]}'
\set sq2 '{"type":"Polygon","coordinates":[[[2.34,48.85],[2.34,48.86],[2.35,48.86],[2.35,48.85],[2.34,48.85]]]}'

SELECT feature_outbox.edit_feature(4471, :'sq1', 'created') AS version;
SELECT feature_outbox.edit_feature(4471, :'sq2', 'moved') AS version;
SELECT feature_outbox.edit_feature(4471, ST_SetSRID(ST_MakePoint(-0.1276, 51.5072), 4326), 'moved') AS version;
SELECT feature_outbox.edit_feature(4471, NULL::text, 'retired') AS version;

-- One outbox row per call; previous_routing_key is the routing key of the geometry before the edit.
SELECT feature_version, event_type, routing_key, previous_routing_key, schema_version,
       previous_routing_key IS NOT DISTINCT FROM lag(routing_key) OVER (ORDER BY id) AS chained,
       published_at IS NULL AS unpublished
  FROM feature_outbox.outbox WHERE feature_id = 4471 ORDER BY id;
SELECT count(DISTINCT event_id) AS distinct_event_ids, count(*) FILTER (WHERE event_id IS NULL) AS null_ids
  FROM feature_outbox.outbox;

-- Retired with NULL keeps the last geometry; the feature is marked retired.
SELECT version, ST_AsText(geom) AS geom, retired_at IS NOT NULL AS retired, updated_at >= created_at AS updated
  FROM feature_outbox.features WHERE id = 4471;

-- The routing key is the H3 cell of ST_PointOnSurface, in the database.
SELECT routing_key = cell_of(ST_PointOnSurface(ST_GeomFromGeoJSON(:'sq2'))) AS moved_key_matches
  FROM feature_outbox.outbox WHERE feature_id = 4471 AND feature_version = 2;

-- Lifecycle errors, each writing nothing.
SELECT written();
SELECT try($$SELECT feature_outbox.edit_feature(4471, '{"type":"Point","coordinates":[1,2]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(4471, '{"type":"Point","coordinates":[1,2]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(4471, NULL::text, 'retired')$$);
SELECT try($$SELECT feature_outbox.edit_feature(5, '{"type":"Point","coordinates":[1,2]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(5, NULL::text, 'retired')$$);
SELECT feature_outbox.edit_feature(6, '{"type":"Point","coordinates":[1,2]}', 'created');
SELECT try($$SELECT feature_outbox.edit_feature(6, '{"type":"Point","coordinates":[1,2]}', 'created')$$);
SELECT written();

-- Retired with a geometry stores and routes it.
SELECT feature_outbox.edit_feature(6, '{"type":"Point","coordinates":[-73.9857,40.7484]}', 'retired') AS version;
SELECT ST_AsText(f.geom) AS geom, o.routing_key = feature_outbox.routing_key(f.geom) AS routed_from_new,
       o.previous_routing_key = feature_outbox.routing_key(ST_SetSRID(ST_MakePoint(1, 2), 4326)) AS previous_from_old
  FROM feature_outbox.features f JOIN feature_outbox.outbox o ON o.feature_id = f.id AND o.event_type = 'retired'
 WHERE f.id = 6;

-- The guide's first test: a rollback after edit_feature leaves no outbox row and no feature change.
BEGIN;
SELECT feature_outbox.edit_feature(7, '{"type":"Point","coordinates":[10,10]}', 'created');
SELECT count(*) AS visible_inside FROM feature_outbox.outbox WHERE feature_id = 7;
ROLLBACK;
BEGIN;
SELECT feature_outbox.edit_feature(8, '{"type":"Point","coordinates":[10,10]}', 'created');
ROLLBACK;
SELECT count(*) AS outbox_rows_for_rolled_back FROM feature_outbox.outbox WHERE feature_id IN (7, 8);
SELECT count(*) AS features_rolled_back FROM feature_outbox.features WHERE id IN (7, 8);
SELECT written();

-- Named notation works with the documented argument names.
SELECT feature_outbox.edit_feature(feature_id => 9, geometry => '{"type":"Point","coordinates":[5,5]}', event_type => 'created');

-- Another SRID is transformed to 4326 (ETRS89 / UTM 33N, Berlin).
SELECT feature_outbox.edit_feature(10, ST_SetSRID(ST_MakePoint(391000, 5820000), 25833), 'created');
SELECT ST_SRID(geom), round(ST_X(geom)::numeric, 3) AS lon, round(ST_Y(geom)::numeric, 3) AS lat
  FROM feature_outbox.features WHERE id = 10;
SELECT feature_outbox.edit_feature(11, '{"type":"Point","coordinates":[391000,5820000],"crs":{"type":"name","properties":{"name":"EPSG:25833"}}}', 'created');
SELECT ST_Equals(a.geom, b.geom) AS geojson_crs_same_as_geometry_form
  FROM feature_outbox.features a, feature_outbox.features b WHERE a.id = 10 AND b.id = 11;
SELECT feature_outbox.edit_feature(12, '{"type":"Point","coordinates":[13.4,52.5],"crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:OGC:1.3:CRS84"}}}', 'created');
SELECT ST_AsText(geom) FROM feature_outbox.features WHERE id = 12;

-- A nested GeometryCollection is valid GeoJSON (RFC 7946 discourages, does not forbid it): accepted.
SELECT feature_outbox.edit_feature(13, '{"type":"GeometryCollection","geometries":[{"type":"GeometryCollection","geometries":[{"type":"Point","coordinates":[1,2]}]}]}', 'created');
