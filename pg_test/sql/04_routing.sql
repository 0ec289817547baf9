-- The routing point: inside the footprint, made-valid when invalid, shifted across the antimeridian.

-- A crescent whose centroid falls outside it (the guide's gotcha 6): the routing point is inside.
\set crescent '{"type":"Polygon","coordinates":[[[0,0],[10,0],[10,10],[0,10],[0,8],[8,8],[8,2],[0,2],[0,0]]]}'
SELECT feature_outbox.edit_feature(1, :'crescent', 'created');
SELECT ST_Contains(f.geom, ST_Centroid(f.geom)) AS centroid_inside,
       ST_Contains(f.geom, feature_outbox._routing_point(f.geom)) AS routing_point_inside,
       o.routing_key = cell_of(ST_PointOnSurface(f.geom)) AS key_is_point_on_surface
  FROM feature_outbox.features f JOIN feature_outbox.outbox o ON o.feature_id = f.id WHERE f.id = 1;

-- A polygon drawn across the antimeridian (an edge spans more than 180 degrees of longitude).
\set across '{"type":"Polygon","coordinates":[[[178.0,51.0],[-179.0,51.0],[-179.0,52.0],[178.0,52.0],[178.0,51.0]]]}'
SELECT feature_outbox.edit_feature(2, :'across', 'created');
SELECT round(ST_X(p)::numeric, 6) AS x, round(ST_Y(p)::numeric, 6) AS y,
       ST_X(p) BETWEEN -180 AND 180 AS wrapped,
       (ST_X(p) >= 178 OR ST_X(p) <= -179) AS inside_real_footprint
  FROM (SELECT feature_outbox._routing_point(geom) AS p FROM feature_outbox.features WHERE id = 2) s;
SELECT routing_key = cell_of(ST_SetSRID(ST_MakePoint(179.5, 51.5), 4326)) AS key_at_the_antimeridian
  FROM feature_outbox.outbox WHERE feature_id = 2;
-- Parts on both sides with no edge across (like Aleutians West): no shift, point inside a part.
SELECT ST_Intersects(g, feature_outbox._routing_point(g)) AS inside
  FROM (SELECT ST_GeomFromText('MULTIPOLYGON(((178 51,179 51,179 52,178 52,178 51)),((-179.5 51,-179 51,-179 52,-179.5 52,-179.5 51)))', 4326) g) s;

-- Invalid bow-tie: routed from a made-valid copy under every policy.
\set bowtie '{"type":"Polygon","coordinates":[[[0,0],[2,2],[2,0],[0,2],[0,0]]]}'
SELECT feature_outbox.edit_feature(3, :'bowtie', 'created');
SELECT ST_IsValid(geom) AS stored_valid, ST_Intersects(ST_MakeValid(geom), feature_outbox._routing_point(geom)) AS inside
  FROM feature_outbox.features WHERE id = 3;
SET feature_outbox.invalid_geometry = repair;
SELECT feature_outbox.edit_feature(4, :'bowtie', 'created');
SELECT ST_IsValid(geom) AS stored_valid, GeometryType(geom), o.routing_key = o2.routing_key AS same_key_as_accept
  FROM feature_outbox.features f, feature_outbox.outbox o, feature_outbox.outbox o2
 WHERE f.id = 4 AND o.feature_id = 4 AND o2.feature_id = 3;
SET feature_outbox.invalid_geometry = reject;
SELECT written();
SELECT try(format('SELECT feature_outbox.edit_feature(5, %L, %L)', :'bowtie', 'created'));
SELECT written();
RESET feature_outbox.invalid_geometry;

-- The resolution GUC sets the cell size for new rows.
SET feature_outbox.h3_resolution = 4;
SELECT feature_outbox.edit_feature(6, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT routing_key, length(routing_key) FROM feature_outbox.outbox WHERE feature_id = 6;
RESET feature_outbox.h3_resolution;
SELECT feature_outbox.routing_key(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326));
