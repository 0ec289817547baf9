-- A layer keyed by text or varchar (0.3.0): the key is kept exactly as the application stores it
-- (case, slashes, umlauts, spaces), through edit_feature, record_edit, retired, drift and resync.
-- A key the column cannot hold is refused with its class-22 error, and writes nothing. The text
-- forms serve integer layers too.
CREATE TABLE public.stops (code varchar(12) PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                           version integer NOT NULL DEFAULT 0, name text, retired_at timestamptz);
SELECT feature_outbox.register_layer('stops', 'public.stops', id_column => 'code', properties => '{name}',
                                     retired_column => 'retired_at');
CREATE TABLE public.plots (id integer PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('plots', 'public.plots');
SELECT layer, id_type FROM feature_outbox.layers WHERE layer IN ('stops', 'plots') ORDER BY layer;
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('stops=%s outbox=%s state=%s', (SELECT count(*) FROM public.stops),
                  (SELECT count(*) FROM feature_outbox.outbox WHERE layer = 'stops'),
                  (SELECT count(*) FROM feature_outbox.feature_state WHERE layer = 'stops'))
$$;

SELECT feature_outbox.edit_feature('stops', 'STOP-001/Ü', '{"type":"Point","coordinates":[1,1]}', 'created', '{"name": "one"}');
SELECT feature_outbox.edit_feature('stops', 'stop-001/ü', '{"type":"Point","coordinates":[2,2]}', 'created', '{"name": "other"}');
SELECT feature_outbox.edit_feature('stops', ' a b ', '{"type":"Point","coordinates":[3,3]}', 'created');
SELECT feature_outbox.edit_feature('stops', 'STOP-001/Ü', '{"type":"Point","coordinates":[1.5,1]}', 'moved');
SELECT code, version, name FROM public.stops ORDER BY code COLLATE "C";
SELECT format('%L', feature_key) AS feature_key, feature_version, event_type FROM feature_outbox.outbox WHERE layer = 'stops' ORDER BY id;

-- Refused, writing nothing: too long for varchar(12), NULL, a case-different key (another feature,
-- so P0002), a duplicate (23505), record_edit of a key the table does not have.
SELECT counts();
SELECT try($$SELECT feature_outbox.edit_feature('stops', 'STOP-0000000001', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('stops', NULL::text, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('stops', 'Stop-001/ü', '{"type":"Point","coordinates":[1,1]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature('stops', ' a b ', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.record_edit('stops', 'nobody', 'updated')$$);
SELECT counts();

-- record_edit and retired by text key.
BEGIN;
UPDATE public.stops SET name = 'renamed' WHERE code = 'STOP-001/Ü';
SELECT feature_outbox.record_edit('stops', 'STOP-001/Ü', 'updated');
COMMIT;
SELECT feature_outbox.edit_feature('stops', 'stop-001/ü', NULL::text, 'retired');
SELECT try($$SELECT feature_outbox.edit_feature('stops', 'stop-001/ü', NULL::text, 'updated', '{"name": "x"}')$$);

-- drift and resync by text key: a plain DELETE and a row inserted by hand.
DELETE FROM public.stops WHERE code = ' a b ';
INSERT INTO public.stops VALUES ('HAND-1', 'SRID=4326;POINT(5 5)', 0, 'by hand');
SELECT format('%L', feature_id) AS feature_id, change FROM feature_outbox.drift('stops') ORDER BY 1;
CALL feature_outbox.resync('stops');
SELECT count(*) AS drifted FROM feature_outbox.drift('stops');
SELECT format('%L', feature_key) AS feature_key, feature_version, event_type FROM feature_outbox.outbox
 WHERE layer = 'stops' ORDER BY id;

-- An integer layer takes its key as text too; a text that is no integer is 22P02, one too large 22003.
SELECT feature_outbox.edit_feature('plots', '7', '{"type":"Point","coordinates":[1,1]}', 'created');
SELECT feature_outbox.edit_feature('plots', 7::bigint, '{"type":"Point","coordinates":[2,2]}', 'moved');
SELECT try($$SELECT feature_outbox.edit_feature('plots', 'seven', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('plots', '99999999999', '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('plots', 99999999999::bigint, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT feature_id, feature_key, feature_version, event_type FROM feature_outbox.outbox WHERE layer = 'plots' ORDER BY id;
SELECT id, version FROM public.plots;
