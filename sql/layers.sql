-- Layers: the user's own PostGIS tables, served by the same outbox. register_layer records which
-- columns hold the id, geometry, version and retired time, and which columns each event carries
-- as properties. register_layer and unregister_layer are C entry points (src/edit/entry.rs) that
-- record the calling role (_caller_role(): current_user where they were called) and run the bodies
-- below as the extension's owner, who alone writes layer_registry.

-- Edits of a layer hold this advisory lock shared until they commit; unregister_layer takes it
-- exclusively: (1179601241, hashtext(layer)). The first key spells FOLY.

CREATE OR REPLACE FUNCTION _column_type(tbl regclass, col name, what text) RETURNS pg_attribute
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    a pg_attribute;
BEGIN
    SELECT * INTO a FROM pg_attribute WHERE attrelid = tbl AND attname = col AND attnum > 0 AND NOT attisdropped;
    IF NOT FOUND THEN
        RAISE EXCEPTION '% column % does not exist in %', what, quote_ident(col), tbl USING ERRCODE = '42703',
            HINT = format('Columns of %s: %s.', tbl, (SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum)
                          FROM pg_attribute WHERE attrelid = tbl AND attnum > 0 AND NOT attisdropped));
    END IF;
    RETURN a;
END
$$;

-- A layer's registered columns, each with its role: id, geometry, version, retired (when set), then
-- the properties in their order. The DDL guard and column_types follow this order.
CREATE OR REPLACE FUNCTION _layer_columns(r layer_registry) RETURNS TABLE (col name, role text, ord bigint)
LANGUAGE sql STABLE
AS $$
    SELECT r.id_column, 'id', 1::bigint
    UNION ALL SELECT r.geometry_column, 'geometry', 2
    UNION ALL SELECT r.version_column, 'version', 3
    UNION ALL SELECT r.retired_column, 'retired', 4 WHERE r.retired_column IS NOT NULL
    UNION ALL SELECT p.p, 'property', 4 + p.i FROM unnest(r.properties) WITH ORDINALITY p(p, i)
$$;

-- format_type of each of `r`'s registered columns as the catalog has it now; 'missing' for one that
-- is gone (dropped or renamed).
CREATE OR REPLACE FUNCTION _layer_column_types(r layer_registry) RETURNS text[]
LANGUAGE sql STABLE
AS $$
    SELECT array_agg(coalesce((SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
                                 WHERE a.attrelid = r.tbl AND a.attname = c.col AND a.attnum > 0 AND NOT a.attisdropped),
                              'missing') ORDER BY c.ord)
      FROM _layer_columns(r) c
$$;

CREATE OR REPLACE FUNCTION register_layer(layer text, tbl regclass, id_column name DEFAULT 'id',
                               geometry_column name DEFAULT 'geom', version_column name DEFAULT 'version',
                               properties name[] DEFAULT '{}', retired_column name DEFAULT NULL) RETURNS void
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_register_layer';

CREATE OR REPLACE FUNCTION _register_layer(layer text, tbl regclass, id_column name, geometry_column name, version_column name,
                                properties name[], retired_column name) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    rel pg_class;
    a pg_attribute;
    v_srid integer;
    v_type text;
    v_id_type regtype;
    p name;
    reg layer_registry;
