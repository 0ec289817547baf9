-- edit_feature(id, geometry | GeoJSON, 'moved') runs the built-in move in Rust as the extension's owner,
-- without a pinned search_path (src/edit/moved.rs): every table, function and operator in its
-- statements is qualified and PostGIS is called by OID. So a caller's own schema put ahead of
-- pg_catalog, and temporary tables named as the extension's, take no part in it, also when its
-- plans are made under that path (the first move of this session). Each hostile object raises
-- when it runs, which would fail the edit.
CREATE ROLE regress_hostile LOGIN;
GRANT USAGE ON SCHEMA feature_outbox TO regress_hostile;
GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(bigint, geometry, text),
                          feature_outbox.edit_feature(bigint, text, text),
                          feature_outbox.edit_feature(text, uuid, text, text, jsonb) TO regress_hostile;
-- A layer keyed by uuid, whose entry points cast the key to text: the hostile role may edit it.
CREATE TABLE public.sites (id uuid PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('sites', 'public.sites');
GRANT SELECT, INSERT, UPDATE ON public.sites TO regress_hostile;
DO $$ BEGIN EXECUTE format('GRANT CREATE, TEMPORARY ON DATABASE %I TO regress_hostile', current_database()); END $$;
SELECT feature_outbox.edit_feature(3301, 'SRID=4326;POINT(10 50)'::geometry, 'created');
SELECT feature_outbox.edit_feature(3302, 'SRID=4326;POLYGON((10 50, 11 50, 11 51, 10 51, 10 50))'::geometry, 'created');

SET ROLE regress_hostile;
CREATE SCHEMA hostile;
CREATE FUNCTION hostile.ran(what text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'hostile % ran as %', what, current_user;
END $$;
CREATE FUNCTION hostile.eq8(bigint, bigint) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('bigint ='); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR hostile.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = hostile.eq8);
CREATE FUNCTION hostile.eqt(text, text) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('text ='); RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
CREATE OPERATOR hostile.= (LEFTARG = text, RIGHTARG = text, FUNCTION = hostile.eqt);
CREATE FUNCTION hostile.add4(integer, integer) RETURNS integer LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('integer +'); RETURN $1 OPERATOR(pg_catalog.+) $2; END $$;
CREATE OPERATOR hostile.+ (LEFTARG = integer, RIGHTARG = integer, FUNCTION = hostile.add4);
CREATE FUNCTION hostile.now() RETURNS timestamptz LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('now()'); RETURN pg_catalog.now(); END $$;
CREATE FUNCTION hostile.currval(regclass) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('currval()'); RETURN 0; END $$;
CREATE FUNCTION hostile.st_pointonsurface(public.geometry) RETURNS public.geometry LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('ST_PointOnSurface'); RETURN $1; END $$;
CREATE FUNCTION hostile.st_isvaliddetail(public.geometry, integer DEFAULT 0) RETURNS public.valid_detail LANGUAGE plpgsql AS $$ BEGIN PERFORM hostile.ran('ST_IsValidDetail'); RETURN NULL; END $$;
-- A type named text, in a schema of its own: a domain whose CHECK would run the role's code as
-- whoever casts to it.
CREATE SCHEMA hostile_types;
CREATE DOMAIN hostile_types.text AS pg_catalog.text CHECK (hostile.ran('the domain text') IS NULL);
CREATE TEMP TABLE features (id bigint, geom text, version integer, updated_at timestamptz, retired_at timestamptz);
CREATE TEMP TABLE feature_state (layer text, feature_id bigint);
CREATE TEMP TABLE outbox (id bigint);
SET search_path = hostile, pg_catalog, public, feature_outbox;
-- The operators and functions above are what an unqualified name would find here.
SELECT try($$SELECT 1::bigint = 1::bigint$$);
SELECT try($$SELECT now()$$);
SELECT feature_outbox.edit_feature(3301, 'SRID=4326;POINT(10.5 50.5)'::geometry, 'moved') AS point_version;
SELECT feature_outbox.edit_feature(3302, 'SRID=4326;POLYGON((12 50, 13 50, 13 51, 12 51, 12 50))'::geometry, 'moved') AS polygon_version;
SELECT feature_outbox.edit_feature(3301, 'SRID=4326;POINT(10.6 50.6)'::geometry, 'moved') AS point_version;
SELECT feature_outbox.edit_feature(3302, '{"type":"Polygon","coordinates":[[[14,50],[15,50],[15,51],[14,50]]]}', 'moved') AS polygon_version;
-- A move the Rust path hands to _edit (a missing feature), under the same path.
SELECT try($$SELECT feature_outbox.edit_feature(3399, 'SRID=4326;POINT(10 50)'::geometry, 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(3399, '{"type":"Point","coordinates":[10,50]}', 'moved')$$);
-- The uuid layer's entry point, with that schema ahead of pg_catalog: its key is cast to
-- pg_catalog's text.
SET search_path = hostile_types, hostile, pg_catalog, public, feature_outbox;
SELECT feature_outbox.edit_feature('sites', '6f1c1e5e-4d1b-4b8e-9d53-3c2a1b0e9f10'::uuid,
                                   '{"type":"Point","coordinates":[10,50]}', 'created') AS site_version;
SET search_path = hostile, pg_catalog, public, feature_outbox;
SELECT count(*) AS temp_rows FROM (SELECT 1 FROM pg_temp.features UNION ALL SELECT 1 FROM pg_temp.feature_state
                                   UNION ALL SELECT 1 FROM pg_temp.outbox) t;
RESET search_path;
RESET ROLE;

-- The events and rows are the extension's, as the same moves write them under a plain search_path.
SELECT o.feature_id, o.feature_version, o.event_type, o.layer,
       o.routing_key = feature_outbox.routing_key(f.geom) AS key_of_the_row,
       o.previous_routing_key = s.previous_routing_key AS previous_key_of_state,
       o.geometry_digest = md5(ST_AsEWKB(f.geom))::uuid AS digest_of_the_row
  FROM feature_outbox.outbox o
  JOIN feature_outbox.features f ON f.id = o.feature_id
  JOIN feature_outbox.feature_state s ON s.layer = 'features' AND s.feature_id = o.feature_id
 WHERE o.event_type = 'moved' AND o.feature_version = f.version
 ORDER BY o.feature_id;
SELECT id, version, ST_AsText(geom) FROM feature_outbox.features ORDER BY id;
SELECT feature_id, event_type, feature_version, layer, feature_key FROM feature_outbox.outbox ORDER BY id;
SELECT id, version, ST_AsText(geom) FROM public.sites;

DROP OWNED BY regress_hostile;
DROP ROLE regress_hostile;
