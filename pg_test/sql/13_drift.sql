-- drift(layer) lists the rows that differ from their last event, one change each: geometry,
-- properties, both, gone (deleted or retired behind the product), no_event (inserted behind it)
-- and unknown (state from before 0.3.0, without digests). A write that changes nothing an event
-- carries is no drift, and the session's settings (TimeZone, extra_float_digits, DateStyle) do
-- not change the digests. Each run records its count in backlog_by_layer. The user relies on
-- drift writing no event and changing no row.
CREATE TABLE public.plots (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0,
                           name text, seen timestamptz, area float8, retired_at timestamptz);
SELECT feature_outbox.register_layer('plots', 'public.plots', properties => '{name,seen,area}', retired_column => 'retired_at');
SELECT feature_outbox.edit_feature('plots', i, ST_SetSRID(ST_MakePoint(2.0 + i / 10.0, 48.0), 4326), 'created',
         jsonb_build_object('name', 'plot ' || i, 'seen', '2026-12-01T10:00:00.123456+00:00', 'area', 0.1))
  FROM generate_series(1, 7) i \g /dev/null
SELECT drifted_rows, drift_checked_at FROM feature_outbox.backlog_by_layer WHERE layer = 'plots';
SELECT * FROM feature_outbox.drift('plots');
SELECT drifted_rows, drift_checked_at > now() - interval '1 minute' AS checked_now FROM feature_outbox.backlog_by_layer WHERE layer = 'plots';

-- The same rows, printed another way: still no drift.
SET TimeZone = 'Asia/Kolkata';
SET extra_float_digits = -3;
SET DateStyle = 'German';
SELECT count(*) AS drifted_under_other_settings FROM feature_outbox.drift('plots');
RESET TimeZone;
RESET extra_float_digits;
RESET DateStyle;

-- Writes behind the product, one of each kind.
UPDATE public.plots SET geom = ST_SetSRID(ST_MakePoint(-3.7, 40.4), 4326) WHERE id = 1;
UPDATE public.plots SET name = 'renamed' WHERE id = 2;
UPDATE public.plots SET seen = seen + interval '1 second', geom = ST_SetSRID(ST_MakePoint(12.5, 41.9), 4326) WHERE id = 3;
DELETE FROM public.plots WHERE id = 4;
UPDATE public.plots SET retired_at = now() WHERE id = 5;
INSERT INTO public.plots (id, geom, version, name, area) VALUES (8, ST_SetSRID(ST_MakePoint(4.9, 52.4), 4326), 0, 'new', 2.5);
UPDATE public.plots SET version = version WHERE id = 6;  -- changes nothing an event carries
UPDATE public.plots SET area = 0.1 + 0 WHERE id = 7;     -- the same value written again
SELECT written();
SELECT * FROM feature_outbox.drift('plots') ORDER BY feature_id::bigint;
SELECT drifted_rows, drift_checked_at > now() - interval '1 minute' AS checked_now FROM feature_outbox.backlog_by_layer WHERE layer = 'plots';
-- drift wrote nothing and changed no row.
SELECT written();
SELECT id, version FROM public.plots ORDER BY id;

-- An updated event keeps the feature's routing key, so it is refused (22023) for a row whose
-- geometry changed since its last event, and writes nothing; the hint says to send moved, or resync.
SELECT written();
SELECT try($$SELECT feature_outbox.edit_feature('plots', 1, NULL::text, 'updated', '{"name": "x"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('plots', 3, NULL::text, 'updated', '{"name": "x"}')$$);
SELECT name FROM public.plots WHERE id IN (1, 3) ORDER BY id;
-- Properties changed behind the product do not stop an updated event, which carries them.
SELECT try($$SELECT feature_outbox.edit_feature('plots', 2, NULL::text, 'updated', '{"area": 0.2}')$$);
SELECT * FROM feature_outbox.drift('plots') WHERE feature_id = '2';
SELECT written();

-- A layer whose state predates 0.3.0 (no digests, no last event): unknown, until resync takes them.
UPDATE feature_outbox.feature_state SET geometry_digest = NULL, properties_digest = NULL, version = NULL, last_event = NULL
 WHERE layer = 'plots' AND feature_id IN (6, 7);
SELECT * FROM feature_outbox.drift('plots') WHERE feature_id IN ('6', '7') ORDER BY 1;

-- Refusals: an unknown layer, NULL.
SELECT try($$SELECT * FROM feature_outbox.drift('nosuch')$$);
SELECT try($$SELECT * FROM feature_outbox.drift(NULL)$$);
-- The built-in layer has drift too, where a superuser wrote its table directly.
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[1,1]}', 'created');
UPDATE feature_outbox.features SET geom = 'SRID=4326;POINT(2 2)' WHERE id = 1;
SELECT * FROM feature_outbox.drift('features');

-- An empty layer has no drift; a table emptied behind the product is all gone.
CREATE TABLE public.empty (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('empty', 'public.empty');
SELECT count(*) AS drifted FROM feature_outbox.drift('empty');
SELECT feature_outbox.edit_feature('empty', 1, '{"type":"Point","coordinates":[1,1]}', 'created');
TRUNCATE public.empty;
SELECT * FROM feature_outbox.drift('empty');