BEGIN
    IF layer IS NULL OR layer !~ '^[a-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'invalid layer name %', coalesce(quote_literal(layer), 'NULL') USING ERRCODE = '22023',
            HINT = 'A layer name is a NATS subject token: 1 to 64 of a-z, 0-9, _ and -.';
    END IF;
    IF EXISTS (SELECT 1 FROM layer_registry r WHERE r.layer = _register_layer.layer) THEN
        RAISE EXCEPTION 'layer % is already registered', layer USING ERRCODE = '42710',
            HINT = format('See feature_outbox.layers; unregister_layer(%L) first to register it again.', layer);
    END IF;
    IF tbl IS NULL THEN
        RAISE EXCEPTION 'tbl must not be NULL' USING ERRCODE = '22004', HINT = 'Name the table, e.g. ''public.parcels''.';
    END IF;
    SELECT * INTO rel FROM pg_class c WHERE c.oid = tbl;
    IF rel.relkind NOT IN ('r', 'p') THEN
        RAISE EXCEPTION '% is not a table', tbl USING ERRCODE = '42809',
            HINT = 'A layer is an ordinary or partitioned table; views and foreign tables cannot be written with their events.';
    END IF;
    IF rel.relpersistence = 't' THEN
        RAISE EXCEPTION '% is a temporary table', tbl USING ERRCODE = '42809',
            HINT = 'A layer outlives the session: register a permanent table.';
    END IF;
    IF cardinality(array_remove(ARRAY[id_column, geometry_column, version_column, retired_column]::name[], NULL))
       <> (SELECT count(DISTINCT c) FROM unnest(ARRAY[id_column, geometry_column, version_column, retired_column]::name[]) c) THEN
        RAISE EXCEPTION 'id, geometry, version and retired columns must be four different columns' USING ERRCODE = '22023',
            HINT = 'Each has its own job: the id names the feature, the version counts its edits.';
    END IF;
    IF NOT pg_has_role(caller, rel.relowner, 'USAGE')
       AND NOT (SELECT rolsuper FROM pg_roles WHERE oid = caller) THEN
        RAISE EXCEPTION 'must be owner of table % to register it as a layer', tbl USING ERRCODE = '42501',
            HINT = format('Its owner is %s: register it as that role, or as a superuser.', rel.relowner::regrole);
    END IF;

    a := _column_type(tbl, id_column, 'id');
    IF a.atttypid NOT IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype, 'uuid'::regtype, 'text'::regtype,
                          'varchar'::regtype) THEN
        RAISE EXCEPTION 'id column % is of type %', quote_ident(id_column), format_type(a.atttypid, a.atttypmod)
            USING ERRCODE = '22023', HINT = 'The id column must be smallint, integer, bigint, uuid, text or varchar.';
    END IF;
    v_id_type := a.atttypid;
    IF a.attidentity = 'a' OR a.attgenerated <> '' THEN
        RAISE EXCEPTION 'id column % is GENERATED ALWAYS', quote_ident(id_column) USING ERRCODE = '22023',
            HINT = 'edit_feature writes the id the caller gives; use GENERATED BY DEFAULT AS IDENTITY, or none.';
    END IF;
    -- ON CONFLICT needs a valid, immediate unique index on the id alone.
    IF NOT a.attnotnull OR NOT EXISTS (
           SELECT 1 FROM pg_index i
            WHERE i.indrelid = tbl AND i.indisunique AND i.indnkeyatts = 1 AND i.indkey[0] = a.attnum
              AND i.indpred IS NULL AND i.indexprs IS NULL AND i.indisvalid AND i.indimmediate) THEN
        RAISE EXCEPTION 'id column % is not the primary key or a unique NOT NULL column', quote_ident(id_column)
            USING ERRCODE = '22023', HINT = format('ALTER TABLE %s ADD PRIMARY KEY (%I), or add a unique constraint (not deferrable) and NOT NULL.', tbl, id_column);
    END IF;

    a := _column_type(tbl, geometry_column, 'geometry');
    IF format_type(a.atttypid, NULL) <> 'geometry' THEN
        RAISE EXCEPTION 'geometry column % is of type %', quote_ident(geometry_column), format_type(a.atttypid, a.atttypmod)
            USING ERRCODE = '22023', HINT = 'The geometry column must be a PostGIS geometry, e.g. geometry(Polygon, 2263).';
    END IF;
    v_srid := CASE WHEN a.atttypmod > 0 THEN postgis_typmod_srid(a.atttypmod) ELSE 0 END;
    IF v_srid <= 0 THEN
        RAISE EXCEPTION 'geometry column % has no declared SRID', quote_ident(geometry_column) USING ERRCODE = '22023',
            HINT = format('Declare it: ALTER TABLE %s ALTER COLUMN %I TYPE geometry(%s, <srid>) USING ST_SetSRID(%I, <srid>).',
                          tbl, geometry_column, postgis_typmod_type(a.atttypmod), geometry_column);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM spatial_ref_sys s WHERE s.srid = v_srid) THEN
        RAISE EXCEPTION 'geometry column % has SRID %, which spatial_ref_sys does not know', quote_ident(geometry_column), v_srid
            USING ERRCODE = '22023', HINT = 'Insert its definition into spatial_ref_sys, or use an EPSG code PostGIS ships.';
    END IF;
    IF postgis_typmod_dims(a.atttypmod) <> 2 THEN
        RAISE EXCEPTION 'geometry column % has % dimensions', quote_ident(geometry_column), postgis_typmod_dims(a.atttypmod)
            USING ERRCODE = '22023', HINT = 'feature_outbox writes 2D geometries (GeoJSON positions of x and y); use a column without Z or M.';
    END IF;
    v_type := postgis_typmod_type(a.atttypmod);
    IF a.attgenerated <> '' THEN
        RAISE EXCEPTION 'geometry column % is a generated column', quote_ident(geometry_column) USING ERRCODE = '22023',
            HINT = 'edit_feature writes the geometry: register the column it is generated from, or a plain one.';
    END IF;

    a := _column_type(tbl, version_column, 'version');
    IF a.atttypid <> 'int4'::regtype OR NOT a.attnotnull OR a.attgenerated <> '' OR a.attidentity = 'a' THEN
        RAISE EXCEPTION 'version column % must be integer NOT NULL; it is % %', quote_ident(version_column),
            format_type(a.atttypid, a.atttypmod), CASE WHEN a.attnotnull THEN 'NOT NULL' ELSE 'nullable' END
            USING ERRCODE = '22023', HINT = CASE WHEN a.atttypid = 'int4'::regtype AND NOT a.attnotnull
                THEN format('UPDATE %1$s SET %2$I = 0 WHERE %2$I IS NULL; ALTER TABLE %1$s ALTER COLUMN %2$I SET DEFAULT 0, ALTER COLUMN %2$I SET NOT NULL.', tbl, version_column)
                ELSE format('Register an integer NOT NULL column as the version (ALTER TABLE %s ADD COLUMN version integer NOT NULL DEFAULT 0), or make %I one.', tbl, version_column) END;
    END IF;

    IF retired_column IS NOT NULL THEN
        a := _column_type(tbl, retired_column, 'retired');
        IF a.atttypid <> 'timestamptz'::regtype OR a.attnotnull OR a.attgenerated <> '' THEN
            RAISE EXCEPTION 'retired column % must be a nullable timestamptz', quote_ident(retired_column)
                USING ERRCODE = '22023', HINT = 'Give NULL as retired_column to have retired events delete the row instead.';
        END IF;
    END IF;

    IF properties IS NULL THEN
        properties := '{}';
    END IF;
    FOREACH p IN ARRAY properties LOOP
        a := _column_type(tbl, p, 'property');
        IF p IN (id_column, geometry_column, version_column, retired_column) THEN
            RAISE EXCEPTION 'property % is the layer''s id, geometry, version or retired column', quote_ident(p)
                USING ERRCODE = '22023', HINT = 'Each event carries those already; list only attribute columns as properties.';
        END IF;
        IF a.attgenerated <> '' OR a.attidentity = 'a' THEN
            RAISE EXCEPTION 'property % is a generated column', quote_ident(p) USING ERRCODE = '22023',
                HINT = 'edit_feature sets properties; a generated column cannot be set. Events still carry it if you list it nowhere else.';
        END IF;
    END LOOP;
    IF cardinality(properties) <> (SELECT count(DISTINCT x) FROM unnest(properties) x) THEN
        RAISE EXCEPTION 'properties lists a column twice' USING ERRCODE = '22023', HINT = 'List each column once.';
    END IF;

    -- since_id: outbox rows below it belong to an earlier registration of the same name.
    INSERT INTO layer_registry (layer, tbl, id_column, geometry_column, version_column, properties, retired_column,
                                srid, geometry_type, since_id, id_type)
    VALUES (layer, tbl, id_column, geometry_column, version_column, properties, retired_column, v_srid, v_type,
            nextval('outbox_id_seq'), v_id_type)
    RETURNING * INTO reg;
    UPDATE layer_registry l SET column_types = _layer_column_types(reg) WHERE l.layer = reg.layer;
