-- CALL backfill(layer, area) writes one snapshot event per live feature of the layer whose routing
-- point lies in area (any SRID), routed on the row's geometry, carrying its current version, and
-- changes no row. It is the operator's: EXECUTE is not PUBLIC's (42501), and a role granted it
-- reads and locks the table with its own rights (42501 naming the table without them). An unknown layer is
-- 42704, an area without an SRID 22023; each refusal writes nothing.
CREATE TABLE public.sites (id bigint PRIMARY KEY, geom geometry(Point, 3857) NOT NULL, version integer NOT NULL DEFAULT 0,
                           name text, retired_at timestamptz);
SELECT feature_outbox.register_layer('sites', 'public.sites', properties => '{name}', retired_column => 'retired_at');
-- Three in Colorado (one retired), two in Kansas; one more written behind the product.
SELECT feature_outbox.edit_feature('sites', id, ST_SetSRID(ST_MakePoint(lon, lat), 4326), 'created')
  FROM (VALUES (1, -105.0, 39.7), (2, -104.8, 38.8), (3, -106.8, 39.2), (4, -97.3, 37.7), (5, -95.7, 39.0)) v(id, lon, lat);
SELECT feature_outbox.edit_feature('sites', 2, ST_SetSRID(ST_MakePoint(-104.9, 38.9), 4326), 'moved');
SELECT feature_outbox.edit_feature('sites', 3, NULL::text, 'retired');
INSERT INTO public.sites (id, geom, version, name) VALUES (6, ST_Transform(ST_SetSRID(ST_MakePoint(-105.2, 40.0), 4326), 3857), 0, 'by hand');
CREATE TABLE before AS SELECT * FROM public.sites;
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s snapshots=%s', written(), (SELECT count(*) FROM feature_outbox.outbox WHERE event_type = 'snapshot'))
$$;
SELECT counts();

-- Colorado's box, given in CONUS Albers metres: the live features inside, each at its version.
CALL feature_outbox.backfill('sites', ST_Transform(ST_MakeEnvelope(-109.05, 36.99, -102.04, 41.0, 4326), 5070));
-- Snapshots are the application's (origin): the operator's call, like an edit.
SELECT o.feature_id, o.feature_version, s.version AS row_version, o.origin, o.previous_routing_key IS NULL AS no_previous_key,
       o.routing_key = feature_outbox.routing_key(ST_Transform(s.geom, 4326)) AS routed_on_the_row
  FROM feature_outbox.outbox o JOIN public.sites s ON s.id = o.feature_id
 WHERE o.event_type = 'snapshot' ORDER BY o.feature_id;
-- The whole layer: one per live feature. No row changed.
CALL feature_outbox.backfill('sites');
SELECT feature_id, count(*) AS snapshots FROM feature_outbox.outbox WHERE event_type = 'snapshot' GROUP BY 1 ORDER BY 1;
SELECT count(*) AS rows_changed FROM (SELECT * FROM public.sites EXCEPT SELECT * FROM before) c;
-- An area with nothing inside writes nothing; nor does an empty one.
CALL feature_outbox.backfill('sites', ST_MakeEnvelope(0, 0, 1, 1, 4326));
CALL feature_outbox.backfill('sites', 'SRID=4326;POLYGON EMPTY'::geometry);
-- The built-in layer too.
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
CALL feature_outbox.backfill('features');
SELECT counts();

-- Refusals.
SELECT try($$CALL feature_outbox.backfill('nope')$$);
SELECT try($$CALL feature_outbox.backfill(NULL)$$);
SELECT try($$CALL feature_outbox.backfill('sites', ST_MakeEnvelope(0, 0, 1, 1))$$);
SELECT counts();

-- Rights: not PUBLIC's, nor its internal chunk; granted, the role needs its own rights on the table.
CREATE ROLE regress_backfill_reader;
GRANT USAGE ON SCHEMA feature_outbox TO regress_backfill_reader;
SET ROLE regress_backfill_reader;
SELECT try($$CALL feature_outbox.backfill('sites')$$);
SELECT try($$SELECT feature_outbox._backfill_chunk('sites', NULL, NULL::text, 10)$$);
RESET ROLE;
GRANT EXECUTE ON PROCEDURE feature_outbox.backfill TO regress_backfill_reader;
SET ROLE regress_backfill_reader;
SELECT try($$CALL feature_outbox.backfill('sites', ST_MakeEnvelope(-109.05, 36.99, -102.04, 41.0, 4326))$$);
RESET ROLE;
SELECT counts();
-- It reads and locks the rows FOR SHARE: SELECT and UPDATE.
GRANT SELECT ON public.sites TO regress_backfill_reader;
SET ROLE regress_backfill_reader;
SELECT try($$CALL feature_outbox.backfill('sites', ST_MakeEnvelope(-109.05, 36.99, -102.04, 41.0, 4326))$$);
RESET ROLE;
GRANT UPDATE ON public.sites TO regress_backfill_reader;
SET ROLE regress_backfill_reader;
CALL feature_outbox.backfill('sites', ST_MakeEnvelope(-109.05, 36.99, -102.04, 41.0, 4326));
RESET ROLE;
SELECT counts();
DROP OWNED BY regress_backfill_reader;
DROP ROLE regress_backfill_reader;
