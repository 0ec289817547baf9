-- record_edit(layer, id, event_type) writes the event of a row the application wrote itself, in
-- the same transaction. The user relies on it never inventing an event: a row this transaction
-- has not written since its last event is refused (55000), a lock is not a write, a second call
-- for the same row version is refused, and every refusal writes nothing. created for a row with
-- events is 23505, a missing row P0002, the built-in layer 22023; retired sets the retired column
-- or deletes the row.
CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                             version integer NOT NULL DEFAULT 0, name text, lots integer, retired_at timestamptz);
SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name,lots}', retired_column => 'retired_at');
CREATE TABLE public.plain (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('plain', 'public.plain');
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('outbox=%s state=%s parcels=%s/%s plain=%s/%s', (SELECT count(*) FROM feature_outbox.outbox),
                  (SELECT count(*) FROM feature_outbox.feature_state),
                  (SELECT count(*) FROM public.parcels), (SELECT coalesce(sum(version), 0) FROM public.parcels),
                  (SELECT count(*) FROM public.plain), (SELECT coalesce(sum(version), 0) FROM public.plain))
$$;

-- The ORM path, inside a savepoint too: created, updated, moved, retired.
BEGIN;
INSERT INTO public.parcels (id, geom, name) VALUES (2, 'SRID=4326;POINT(-73.95 40.78)', 'ORM lot');
SAVEPOINT s;
SELECT feature_outbox.record_edit('parcels', 2, 'created');
RELEASE s;
COMMIT;
BEGIN;
UPDATE public.parcels SET lots = 7 WHERE id = 2;
SELECT feature_outbox.record_edit('parcels', 2, 'updated');
COMMIT;
BEGIN;
SAVEPOINT s;
UPDATE public.parcels SET geom = 'SRID=4326;POINT(-73.99 40.75)' WHERE id = 2;
SELECT feature_outbox.record_edit('parcels', 2, 'moved');
COMMIT;
BEGIN;
UPDATE public.parcels SET retired_at = now() WHERE id = 2;
SELECT feature_outbox.record_edit('parcels', 2, 'retired');
COMMIT;
SELECT id, version, name, lots, retired_at IS NOT NULL AS retired FROM public.parcels;
SELECT feature_version, event_type, origin, routing_key = feature_outbox.routing_key('SRID=4326;POINT(-73.99 40.75)') AS at_the_new_place,
       previous_routing_key = feature_outbox.routing_key('SRID=4326;POINT(-73.95 40.78)') AS from_the_old_place
  FROM feature_outbox.outbox WHERE layer = 'parcels' AND feature_id = 2 ORDER BY id;

-- A row this transaction did not write.
SELECT feature_outbox.edit_feature('parcels', 3, '{"type":"Point","coordinates":[-73.98,40.75]}', 'created');
SELECT counts();
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'moved')$$);
-- A lock is not a write.
BEGIN;
SELECT id FROM public.parcels WHERE id = 3 FOR UPDATE;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'updated')$$);
ROLLBACK;
-- A second call for the same row version, and a call after edit_feature's own write.
BEGIN;
UPDATE public.parcels SET name = 'x' WHERE id = 3;
SELECT feature_outbox.record_edit('parcels', 3, 'updated');
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'updated')$$);
SELECT feature_outbox.edit_feature('parcels', 3, NULL::text, 'updated', '{"lots": 1}');
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'updated')$$);
ROLLBACK;
-- A write in a savepoint that rolled back is no write.
BEGIN;
SAVEPOINT s;
UPDATE public.parcels SET name = 'y' WHERE id = 3;
ROLLBACK TO s;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'updated')$$);
ROLLBACK;
SELECT counts();

-- A missing row, the built-in layer, an unknown layer, an unknown event type, created again.
SELECT try($$SELECT feature_outbox.record_edit('parcels', 999, 'moved')$$);
SELECT try($$SELECT feature_outbox.record_edit('features', 1, 'moved')$$);
SELECT try($$SELECT feature_outbox.record_edit('nosuch', 1, 'moved')$$);
BEGIN;
UPDATE public.parcels SET name = 'z' WHERE id = 3;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'renamed')$$);
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'snapshot')$$);
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, NULL)$$);
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'created')$$);
-- updated keeps the routing key: a geometry changed since the last event must be recorded as moved.
UPDATE public.parcels SET geom = 'SRID=4326;POINT(9.7 52.4)' WHERE id = 3;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 3, 'updated')$$);
ROLLBACK;
SELECT counts();

-- A created row the application inserted before recording: version 1; then a retired row takes
-- no further event.
BEGIN;
INSERT INTO public.parcels (id, geom, version) VALUES (4, 'SRID=4326;POINT(1 1)', 41);
SELECT feature_outbox.record_edit('parcels', 4, 'created');
COMMIT;
SELECT version FROM public.parcels WHERE id = 4;
BEGIN;
UPDATE public.parcels SET name = 'after' WHERE id = 2;
SELECT try($$SELECT feature_outbox.record_edit('parcels', 2, 'updated')$$);
ROLLBACK;

-- Without a retired column, retired deletes the row: its own write, after the application's.
SELECT feature_outbox.edit_feature('plain', 1, '{"type":"Point","coordinates":[10,20]}', 'created');
BEGIN;
UPDATE public.plain SET version = version WHERE id = 1;
SELECT try($$SELECT feature_outbox.record_edit('plain', 1, 'created')$$);
SELECT feature_outbox.record_edit('plain', 1, 'retired');
COMMIT;
SELECT count(*) AS plain_rows FROM public.plain;
SELECT feature_version, event_type FROM feature_outbox.outbox WHERE layer = 'plain' ORDER BY id;

-- A partitioned table: each partition's rows, and the same refusal of a second call.
CREATE TABLE public.zones (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0)
    PARTITION BY RANGE (id);
CREATE TABLE public.zones_low PARTITION OF public.zones FOR VALUES FROM (0) TO (1000);
CREATE TABLE public.zones_high PARTITION OF public.zones FOR VALUES FROM (1000) TO (MAXVALUE);
SELECT feature_outbox.register_layer('zones', 'public.zones');
SELECT feature_outbox.edit_feature('zones', id, '{"type":"Point","coordinates":[10,20]}', 'created') FROM (VALUES (5), (5000)) v(id);
SELECT feature_outbox.edit_feature('zones', id, '{"type":"Point","coordinates":[11,21]}', 'moved') FROM (VALUES (5), (5000)) v(id);
BEGIN;
UPDATE public.zones SET geom = ST_SetSRID(ST_MakePoint(12, 22), 4326);
SELECT feature_outbox.record_edit('zones', id, 'moved') FROM (VALUES (5), (5000)) v(id);
SELECT try($$SELECT feature_outbox.record_edit('zones', 5, 'moved')$$);
SELECT try($$SELECT feature_outbox.record_edit('zones', 5000, 'moved')$$);
COMMIT;
SELECT id, version, tableoid::regclass AS partition FROM public.zones ORDER BY id;
SELECT feature_id, feature_version, event_type FROM feature_outbox.outbox WHERE layer = 'zones' ORDER BY feature_id, id;