END
$$;
COMMENT ON FUNCTION register_layer(text, regclass, name, name, name, name[], name) IS
    'Registers a table as a layer: edit_feature(layer, ...) and record_edit write its rows'' events. layer: a NATS '
    'subject token [a-z0-9_-]{1,64}; tbl: a table the caller owns; id: smallint/integer/bigint/uuid/text/varchar, unique NOT NULL; '
    'geometry: geometry with a declared SRID; version: integer NOT NULL; properties: columns each event carries; '
    'retired_column: a nullable timestamptz that retired sets (NULL: retired deletes the row).';

CREATE OR REPLACE FUNCTION unregister_layer(layer text) RETURNS void
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_unregister_layer';

CREATE OR REPLACE FUNCTION _unregister_layer(layer text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    r layer_registry;
    pending bigint;
BEGIN
    IF layer = 'features' THEN
        RAISE EXCEPTION 'the built-in layer features cannot be unregistered' USING ERRCODE = '0A000',
            HINT = 'It belongs to the extension; DROP EXTENSION removes it.';
    END IF;
    SELECT * INTO r FROM layer_registry l WHERE l.layer = _unregister_layer.layer FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(l.layer, ', ' ORDER BY l.layer) FROM layer_registry l));
    END IF;
    IF NOT (SELECT rolsuper FROM pg_roles WHERE oid = caller)
       AND NOT coalesce(pg_has_role(caller, (SELECT c.relowner FROM pg_class c WHERE c.oid = r.tbl), 'USAGE'), false) THEN
        RAISE EXCEPTION 'must be owner of table % to unregister layer %', r.tbl, layer USING ERRCODE = '42501',
            HINT = 'Unregister it as the table''s owner, or as a superuser (the only choice once the table is dropped).';
    END IF;
    IF r.captured_at IS NOT NULL THEN
        RAISE EXCEPTION 'layer % is captured', layer USING ERRCODE = '55006',
            HINT = format('CALL feature_outbox.uncapture_layer(%L) first.', layer);
    END IF;
    -- Edits of this layer that have not committed yet finish first; new ones wait until this
    -- commits, then find the layer gone. Edits of other layers do not wait.
    PERFORM pg_advisory_xact_lock(1179601241, hashtext(layer));
    SELECT count(*) INTO pending FROM outbox o
     WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.layer = _unregister_layer.layer;
    IF pending > 0 THEN
        RAISE EXCEPTION 'layer % has % unpublished outbox rows', layer, pending USING ERRCODE = '55006',
            HINT = 'Let the relay publish them (see feature_outbox.backlog_by_layer), then unregister it.';
    END IF;
    DELETE FROM layer_registry l WHERE l.layer = _unregister_layer.layer;
    DELETE FROM feature_state s WHERE s.layer = _unregister_layer.layer;
    DELETE FROM feature_keys k WHERE k.layer = _unregister_layer.layer;
