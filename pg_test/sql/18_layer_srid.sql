-- A layer in a projected CRS: input in any SRID is routed in EPSG:4326 and stored in the column's
-- SRID. Every shape is held to the column CRS's area of use (0.3.0), whatever CRS it came in, at
-- created as at moved, so nothing is stored that a later edit in the column's own SRID would
-- refuse: 22023 naming the CRS and the layer, with a hint. A single geometry is promoted to its
-- Multi form for a Multi column; any other type mismatch is 22023. Refusals write nothing.
CREATE TABLE public.ny_parcels (id bigint PRIMARY KEY, geom geometry(MultiPolygon, 2263) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('ny_parcels', 'public.ny_parcels');
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s ny_parcels=%s', written(), (SELECT count(*) FROM public.ny_parcels))
$$;
-- Two squares: one in Manhattan, one in Seattle (Washington, far outside NY State Plane).
\set manhattan '{"type":"Polygon","coordinates":[[[-73.99,40.75],[-73.98,40.75],[-73.98,40.76],[-73.99,40.76],[-73.99,40.75]]]}'
\set seattle '{"type":"Polygon","coordinates":[[[-122.35,47.60],[-122.30,47.60],[-122.30,47.65],[-122.35,47.65],[-122.35,47.60]]]}'

-- Manhattan: stored in EPSG:2263 feet, promoted to a MultiPolygon, routed from 4326.
SELECT feature_outbox.edit_feature('ny_parcels', 1, :'manhattan', 'created');
SELECT ST_SRID(geom), GeometryType(geom), ST_NumGeometries(geom),
       ST_Equals(ST_SnapToGrid(ST_Transform(ST_GeometryN(geom, 1), 4326), 1e-9),
                 ST_SnapToGrid(ST_SetSRID(ST_GeomFromGeoJSON(:'manhattan'), 4326), 1e-9)) AS same_shape
  FROM public.ny_parcels;
SELECT routing_key = feature_outbox.routing_key(ST_SetSRID(ST_GeomFromGeoJSON(:'manhattan'), 4326)) AS routed_in_4326
  FROM feature_outbox.outbox WHERE layer = 'ny_parcels';
-- Its move given in the column's own SRID is accepted: the same rule.
SELECT feature_outbox.edit_feature('ny_parcels', 1, ST_Translate((SELECT geom FROM public.ny_parcels WHERE id = 1), 100, 100), 'moved');
SELECT counts();

-- Seattle, as GeoJSON (4326), as a geometry in 4326, and transformed to 2263 by the caller: the
-- message names the CRS and the layer, the hint a CRS that would cover it and the margin.
SELECT try_says(format('SELECT feature_outbox.edit_feature(%L, 2, %L, %L)', 'ny_parcels', :'seattle', 'created'),
                'outside the area of use of EPSG:2263', '"ny_parcels"', '(-122.35, 47.6)', 'HINT: A later edit in EPSG:2263 would be refused',
                'EPSG:4326', 'area_of_use_margin');
SELECT try_says(format('SELECT feature_outbox.edit_feature(%L, 2, ST_SetSRID(ST_GeomFromGeoJSON(%L), 4326), %L)', 'ny_parcels', :'seattle', 'created'),
                'outside the area of use of EPSG:2263', '"ny_parcels"', 'HINT:');
SELECT try_says(format('SELECT feature_outbox.edit_feature(%L, 2, ST_Transform(ST_SetSRID(ST_GeomFromGeoJSON(%L), 4326), 2263), %L)',
                       'ny_parcels', :'seattle', 'created'), 'outside the area of use of EPSG:2263', 'HINT:');
SELECT try_says(format('SELECT feature_outbox.edit_feature(%L, 1, %L, %L)', 'ny_parcels', :'seattle', 'moved'),
                'outside the area of use of EPSG:2263', '"ny_parcels"', 'HINT:');
SELECT counts();

-- Types: a Point has no lossless promotion to MultiPolygon.
SELECT try($$SELECT feature_outbox.edit_feature('ny_parcels', 3, '{"type":"Point","coordinates":[-73.98,40.75]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('ny_parcels', 3, '{"type":"LineString","coordinates":[[-73.98,40.75],[-73.97,40.75]]}', 'created')$$);
SELECT counts();
-- repair turning a Polygon into a MultiPolygon, which a Polygon column cannot take.
CREATE TABLE public.blocks (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('blocks', 'public.blocks');
SET feature_outbox.invalid_geometry = repair;
SELECT try($$SELECT feature_outbox.edit_feature('blocks', 6, 'SRID=4326;POLYGON((-73.99 40.75,-73.98 40.76,-73.98 40.75,-73.99 40.76,-73.99 40.75))'::geometry, 'created')$$);
RESET feature_outbox.invalid_geometry;
SELECT try($$SELECT feature_outbox.edit_feature('blocks', 6, '{"type":"MultiPolygon","coordinates":[[[[0,0],[1,0],[1,1],[0,0]]]]}', 'created')$$);
SELECT counts();

-- A polar stereographic column (Antarctica) given the North Pole; Europe's LAEA given the South Pacific.
CREATE TABLE public.polar (id int PRIMARY KEY, geom geometry(Point, 3031) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('polar', 'public.polar');
CREATE TABLE public.europe (id int PRIMARY KEY, geom geometry(Point, 3035) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('europe', 'public.europe');
SELECT try_says($$SELECT feature_outbox.edit_feature('polar', 1, '{"type":"Point","coordinates":[0,90]}', 'created')$$,
                'outside the area of use of EPSG:3031', '"polar"', 'HINT:');
SELECT try_says($$SELECT feature_outbox.edit_feature('europe', 1, 'SRID=4326;POINT(-170 -52)'::geometry, 'created')$$,
                'outside the area of use of EPSG:3035', '"europe"', 'HINT:');
SELECT feature_outbox.edit_feature('polar', 2, '{"type":"Point","coordinates":[0,-80]}', 'created');
SELECT feature_outbox.edit_feature('europe', 2, 'SRID=4326;POINT(10 50)'::geometry, 'created');
SELECT id, ST_SRID(geom) FROM public.polar UNION ALL SELECT id, ST_SRID(geom) FROM public.europe;
SELECT counts();
