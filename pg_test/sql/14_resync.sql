-- CALL resync(layer) writes the events drift lists: moved for geometry and both (previous key:
-- the cell subscribers last saw), updated for properties, retired for gone, created for no_event;
-- for unknown (state from before 0.3.0) it takes the digests without an event when the shape is
-- where its state says, and sends moved otherwise. It adds 1 to the row's version and changes
-- nothing else in the row; a second run writes nothing. The built-in layer is refused (0A000).
CREATE TABLE public.plots (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0,
                           name text, seen timestamptz, area float8, retired_at timestamptz);
SELECT feature_outbox.register_layer('plots', 'public.plots', properties => '{name,seen,area}', retired_column => 'retired_at');
SELECT feature_outbox.edit_feature('plots', i, ST_SetSRID(ST_MakePoint(2.0 + i / 10.0, 48.0), 4326), 'created',
         jsonb_build_object('name', 'plot ' || i, 'seen', '2026-12-01T10:00:00.123456+00:00', 'area', 0.1))
  FROM generate_series(1, 7) i \g /dev/null
CREATE FUNCTION key_of(lon float8, lat float8) RETURNS text LANGUAGE sql AS $$
    SELECT feature_outbox.routing_key(ST_SetSRID(ST_MakePoint(lon, lat), 4326))
$$;
CALL feature_outbox.resync('plots');

UPDATE public.plots SET geom = ST_SetSRID(ST_MakePoint(-3.7, 40.4), 4326) WHERE id = 1;
UPDATE public.plots SET name = 'renamed' WHERE id = 2;
UPDATE public.plots SET seen = seen + interval '1 second', geom = ST_SetSRID(ST_MakePoint(12.5, 41.9), 4326) WHERE id = 3;
DELETE FROM public.plots WHERE id = 4;
UPDATE public.plots SET retired_at = now() WHERE id = 5;
INSERT INTO public.plots (id, geom, version, name, area) VALUES (8, ST_SetSRID(ST_MakePoint(4.9, 52.4), 4326), 0, 'new', 2.5);
UPDATE public.plots SET version = version WHERE id = 6;
CREATE TABLE before AS SELECT * FROM public.plots;
SELECT count(*) AS outbox_rows_before, max(id) AS last_id FROM feature_outbox.outbox \gset
-- edit_feature's events say where they come from: the application.
SELECT origin, count(*) FROM feature_outbox.outbox GROUP BY origin;
SELECT * FROM feature_outbox.drift('plots') ORDER BY feature_id::bigint;

CALL feature_outbox.resync('plots');
SELECT count(*) AS drifted FROM feature_outbox.drift('plots');
SELECT drifted_rows FROM feature_outbox.backlog_by_layer WHERE layer = 'plots';
-- One event each: the move from the cell subscribers saw, the retirement where it was; each says
-- resync wrote it (origin), the deleted row's too, which resync writes without _edit.
SELECT o.feature_id, o.event_type, o.feature_version, o.origin,
       o.routing_key = CASE o.feature_id WHEN 1 THEN key_of(-3.7, 40.4) WHEN 3 THEN key_of(12.5, 41.9)
                                         WHEN 8 THEN key_of(4.9, 52.4) ELSE key_of(2.0 + o.feature_id / 10.0, 48.0) END AS routed_on_the_row,
       o.previous_routing_key IS NOT DISTINCT FROM CASE WHEN o.feature_id <> 8 THEN key_of(2.0 + o.feature_id / 10.0, 48.0) END
           AS previous_is_what_subscribers_saw
  FROM feature_outbox.outbox o WHERE o.id > :last_id
 ORDER BY o.feature_id;
-- The version column is the only change to the rows.
SELECT p.id, b.version AS version_before, p.version,
       (to_jsonb(p) - 'version') = (to_jsonb(b) - 'version') AS nothing_else_changed
  FROM public.plots p JOIN before b USING (id) ORDER BY p.id;
-- A second run writes nothing.
CALL feature_outbox.resync('plots');
SELECT count(*) - :outbox_rows_before AS events_written FROM feature_outbox.outbox;

-- State from before 0.3.0: the unmoved row gets its digests without an event, the moved one a moved.
UPDATE feature_outbox.feature_state SET geometry_digest = NULL, properties_digest = NULL, version = NULL, last_event = NULL
 WHERE layer = 'plots' AND feature_id IN (6, 7);
UPDATE public.plots SET geom = ST_SetSRID(ST_MakePoint(-60, -20), 4326) WHERE id = 7;
SELECT * FROM feature_outbox.drift('plots') ORDER BY 1;
CALL feature_outbox.resync('plots');
SELECT count(*) AS drifted FROM feature_outbox.drift('plots');
SELECT feature_id, last_event FROM feature_outbox.feature_state WHERE layer = 'plots' AND feature_id IN (6, 7) ORDER BY 1;
SELECT feature_id, event_type, origin FROM feature_outbox.outbox WHERE layer = 'plots' ORDER BY id DESC LIMIT 1;

-- Refusals, each writing nothing.
SELECT written();
SELECT try($$CALL feature_outbox.resync('features')$$);
SELECT try($$CALL feature_outbox.resync('nosuch')$$);
SELECT try($$CALL feature_outbox.resync(NULL)$$);
SELECT try($$CALL feature_outbox.resync('plots', 0)$$);
SELECT try($$CALL feature_outbox.resync('plots', -1)$$);
SELECT written();

-- resync's origin ends with it, also when it failed (the refusals above raised inside it): the
-- session's next edit is the application's again.
SELECT feature_outbox.edit_feature('plots', 9, ST_SetSRID(ST_MakePoint(2.5, 48.0), 4326), 'created', '{"name": "plot 9"}');
SELECT feature_id, event_type, origin FROM feature_outbox.outbox ORDER BY id DESC LIMIT 1;