END
$$;
COMMENT ON FUNCTION unregister_layer(text) IS
    'Removes a layer and its per-feature state. Refuses (55006) while the layer has unpublished, unparked outbox rows.';

CREATE OR REPLACE FUNCTION release_layer(layer text, tbl regclass DEFAULT NULL) RETURNS bigint
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_release_layer';

-- A held layer (the relay found its table or a registered column gone) goes back to the relay once
-- its table matches the registration again: the same table with the column renamed or added back,
-- or `tbl`, a table restored or created in its place, whose registered columns have the types
-- recorded at registration. Its rows then publish, with the content that table holds (none for a
-- feature it no longer has, as for a deleted row).
CREATE OR REPLACE FUNCTION _release_layer(layer text, tbl regclass) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    r layer_registry;
    now_types text[];
    waiting bigint;
BEGIN
    SELECT * INTO r FROM layer_registry l WHERE l.layer = _release_layer.layer FOR UPDATE;
    IF NOT FOUND OR r.layer = 'features' THEN
        RAISE EXCEPTION 'layer % is not a registered user layer', coalesce(quote_literal(layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(l.layer, ', ' ORDER BY l.layer) FROM layer_registry l));
    END IF;
    r.tbl := coalesce(tbl, r.tbl);
    IF NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = r.tbl) THEN
        RAISE EXCEPTION 'the table of layer % (OID %) does not exist', layer, r.tbl::oid USING ERRCODE = '42P01',
            HINT = format('Restore or create it, then SELECT feature_outbox.release_layer(%L, ''schema.table'').', layer);
    END IF;
    IF NOT (SELECT rolsuper FROM pg_roles WHERE oid = caller)
       AND NOT pg_has_role(caller, (SELECT c.relowner FROM pg_class c WHERE c.oid = r.tbl), 'USAGE') THEN
        RAISE EXCEPTION 'must be owner of table % to release layer %', r.tbl, layer USING ERRCODE = '42501';
    END IF;
    now_types := _layer_column_types(r);
    IF now_types IS DISTINCT FROM r.column_types THEN
        RAISE EXCEPTION 'table % does not have the registered columns of layer %', r.tbl, layer USING ERRCODE = '42804',
            DETAIL = format('Columns %s have types %s; registered: %s.',
                            (SELECT string_agg(c.col, ', ' ORDER BY c.ord) FROM _layer_columns(r) c), now_types, r.column_types),
            HINT = 'Give the table those columns (rename or add them back), then call release_layer again.';
    END IF;
    UPDATE layer_registry l SET tbl = r.tbl, held_since = NULL, held_reason = NULL WHERE l.layer = r.layer;
    SELECT count(*) INTO waiting FROM outbox o
     WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.layer = r.layer;
    PERFORM _wake_relay_at_commit();
    RETURN waiting;
