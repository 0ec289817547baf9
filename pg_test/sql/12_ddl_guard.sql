-- The DDL guard (0.3.0): DDL that would break a registered layer (dropping its table, directly or
-- through DROP SCHEMA ... CASCADE or DROP OWNED; dropping, retyping or renaming a registered
-- column) is refused with 2BP01, a message naming the layer and a hint saying what to do, and
-- changes nothing. Other DDL goes through. Only a superuser can turn the guard off, for one
-- session; past it, an edit of a layer whose table is gone is a clear 42P01 naming the layer.
CREATE SCHEMA guarded;
CREATE TABLE guarded.roads (id bigint PRIMARY KEY, geom geometry(LineString, 4326) NOT NULL,
    version int NOT NULL DEFAULT 0, name text, lanes int, retired_at timestamptz, note text);
SELECT feature_outbox.register_layer('roads', 'guarded.roads', properties => '{name,lanes}', retired_column => 'retired_at');
SELECT feature_outbox.edit_feature('roads', 1, '{"type":"LineString","coordinates":[[1,1],[2,2]]}', 'created');
CREATE FUNCTION roads_shape() RETURNS text LANGUAGE sql AS $$
    SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod), ', ' ORDER BY attnum)
      FROM pg_attribute WHERE attrelid = 'guarded.roads'::regclass AND attnum > 0 AND NOT attisdropped
$$;
SELECT roads_shape();

SET client_min_messages = warning;  -- no "drop cascades to" notices
SELECT try($$DROP TABLE guarded.roads$$);
SELECT try($$DROP SCHEMA guarded CASCADE$$);
SELECT try($$ALTER TABLE guarded.roads DROP COLUMN name$$);
SELECT try($$ALTER TABLE guarded.roads DROP COLUMN geom$$);
SELECT try($$ALTER TABLE guarded.roads DROP COLUMN retired_at$$);
SELECT try($$ALTER TABLE guarded.roads RENAME COLUMN lanes TO lane_count$$);
SELECT try($$ALTER TABLE guarded.roads RENAME COLUMN version TO v$$);
SELECT try($$ALTER TABLE guarded.roads ALTER COLUMN lanes TYPE bigint$$);
SELECT try($$ALTER TABLE guarded.roads ALTER COLUMN geom TYPE geometry(LineString, 3857) USING ST_Transform(geom, 3857)$$);
SELECT try($$ALTER TABLE guarded.roads ALTER COLUMN id TYPE numeric$$);
-- Nothing changed: the columns are as registered, and the layer still edits.
SELECT roads_shape();
SELECT feature_outbox.edit_feature('roads', 1, NULL::text, 'updated', '{"lanes": 4}');

-- DDL on anything else, and harmless DDL on the table itself, goes through.
ALTER TABLE guarded.roads DROP COLUMN note;
ALTER TABLE guarded.roads ADD COLUMN surface text;
ALTER TABLE guarded.roads RENAME COLUMN surface TO paving;
ALTER TABLE guarded.roads ALTER COLUMN name SET DEFAULT 'x';
CREATE INDEX ON guarded.roads USING gist (geom);
ALTER TABLE guarded.roads RENAME TO streets;
CREATE TABLE guarded.other (id int, geom geometry);
ALTER TABLE guarded.other DROP COLUMN geom;
DROP TABLE guarded.other;
SELECT layer, table_name FROM feature_outbox.layers WHERE layer = 'roads';
SELECT feature_outbox.edit_feature('roads', 1, NULL::text, 'updated', '{"lanes": 5}');

-- The owner of the table cannot turn the guard off, nor drop the table; DROP OWNED is refused too.
CREATE ROLE regress_guard_owner;
ALTER TABLE guarded.streets OWNER TO regress_guard_owner;
GRANT USAGE, CREATE ON SCHEMA guarded TO regress_guard_owner;
SET ROLE regress_guard_owner;
SELECT try($$SET feature_outbox.ddl_guard = off$$);
SELECT try($$DROP TABLE guarded.streets$$);
SELECT try($$ALTER TABLE guarded.streets DROP COLUMN lanes$$);
RESET ROLE;
SELECT try($$DROP OWNED BY regress_guard_owner$$);
SELECT count(*) AS table_still_there FROM guarded.streets;

-- A superuser can, for one session: the documented way for pg_restore --clean and repairs.
SET feature_outbox.ddl_guard = off;
ALTER TABLE guarded.streets RENAME COLUMN lanes TO lanes2;
ALTER TABLE guarded.streets RENAME COLUMN lanes2 TO lanes;
RESET feature_outbox.ddl_guard;
SELECT try($$DROP TABLE guarded.streets$$);

-- Past the guard, the table is gone: an edit names the layer (42P01) and writes nothing.
SET feature_outbox.ddl_guard = off;
CREATE TABLE public.europe (id int PRIMARY KEY, geom geometry(Point, 3035) NOT NULL, version int NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('europe', 'public.europe');
DROP TABLE public.europe;
RESET feature_outbox.ddl_guard;
SELECT written();
SELECT regexp_replace(try($$SELECT feature_outbox.edit_feature('europe', 2, '{"type":"Point","coordinates":[10,50]}', 'created')$$),
                      'OID \d+', 'OID <oid>') AS try;
SELECT written();
SELECT feature_outbox.unregister_layer('europe');

-- Unregistered (its rows published, as the relay would mark them), the table is the user's again.
UPDATE feature_outbox.outbox SET published_at = now() WHERE layer = 'roads';
SELECT feature_outbox.unregister_layer('roads');
ALTER TABLE guarded.streets DROP COLUMN lanes;
DROP SCHEMA guarded CASCADE;
DROP ROLE regress_guard_owner;
