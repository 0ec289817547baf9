-- A layer keyed by uuid (0.3.0) goes through every path: edit_feature by uuid or by text, however
-- the uuid is spelt, record_edit after the application's own write, backfill, drift and resync.
-- The user relies on one feature per uuid, its canonical spelling in the outbox, and a key that is
-- not a uuid refused (22P02) with nothing written.
CREATE TABLE public.sites (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), geom geometry(Point, 4326) NOT NULL,
                           version integer NOT NULL DEFAULT 0, name text);
SELECT feature_outbox.register_layer('sites', 'public.sites', properties => '{name}');
SELECT id_type FROM feature_outbox.layers WHERE layer = 'sites';
\set a '6f1c1e5e-4d1b-4b8e-9d53-3c2a1b0e9f10'
\set b '0b7a4a6c-9e1f-4c3d-8a2b-5d6e7f809a1b'
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('sites=%s outbox=%s state=%s keys=%s', (SELECT count(*) FROM public.sites),
                  (SELECT count(*) FROM feature_outbox.outbox WHERE layer = 'sites'),
                  (SELECT count(*) FROM feature_outbox.feature_state WHERE layer = 'sites'),
                  (SELECT count(*) FROM feature_outbox.feature_keys WHERE layer = 'sites'))
$$;

-- As uuid, as text in capitals, as text without hyphens: one feature.
SELECT feature_outbox.edit_feature('sites', :'a'::uuid, '{"type":"Point","coordinates":[10,50]}', 'created', '{"name": "a"}');
SELECT feature_outbox.edit_feature('sites', upper(:'a'), '{"type":"Point","coordinates":[11,50]}', 'moved');
SELECT feature_outbox.edit_feature('sites', replace(:'a', '-', ''), NULL::text, 'updated', '{"name": "a2"}');
SELECT feature_outbox.edit_feature('sites', :'a'::uuid, ST_SetSRID(ST_MakePoint(11.5, 50), 4326), 'moved');
SELECT counts();
SELECT feature_key, feature_version, event_type, feature_key = :'a' AS canonical FROM feature_outbox.outbox WHERE layer = 'sites' ORDER BY id;
SELECT count(DISTINCT feature_id) AS internal_numbers FROM feature_outbox.outbox WHERE layer = 'sites';

-- Refused, writing nothing: a key that is not a uuid, a NULL key, a bigint key, the same uuid
-- created twice (spelt otherwise), a uuid with no feature yet moved.
SELECT try($$SELECT feature_outbox.edit_feature('sites', 'parcel-7', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('sites', '', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('sites', NULL::uuid, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
-- (A bigint key reaches the table's own INSERT, whose message names its internal expression: the
-- SQLSTATE only here.)
SELECT left(try($$SELECT feature_outbox.edit_feature('sites', 42::bigint, '{"type":"Point","coordinates":[1,1]}', 'created')$$), 5) AS try;
SELECT try(format('SELECT feature_outbox.edit_feature(%L, %L::uuid, %L, %L)', 'sites', upper(:'a'), '{"type":"Point","coordinates":[1,1]}', 'created'));
SELECT try(format('SELECT feature_outbox.edit_feature(%L, %L::uuid, %L, %L)', 'sites', :'b', '{"type":"Point","coordinates":[1,1]}', 'moved'));
SELECT try($$SELECT feature_outbox.record_edit('sites', 'parcel-7', 'updated')$$);
SELECT counts();

-- The application writes the row itself (its default draws the uuid) and records the event.
BEGIN;
INSERT INTO public.sites (id, geom, name) VALUES (:'b', 'SRID=4326;POINT(12 51)', 'orm');
SELECT feature_outbox.record_edit('sites', :'b'::uuid, 'created');
COMMIT;
BEGIN;
UPDATE public.sites SET geom = 'SRID=4326;POINT(12.5 51)' WHERE id = :'b';
SELECT feature_outbox.record_edit('sites', upper(:'b'), 'moved');
COMMIT;
BEGIN;
INSERT INTO public.sites (geom, name) VALUES ('SRID=4326;POINT(13 51)', 'drawn by the default');
SELECT feature_outbox.record_edit('sites', (SELECT id FROM public.sites WHERE name = 'drawn by the default'), 'created');
COMMIT;
SELECT counts();

-- Rows written behind the product: backfill snapshots each under its own key, drift names them by it.
INSERT INTO public.sites (id, geom, name) VALUES ('00000000-0000-4000-8000-000000000001', 'SRID=4326;POINT(13 52)', 'old');
CALL feature_outbox.backfill('sites');
UPDATE public.sites SET geom = 'SRID=4326;POINT(-3.7 40.4)' WHERE id = :'a';
SELECT feature_id, change FROM feature_outbox.drift('sites');
CALL feature_outbox.resync('sites');
SELECT count(*) AS drifted FROM feature_outbox.drift('sites');
SELECT feature_key, event_type, feature_version FROM feature_outbox.outbox
 WHERE layer = 'sites' AND feature_key IN (:'a', '00000000-0000-4000-8000-000000000001') ORDER BY feature_key, id;
SELECT counts();
