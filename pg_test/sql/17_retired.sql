-- retired on a layer: with a retired column it sets that column (the row stays, and takes no
-- further edit: 55000; its id is not reused: 23505); without one it deletes the row (a later edit
-- finds no feature: P0002). A NULL geometry keeps the last one; a given geometry is stored and
-- routed. The user relies on a retired feature never coming back by accident.
CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0,
                             name text, retired_at timestamptz);
SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name}', retired_column => 'retired_at');
CREATE TABLE public.plain (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('plain', 'public.plain');
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s parcels=%s/%s plain=%s/%s', written(), (SELECT count(*) FROM public.parcels),
                  (SELECT coalesce(sum(version), 0) FROM public.parcels), (SELECT count(*) FROM public.plain),
                  (SELECT coalesce(sum(version), 0) FROM public.plain))
$$;

-- With a retired column: the row stays, marked.
SELECT feature_outbox.edit_feature('parcels', 1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created', '{"name": "one"}');
SELECT feature_outbox.edit_feature('parcels', 1, NULL::text, 'retired');
SELECT id, version, name, ST_AsText(geom), retired_at IS NOT NULL AS retired FROM public.parcels;
-- With a geometry: stored and routed there, previous key from before.
SELECT feature_outbox.edit_feature('parcels', 2, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT feature_outbox.edit_feature('parcels', 2, '{"type":"Point","coordinates":[2.35,48.86]}', 'retired');
SELECT ST_AsText(geom) FROM public.parcels WHERE id = 2;
SELECT feature_id, feature_version, event_type,
       routing_key = feature_outbox.routing_key('SRID=4326;POINT(2.35 48.86)') AS routed_on_the_given_geometry,
       previous_routing_key = feature_outbox.routing_key('SRID=4326;POINT(13.4 52.5)') AS previous_from_before
  FROM feature_outbox.outbox WHERE layer = 'parcels' AND event_type = 'retired' ORDER BY id;

-- A retired feature takes no further edit, and its id is not reused; each refusal writes nothing.
SELECT counts();
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 1, '{"type":"Point","coordinates":[1,1]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 1, NULL::text, 'updated', '{"name": "again"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 1, NULL::text, 'retired')$$);
SELECT try($$SELECT feature_outbox.edit_feature('parcels', 1, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
BEGIN;
UPDATE public.parcels SET name = 'again' WHERE id = 1;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 1, 'updated')$$);
ROLLBACK;
SELECT counts();

-- Without a retired column: the row is deleted, and the id is gone for edits.
SELECT feature_outbox.edit_feature('plain', 1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT feature_outbox.edit_feature('plain', 1, NULL::text, 'retired');
SELECT count(*) AS plain_rows FROM public.plain;
SELECT feature_version, event_type, routing_key = previous_routing_key AS routed_where_it_was
  FROM feature_outbox.outbox WHERE layer = 'plain' ORDER BY id;
SELECT counts();
SELECT try($$SELECT feature_outbox.edit_feature('plain', 1, '{"type":"Point","coordinates":[1,1]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('plain', 1, NULL::text, 'retired')$$);
SELECT try($$SELECT feature_outbox.edit_feature('plain', 1, NULL::text, 'updated')$$);
-- A live feature of such a layer: created again is 23505 all the same.
SELECT feature_outbox.edit_feature('plain', 2, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT try($$SELECT feature_outbox.edit_feature('plain', 2, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT counts();
