-- register_layer refuses every table or column an edit could never write, with the SQLSTATE the
-- Layers page gives and a hint (all but the missing table, which the regclass cast refuses first),
-- and a refused registration registers nothing: the user relies on a layer either being whole or
-- not existing at all.
CREATE TABLE public.reg_ok (id integer PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL,
    label text, retired timestamptz, untyped geometry, nosrid geometry(Point), zgeom geometry(PointZ, 4326),
    bad_version bigint NOT NULL DEFAULT 0, loose_version integer, loose_id integer,
    done_at timestamptz NOT NULL DEFAULT now(), multi_nosrid geometry(MultiPolygon));
CREATE VIEW public.reg_view AS SELECT * FROM public.reg_ok;
INSERT INTO spatial_ref_sys (srid, auth_name, auth_srid, proj4text) VALUES (990001, 'test', 990001, '+proj=longlat +datum=WGS84');
CREATE TABLE public.reg_unknown_srid (id integer PRIMARY KEY, geom geometry(Point, 990001), version integer NOT NULL);
DELETE FROM spatial_ref_sys WHERE srid = 990001;
-- Keys and columns edits could not write: a deferrable unique id, GENERATED ALWAYS ids and properties.
CREATE TABLE public.odd (id int UNIQUE DEFERRABLE NOT NULL, gid int GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    geom geometry(Point, 4326), version int NOT NULL DEFAULT 0, twice int GENERATED ALWAYS AS (version * 2) STORED,
    uuid_key uuid UNIQUE NOT NULL, num_key numeric UNIQUE NOT NULL);
CREATE TEMP TABLE scratch_layer (id int PRIMARY KEY, geom geometry(Point, 4326), version int NOT NULL DEFAULT 0);
CREATE TABLE public.notes (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('notes', 'public.notes');
SELECT layer FROM feature_outbox.layers ORDER BY layer;

-- Layer names: a NATS subject token, unique.
SELECT try($$SELECT feature_outbox.register_layer('Bad.Name', 'public.reg_ok')$$);
SELECT try($$SELECT feature_outbox.register_layer(repeat('x', 65), 'public.reg_ok')$$);
SELECT try($$SELECT feature_outbox.register_layer('', 'public.reg_ok')$$);
SELECT try($$SELECT feature_outbox.register_layer(NULL, 'public.reg_ok')$$);
SELECT try($$SELECT feature_outbox.register_layer('notes', 'public.reg_ok')$$);
SELECT try($$SELECT feature_outbox.register_layer('features', 'public.reg_ok')$$);
-- Names that would break a subject: upper case, a space, a dot, wildcards, a line break, 1 MB.
SELECT to_json(v) AS name, left(try(format('SELECT feature_outbox.register_layer(%L, %L)', v, 'public.reg_ok')), 5) AS register,
       left(try(format('SELECT feature_outbox.edit_feature(%L, 1, %L, %L)', v, '{"type":"Point","coordinates":[1,2]}', 'created')), 5) AS edit
  FROM unnest(ARRAY['Notes', 'no tes', 'no.tes', '*', '>', E'n\r\nPUB', repeat('x', 65)]) v;
SELECT left(try(format('SELECT feature_outbox.register_layer(%L, %L)', repeat('l', 1000000), 'public.reg_ok')), 40) AS one_megabyte_name;

-- The table: missing, NULL, a view, a temporary table.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.no_such_table')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', NULL)$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_view')$$);
SELECT try($$SELECT feature_outbox.register_layer('scratch', 'pg_temp.scratch_layer')$$);

-- The id column.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', id_column => 'nope')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', id_column => 'label')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', id_column => 'loose_id')$$);
SELECT try($$SELECT feature_outbox.register_layer('odd', 'public.odd')$$);
SELECT try($$SELECT feature_outbox.register_layer('odd', 'public.odd', id_column => 'gid')$$);
SELECT try($$SELECT feature_outbox.register_layer('odd', 'public.odd', id_column => 'num_key')$$);

-- The geometry column: missing, not a geometry, no type modifier, no SRID, an unknown SRID, Z.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'nope')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'label')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'untyped')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'nosrid')$$);
-- The hint names the column's own type.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'multi_nosrid')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_unknown_srid')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', geometry_column => 'zgeom')$$);

-- The version column: integer NOT NULL, not generated.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', version_column => 'nope')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', version_column => 'bad_version')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', version_column => 'loose_version')$$);
-- (An identity column: its message reads "must be integer NOT NULL; it is integer NOT NULL", so
-- only the SQLSTATE here.)
SELECT left(try($$SELECT feature_outbox.register_layer('odd', 'public.odd', id_column => 'uuid_key', version_column => 'gid')$$), 5) AS try;

-- Properties: existing, listed once, not one of the four, not generated.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', properties => '{label,nope}')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', properties => '{label,label}')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', properties => '{geom}')$$);
SELECT try($$SELECT feature_outbox.register_layer('odd', 'public.odd', id_column => 'uuid_key', properties => '{twice}')$$);

-- The retired column: a nullable timestamptz; and four different columns.
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', retired_column => 'label')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', retired_column => 'done_at')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', retired_column => 'nope')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', version_column => 'id')$$);
SELECT try($$SELECT feature_outbox.register_layer('r1', 'public.reg_ok', retired_column => 'geom')$$);

-- None of it registered anything.
SELECT layer FROM feature_outbox.layers ORDER BY layer;
SELECT count(*) AS registry_rows FROM feature_outbox.layer_registry;

-- Done right, the same table registers, with what it was given.
SELECT feature_outbox.register_layer('r1', 'public.reg_ok', properties => '{label}', retired_column => 'retired');
SELECT layer, table_name, id_column, geometry_column, version_column, retired_column, properties, srid, geometry_type, id_type
  FROM feature_outbox.layers WHERE layer = 'r1';
-- A partitioned table is a table too; a uuid key is a key.
CREATE TABLE public.zones (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0)
    PARTITION BY RANGE (id);
SELECT feature_outbox.register_layer('zones', 'public.zones');
SELECT feature_outbox.register_layer('odd', 'public.odd', id_column => 'uuid_key');
SELECT layer, table_name, id_type FROM feature_outbox.layers ORDER BY layer;