END
$$;
COMMENT ON FUNCTION release_layer(text, regclass) IS
    'Gives a held layer back to the relay once its table (tbl: one restored in its place) has the registered columns; '
    'returns its waiting rows. For the table''s owner or a superuser; EXECUTE is not granted to PUBLIC.';

-- The registered layer p_layer; 42704 (naming the registered ones) when there is none.
CREATE OR REPLACE FUNCTION _registered_layer(p_layer text) RETURNS layer_registry
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    lay layer_registry;
BEGIN
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = p_layer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(l.layer, ', ' ORDER BY l.layer) FROM layer_registry l));
    END IF;
    RETURN lay;
END
$$;

CREATE OR REPLACE VIEW layers AS
SELECT r.layer, r.tbl AS table_name, r.id_column, r.geometry_column, r.version_column, r.retired_column,
       r.properties, r.srid, r.geometry_type, r.registered_at,
       -- Each event's registration_id: a layer registered again under the same name gets a higher one.
       r.since_id AS registration_id,
       r.id_type,
       -- Since when its table's direct writes are captured (capture_layer); NULL: not captured.
       r.captured_at
  FROM layer_registry r;
COMMENT ON VIEW layers IS 'One row per layer: its table, id, geometry, version and retired columns, properties, SRID, registration id, id type and since when it is captured.';
