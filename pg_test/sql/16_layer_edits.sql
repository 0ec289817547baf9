-- Edits of a layer that cannot be written are refused with the input policy's SQLSTATE, and write
-- nothing: not the user's row, not an outbox row, no state. Properties are set as
-- jsonb_populate_record converts a JSON value to the column's type; a key that is not a registered
-- property is 22023 listing the allowed ones, a value that does not fit its column its class-22
-- error naming the property, a NOT NULL column that created leaves empty 23502 naming it.
CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 2263) NOT NULL, version integer NOT NULL DEFAULT 0,
                             name text, zoning varchar(4), lots integer, meta jsonb, seen timestamptz, retired_at timestamptz);
SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name,zoning,lots,meta,seen}', retired_column => 'retired_at');
\set block_a '{"type":"Polygon","coordinates":[[[-73.99,40.75],[-73.98,40.75],[-73.98,40.76],[-73.99,40.76],[-73.99,40.75]]]}'
\set block_b '{"type":"Polygon","coordinates":[[[-74.01,40.70],[-74.00,40.70],[-74.00,40.71],[-74.01,40.71],[-74.01,40.70]]]}'
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s parcels=%s/%s', written(), (SELECT count(*) FROM public.parcels), (SELECT coalesce(sum(version), 0) FROM public.parcels))
$$;

-- Values converted to their columns: a JSON string to an integer, an ISO time to timestamptz, any JSON to jsonb.
SELECT feature_outbox.edit_feature('parcels', 4, :'block_a', 'created',
         '{"name": "four", "zoning": "R6", "lots": "3", "seen": "2026-12-01T10:00:00Z", "meta": {"deep": [[[[1]]]]}}');
SELECT version, name, zoning, lots, meta, seen = '2026-12-01T10:00:00Z' AS seen_kept, ST_SRID(geom) FROM public.parcels;
-- Deeply nested JSON is a jsonb value like any other; null clears a property.
SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated',
         jsonb_build_object('meta', (repeat('[', 200) || repeat(']', 200))::jsonb, 'name', null));
SELECT version, name, jsonb_typeof(meta) AS meta FROM public.parcels;
SELECT counts();

-- An unknown layer (the hint lists the layers), a property that is not registered (the hint lists
-- them), properties that are not an object.
SELECT try($$SELECT feature_outbox.edit_feature('nosuch', 4, NULL::text, 'updated')$$);
SELECT try($$SELECT feature_outbox.edit_feature(NULL::text, 4, NULL::text, 'updated')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"colour": 1}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"version": 99}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"retired_at": "2020-01-01T00:00:00Z"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '[1]')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '"name"')$$);
-- Values that do not fit their columns.
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"lots": "many"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"lots": 1e12}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"lots": 1.5}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"zoning": "R10A-X"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, NULL::text, 'updated', '{"seen": "yesterday-ish"}')$$);
-- Geometry mistakes of a layer: a geometry with updated, a Point into a Polygon column, out of range.
SELECT try(format('SELECT feature_outbox.edit_feature(%L, 4, %L, %L)', 'parcels', :'block_b', 'updated'));
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, '{"type":"Point","coordinates":[-73.9,40.7]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, '{"type":"Point","coordinates":[200,40.7]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 4, '{"type":"Point","coordinates":[-73.9,40.7]}', 'teleported')$$);
-- Lifecycle: created twice, a missing id.
SELECT try(format('SELECT feature_outbox.edit_feature(%L, 4, %L, %L)', 'parcels', :'block_b', 'created'));
SELECT try(format('SELECT feature_outbox.edit_feature(%L, 5, %L, %L)', 'parcels', :'block_b', 'moved'));
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 5, NULL::text, 'updated', '{"lots": 1}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 5, NULL::text, 'retired')$$);
SELECT counts();
SELECT version, name, zoning, lots FROM public.parcels;

-- A NOT NULL column without a default that created cannot fill: 23502, naming it.
CREATE TABLE public.roads (id integer PRIMARY KEY, geom geometry(LineString, 4326), version integer NOT NULL DEFAULT 0, name text NOT NULL);
SELECT feature_outbox.register_layer('roads', 'public.roads', properties => '{name}');
SELECT try($$SELECT feature_outbox.edit_feature('roads', 1, '{"type":"LineString","coordinates":[[-73.99,40.75],[-73.98,40.76]]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('roads', 1, '{"type":"LineString","coordinates":[[-73.99,40.75],[-73.98,40.76]]}', 'created', '{"name": null}')$$);
SELECT count(*) AS roads FROM public.roads;
SELECT feature_outbox.edit_feature('roads', 1, '{"type":"LineString","coordinates":[[-73.99,40.75],[-73.98,40.76]]}', 'created', '{"name": "Broadway"}');
-- A CHECK constraint of the table applies as to the caller's own statement.
ALTER TABLE public.roads ADD CONSTRAINT short_names CHECK (length(name) < 20);
SELECT try($$SELECT feature_outbox.edit_feature('roads', 1, NULL::text, 'updated', '{"name": "A very long road name indeed"}')$$);
SELECT counts();
