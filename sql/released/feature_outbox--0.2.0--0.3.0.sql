-- feature_outbox 0.2.0 -> 0.3.0. Every change to the SQL surface since 0.2.0, so that an upgraded
-- database equals a fresh 0.3.0 one (pg_test/test_upgrade.py). Bodies that changed are repeated here
-- in full, as the install script has them.

-- Columns: digests of every event and of each feature's last, the last drift count -----------

-- Each event records digests of the row as written; the per-feature state keeps the last event's.
-- Events and states written before 0.3.0 have none (drift() says unknown; resync() takes them).
ALTER TABLE outbox ADD COLUMN geometry_digest uuid, ADD COLUMN properties_digest uuid, ADD COLUMN feature_key text;
ALTER TABLE feature_state ADD COLUMN geometry_digest uuid, ADD COLUMN properties_digest uuid,
                          ADD COLUMN version integer, ADD COLUMN last_event text, ADD COLUMN feature_key text;
-- The writer's W3C trace context, recorded by every edit through the columns' defaults (sql/trace.sql).
CREATE  FUNCTION "_traceparent"() RETURNS TEXT /* core::option::Option<alloc::string::String> */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_traceparent_wrapper';
CREATE  FUNCTION "_tracestate"() RETURNS TEXT /* core::option::Option<alloc::string::String> */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_tracestate_wrapper';
ALTER TABLE outbox ADD COLUMN traceparent text DEFAULT _traceparent(), ADD COLUMN tracestate text DEFAULT _tracestate();
-- uuid and text keys (feature_key): their numbers.
CREATE SEQUENCE feature_key_seq;
CREATE TABLE feature_keys (
    layer        text   NOT NULL,
    feature_key  text   NOT NULL,  -- canonical text of a uuid or text key
    feature_id   bigint NOT NULL,  -- its number, from feature_key_seq
    PRIMARY KEY (layer, feature_key),
    UNIQUE (layer, feature_id)
);
COMMENT ON TABLE feature_keys IS 'The number of each uuid or text key of a layer, drawn at its first event.';
SELECT pg_catalog.pg_extension_config_dump('feature_key_seq', '');
SELECT pg_catalog.pg_extension_config_dump('feature_keys', '');
REVOKE ALL ON TABLE feature_keys FROM PUBLIC;

-- Layers: registration_id, column types for the DDL guard ---------------------------------------

ALTER TABLE layer_registry ADD COLUMN column_types text[];
ALTER TABLE layer_registry ADD COLUMN drift_rows bigint, ADD COLUMN drift_checked_at timestamptz,
                           ADD COLUMN held_since timestamptz, ADD COLUMN held_reason text,
                           ADD COLUMN id_type regtype NOT NULL DEFAULT 'bigint';
UPDATE layer_registry r SET id_type = a.atttypid
  FROM pg_attribute a WHERE a.attrelid = r.tbl AND a.attname = r.id_column AND NOT a.attisdropped;
-- A layer's registered columns, each with its role: id, geometry, version, retired (when set), then
-- the properties in their order. The DDL guard and column_types follow this order.
CREATE FUNCTION _layer_columns(r layer_registry) RETURNS TABLE (col name, role text, ord bigint)
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
CREATE FUNCTION _layer_column_types(r layer_registry) RETURNS text[]
LANGUAGE sql STABLE
AS $$
    SELECT array_agg(coalesce((SELECT format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
                                 WHERE a.attrelid = r.tbl AND a.attname = c.col AND a.attnum > 0 AND NOT a.attisdropped),
                              'missing') ORDER BY c.ord)
      FROM _layer_columns(r) c
$$;

-- Layers registered before 0.3.0 are guarded with the column types they have now.
UPDATE layer_registry l SET column_types = _layer_column_types(l) WHERE l.layer <> 'features';

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
            USING ERRCODE = '22023', HINT = format('ALTER TABLE %s ADD COLUMN %I integer NOT NULL DEFAULT 0.', tbl, version_column);
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

CREATE OR REPLACE VIEW layers AS
SELECT r.layer, r.tbl AS table_name, r.id_column, r.geometry_column, r.version_column, r.retired_column,
       r.properties, r.srid, r.geometry_type, r.registered_at,
       -- Each event's registration_id: a layer registered again under the same name gets a higher one.
       r.since_id AS registration_id,
       r.id_type
  FROM layer_registry r;
COMMENT ON VIEW layers IS 'One row per layer: its table, id, geometry, version and retired columns, properties, SRID, registration id and id type.';
COMMENT ON FUNCTION register_layer(text, regclass, name, name, name, name[], name) IS
    'Registers a table as a layer: edit_feature(layer, ...) and record_edit write its rows'' events. layer: a NATS '
    'subject token [a-z0-9_-]{1,64}; tbl: a table the caller owns; id: smallint/integer/bigint/uuid/text/varchar, unique NOT NULL; '
    'geometry: geometry with a declared SRID; version: integer NOT NULL; properties: columns each event carries; '
    'retired_column: a nullable timestamptz that retired sets (NULL: retired deletes the row).';

-- Edits: lossless promotion to the column's Multi type, one area-of-use rule for every write ----

-- The storage CRS's area-of-use test (src/edit/mod.rs).
CREATE  FUNCTION "_check_storage_area"(
	"wkb" bytea, /* & [u8] */
	"crs" TEXT, /* & str */
	"layer" TEXT /* & str */
) RETURNS void
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_check_storage_area_wrapper';

-- ST_MakeValid, or where its default method (linework) gives NULL, as PostGIS 3.5 with GEOS 3.13
-- does for polygons with a ring collapsed to too few points (5 of the shared counties), the
-- structure method. Raises 22023 when neither repairs the shape, never hands on a NULL.
CREATE FUNCTION _made_valid(g geometry) RETURNS geometry
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    v geometry := coalesce(ST_MakeValid(g), ST_MakeValid(g, 'method=structure'));
BEGIN
    IF v IS NULL THEN
        RAISE EXCEPTION 'geometry is not valid, and ST_MakeValid cannot repair it' USING ERRCODE = '22023',
            DETAIL = format('ST_IsValidReason: %s', ST_IsValidReason(g)), HINT = 'Repair the shape before the edit.';
    END IF;
    RETURN v;
END
$$;

-- The routing point of an EPSG:4326 geometry: ST_PointOnSurface of a made-valid copy when invalid,
-- computed on the longitude-shifted shape when an edge crosses the antimeridian, then wrapped back
-- to [-180, 180]. It lies inside the feature's footprint, unlike ST_Centroid (the guide's gotcha 6).
-- _edit takes the same point inline, from the validity and crossing it already knows.
CREATE OR REPLACE FUNCTION _routing_point(g geometry) RETURNS geometry
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    shape geometry := CASE WHEN (ST_IsValidDetail(g)).valid THEN g ELSE _made_valid(g) END;
    p geometry;
BEGIN
    IF (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[1] = 0 THEN
        RETURN ST_PointOnSurface(shape);
    END IF;
    p := ST_PointOnSurface(ST_ShiftLongitude(shape));
    RETURN CASE WHEN ST_X(p) > 180 THEN ST_Translate(p, -360, 0) ELSE p END;
END
$$;

DROP FUNCTION _edit(text, bigint, geometry, text, bytea, jsonb, boolean);
CREATE FUNCTION _edit(p_layer text, p_feature_id bigint, p_geom geometry, p_event_type text, p_wkb bytea,
                      p_properties jsonb, p_record boolean, p_key text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    user_layer boolean := p_layer IS DISTINCT FROM 'features';
    lay record;           -- a user layer's layer_registry row, and has_state: its feature has a state row
    v_res integer;        -- feature_outbox.h3_resolution
    v_srid integer;
    crs text;             -- auth_name:auth_srid of a source SRID other than 4326
    g geometry;           -- the geometry, in EPSG:4326
    facts float8[];       -- _inspect_geometry: {crosses antimeridian, pole, west, south, east, north, resolution}
    shape geometry;       -- what the routing point is taken from
    back geometry;
    tolerance float8;
    p geometry;
    new_key text;
    v_point float8[];      -- the routing point, {longitude, latitude}
    old_retired timestamptz;
    new_version integer;
    reshaped boolean := false;  -- g is not just p_geom transformed (repaired, or rebuilt as a polar cap)
    store geometry;       -- what a user layer's column gets, in its SRID
    store_crs text;       -- auth_name:auth_srid of the column's SRID, when the input is in another
    w text[];             -- _layer_write_row: {new version, row version, geometry digest, properties digest}
    gd uuid;              -- a user layer's row as written: its geometry digest, properties digest
    pd uuid;
    state_gd uuid;        -- the geometry digest the feature's last event recorded
    fresh boolean;        -- the event starts the feature's state (created, or record_edit without state)
    v_digest uuid;        -- the built-in layer's: digest of the geometry written
    v_key text;           -- a user layer's key as text: p_key (uuid, text), or p_feature_id
    v_cast text;          -- the type a statement casts v_key to
    bad text;
    keys text[];          -- the keys of p_properties
    r text[];             -- a row read from the layer's table, as the caller
    n bigint;
BEGIN
    IF p_geom IS NULL AND p_wkb IS NOT NULL THEN  -- the GeoJSON form
        p_geom := ST_GeomFromEWKB(p_wkb);
    END IF;
    IF p_event_type IS NULL OR p_event_type NOT IN ('created', 'moved', 'retired', 'updated') THEN
        RAISE EXCEPTION 'unknown event_type %', coalesce(quote_literal(p_event_type), 'NULL')
            USING ERRCODE = '22023', HINT = 'event_type must be one of: created, moved, updated, retired.';
    END IF;
    IF p_feature_id IS NULL THEN
        RAISE EXCEPTION 'feature_id must not be NULL' USING ERRCODE = '22004';
    END IF;
    IF user_layer THEN
        -- Shared with every edit of this layer; unregister_layer takes it exclusively, so a layer
        -- cannot go while an edit of it has yet to commit, and the lookup below sees it gone.
        -- (IF, not PERFORM, here and for _wake_relay_for: plpgsql evaluates an IF condition as a
        -- simple expression, while PERFORM starts the executor, ~6,000 instructions an edit.)
        IF pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer)) IS NULL THEN END IF;
        SELECT r.tbl, r.id_column, r.geometry_column, r.version_column, r.properties, r.retired_column, r.srid,
               r.geometry_type, r.id_type,
               EXISTS (SELECT 1 FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = p_feature_id) AS has_state
          INTO lay FROM layer_registry r WHERE r.layer = p_layer;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
                HINT = format('Registered layers: %s. Add one with register_layer().',
                              (SELECT string_agg(r.layer, ', ' ORDER BY r.layer) FROM layer_registry r));
        END IF;
        v_key := coalesce(p_key, p_feature_id::text);
        v_cast := CASE WHEN p_key IS NULL THEN 'bigint' ELSE lay.id_type::text END;
    END IF;
    IF p_properties IS NOT NULL THEN
        IF jsonb_typeof(p_properties) <> 'object' THEN
            RAISE EXCEPTION 'properties must be a JSON object, not %', jsonb_typeof(p_properties) USING ERRCODE = '22023',
                HINT = 'Give the columns to set as keys, e.g. {"name": "Main St"}.';
        END IF;
        IF NOT user_layer THEN
            IF p_properties <> '{}' THEN
                RAISE EXCEPTION 'the built-in layer features has no properties' USING ERRCODE = '22023',
                    HINT = 'Register a table of your own with register_layer(..., properties => ...) for attributes.';
            END IF;
        ELSE
            keys := ARRAY(SELECT jsonb_object_keys(p_properties));
            SELECT string_agg(quote_ident(k), ', ') INTO bad FROM unnest(keys) k
             WHERE k <> ALL (lay.properties::text[]);
            IF bad IS NOT NULL THEN
                RAISE EXCEPTION 'not a registered property of layer %: %', p_layer, bad USING ERRCODE = '22023',
                    HINT = CASE WHEN cardinality(lay.properties) > 0
                                THEN format('Allowed keys: %s.', array_to_string(lay.properties, ', '))
                                ELSE 'This layer has no registered properties; register_layer(..., properties => ...) lists them.' END;
            END IF;
            IF p_event_type = 'retired' AND lay.retired_column IS NULL THEN
                RAISE EXCEPTION 'a retired event of layer % deletes the row, so it cannot set properties', p_layer
                    USING ERRCODE = '22023', HINT = 'Send an updated event first, or register the layer with a retired_column.';
            END IF;
        END IF;
    END IF;
    IF p_event_type = 'updated' AND p_geom IS NOT NULL AND NOT p_record THEN
        RAISE EXCEPTION 'an updated event changes attributes only, so its geometry must be NULL' USING ERRCODE = '22023',
            HINT = 'Send a moved event to change the geometry.';
    END IF;

    IF p_geom IS NULL THEN
        IF p_event_type IN ('created', 'moved') THEN
            RAISE EXCEPTION 'geometry must not be NULL for a % event', p_event_type USING ERRCODE = '22004',
                HINT = 'Only retired and updated events may omit the geometry; they keep the last one.';
        END IF;
        v_res := current_setting('feature_outbox.h3_resolution')::integer;
    ELSE
        IF ST_IsEmpty(p_geom) THEN
            RAISE EXCEPTION 'geometry is empty' USING ERRCODE = '22023',
                HINT = 'A feature needs a non-empty geometry. To remove a feature, send a retired event.';
        END IF;
        v_srid := ST_SRID(p_geom);
        IF v_srid = 0 THEN
            RAISE EXCEPTION 'geometry has SRID 0 (unknown coordinate system)' USING ERRCODE = '22023',
                HINT = 'Give it one, e.g. ST_SetSRID(geom, 4326) for longitude/latitude in degrees.';
        ELSIF v_srid <> 4326 THEN
            SELECT s.auth_name || ':' || s.auth_srid INTO crs FROM spatial_ref_sys s WHERE s.srid = v_srid;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'unknown SRID %', v_srid USING ERRCODE = '22023',
                    HINT = 'Use an EPSG code listed in spatial_ref_sys, or transform to 4326 first.';
            END IF;
        END IF;
        IF GeometryType(p_geom) NOT IN ('POINT', 'LINESTRING', 'POLYGON', 'MULTIPOINT', 'MULTILINESTRING', 'MULTIPOLYGON') THEN
            PERFORM _check_types(p_geom);
        END IF;

        IF v_srid = 4326 THEN
            g := p_geom;
            facts := _inspect_geometry(coalesce(p_wkb, ST_AsBinary(g)), true, 4326, NULL);
        ELSE
            PERFORM _inspect_geometry(coalesce(p_wkb, ST_AsBinary(p_geom)), false, v_srid, NULL);
            BEGIN
                g := ST_Transform(p_geom, 4326);
            EXCEPTION WHEN internal_error THEN
                RAISE EXCEPTION 'cannot transform geometry from SRID % to 4326', v_srid USING ERRCODE = '22023',
                    DETAIL = SQLERRM, HINT = 'Check the SRID''s definition in spatial_ref_sys and that the coordinates lie inside its area of use.';
            END;
            -- Range, and the CRS's area of use as PROJ records it.
            facts := _inspect_geometry(ST_AsBinary(g), true, v_srid, crs);
            -- Second check: PROJ wraps coordinates far outside a projection's domain instead of failing
            -- (EPSG:3857 x = 4e7 m becomes longitude 0). Transforming back exposes it.
            back := ST_Transform(ST_SetSRID(g, 4326), v_srid);
            tolerance := 1e-6 * greatest(1, abs(ST_XMin(p_geom)), abs(ST_XMax(p_geom)), abs(ST_YMin(p_geom)), abs(ST_YMax(p_geom)));
            IF greatest(abs(ST_XMin(back) - ST_XMin(p_geom)), abs(ST_XMax(back) - ST_XMax(p_geom)),
                        abs(ST_YMin(back) - ST_YMin(p_geom)), abs(ST_YMax(back) - ST_YMax(p_geom))) > tolerance THEN
                RAISE EXCEPTION 'coordinates are outside the area where SRID % can be transformed to 4326', v_srid
                    USING ERRCODE = '22023', DETAIL = format('%s transforms to %s and back to %s.',
                          ST_AsText(ST_Envelope(p_geom)), ST_AsText(ST_Envelope(g)), ST_AsText(ST_Envelope(back))),
                    HINT = 'Check the coordinates and their SRID; are x and y swapped, or the units wrong?';
            END IF;
            IF facts[2] <> 0 THEN
                -- A ring winds round a pole: in its source CRS the polygon encloses it. Rebuild it as a
                -- polar cap from a copy densified in that CRS, and route it on its source point on surface.
                g := ST_GeomFromEWKB(_close_polar_caps(ST_AsBinary(ST_Transform(ST_Segmentize(p_geom,
                         greatest(ST_XMax(p_geom) - ST_XMin(p_geom), ST_YMax(p_geom) - ST_YMin(p_geom)) / 256), 4326))));
                IF NOT (ST_IsValidDetail(g)).valid
                   OR NOT ST_Covers(g, ST_SetSRID(ST_MakePoint(0, 90 * facts[2]), 4326)) THEN
                    RAISE EXCEPTION 'a polygon around the % Pole in SRID % cannot be stored as a valid EPSG:4326 polygon',
                        CASE WHEN facts[2] < 0 THEN 'South' ELSE 'North' END, v_srid USING ERRCODE = '22023',
                        DETAIL = format('Rebuilt as a polar cap it is %s.', CASE WHEN (ST_IsValidDetail(g)).valid
                                 THEN 'valid but does not cover the pole' ELSE 'not valid: ' || ST_IsValidReason(g) END),
                        HINT = 'Split it into parts that do not enclose the pole, or transform it to EPSG:4326 yourself.';
                END IF;
                facts := _inspect_geometry(ST_AsBinary(g), true, 4326, NULL);
                p := ST_Transform(ST_PointOnSurface(p_geom), 4326);
                reshaped := true;
            END IF;
        END IF;

        IF p IS NULL THEN
            -- The one GEOS validity test of the normal path (ST_IsValid would also send a NOTICE).
            IF (ST_IsValidDetail(g)).valid THEN
                shape := g;
            ELSE
                CASE current_setting('feature_outbox.invalid_geometry')
                WHEN 'reject' THEN
                    RAISE EXCEPTION 'geometry is not valid: %', (ST_IsValidDetail(g)).reason USING ERRCODE = '22023',
                        DETAIL = format('ST_IsValidReason: %s', ST_IsValidReason(g)),
                        HINT = 'Repair it with ST_MakeValid(geom), or set feature_outbox.invalid_geometry = repair.';
                WHEN 'repair' THEN
                    g := _made_valid(g);
                    shape := g;
                    reshaped := true;
                    facts := _inspect_geometry(ST_AsBinary(g), true, 4326, NULL);  -- the stored shape's box
                ELSE
                    -- accept: store as given; route on a made-valid copy, crossing as that copy has it
                    shape := _made_valid(g);
                    facts[1] := (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[1];
                END CASE;
            END IF;
            p := ST_PointOnSurface(CASE WHEN facts[1] = 1 THEN ST_ShiftLongitude(shape) ELSE shape END);
        END IF;
        v_point := ARRAY[ST_X(p), ST_Y(p)];
        IF v_point[1] > 180 THEN  -- taken on the longitude-shifted shape
            v_point[1] := v_point[1] - 360;
        END IF;
        v_res := facts[7];
        new_key := _h3_cell(v_point[1], v_point[2], v_res);
    END IF;

    IF NOT user_layer THEN
        IF p_event_type = 'created' THEN
            v_digest := md5(ST_AsEWKB(g))::uuid;
            WITH f AS (
                INSERT INTO features AS f (id, geom, version) VALUES (p_feature_id, g, 1)
                ON CONFLICT (id) DO NOTHING
                RETURNING f.version
            )
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer, geometry_digest, properties_digest)
            SELECT p_feature_id, f.version, 'created', new_key, 'features', v_digest, md5('()')::uuid FROM f
            RETURNING feature_version INTO new_version;
            IF new_version IS NULL THEN
                SELECT f.retired_at INTO old_retired FROM features f WHERE f.id = p_feature_id;
                IF old_retired IS NOT NULL THEN
                    RAISE EXCEPTION 'feature % already exists and is retired', p_feature_id USING ERRCODE = '23505',
                        DETAIL = format('It was retired at %s.', old_retired),
                        HINT = 'Ids of retired features are not reused, and a retired feature takes no edits: create it under a new id.';
                END IF;
                RAISE EXCEPTION 'feature % already exists', p_feature_id USING ERRCODE = '23505',
                    HINT = 'Send a moved event to change it.';
            END IF;
            INSERT INTO feature_state AS s (layer, feature_id, routing_key, h3_resolution, routing_point, bbox,
                                            geometry_digest, properties_digest, version, last_event)
            VALUES ('features', p_feature_id, new_key, v_res, v_point, facts[3:6], v_digest, md5('()')::uuid, 1, 'created')
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL,
                   geometry_digest = EXCLUDED.geometry_digest, properties_digest = EXCLUDED.properties_digest,
                   version = 1, last_event = 'created';
        ELSE
            FOR attempt IN 1..2 LOOP
                -- One statement writes state, feature and outbox row. The state row goes first: its lock
                -- orders the edits of this feature, and RETURNING hands back the state the last committed
                -- edit left. A retired event without a geometry keeps the last one, and its state.
                WITH st AS (
                    UPDATE feature_state s
                       SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
                           previous_routing_point = s.routing_point, previous_bbox = s.bbox,
                           routing_key = coalesce(new_key, s.routing_key),
                           h3_resolution = CASE WHEN new_key IS NULL THEN s.h3_resolution ELSE v_res END,
                           routing_point = coalesce(v_point, s.routing_point),
                           bbox = coalesce(facts[3:6], s.bbox),
                           -- features.geom is g exactly. The version follows the state's own, which
                           -- its row lock orders (a state row without one is filled in below first).
                           geometry_digest = CASE WHEN g IS NULL THEN s.geometry_digest ELSE md5(ST_AsEWKB(g))::uuid END,
                           properties_digest = md5('()')::uuid,
                           version = s.version + 1,
                           last_event = p_event_type
                     WHERE s.layer = 'features' AND s.feature_id = p_feature_id AND s.version IS NOT NULL
                    RETURNING CASE WHEN s.previous_h3_resolution = v_res THEN s.previous_routing_key
                                   -- the resolution changed since: the old routing point at the new one
                                   ELSE _h3_cell(s.previous_routing_point[1], s.previous_routing_point[2], v_res)
                              END AS previous_key,
                              s.previous_bbox, s.geometry_digest, s.properties_digest
                ), f AS (
                    UPDATE features f
                       SET geom = coalesce(g, f.geom),
                           version = f.version + 1,
                           updated_at = now(),
                           retired_at = CASE WHEN p_event_type = 'retired' THEN now() END
                      FROM st
                     WHERE f.id = p_feature_id AND f.retired_at IS NULL
                    RETURNING f.version, st.previous_key, st.previous_bbox, st.geometry_digest, st.properties_digest
                )
                INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key, layer, previous_bbox,
                                    geometry_digest, properties_digest)
                SELECT p_feature_id, f.version, p_event_type, coalesce(new_key, f.previous_key), f.previous_key, 'features',
                       f.previous_bbox, f.geometry_digest, f.properties_digest FROM f
                RETURNING feature_version INTO new_version;
                EXIT WHEN new_version IS NOT NULL;

                -- Nothing written: the feature is missing or retired, or has no state (or no state
                -- version) yet. Raising undoes the state update above.
                SELECT f.retired_at INTO old_retired FROM features f WHERE f.id = p_feature_id FOR UPDATE;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'feature % does not exist', p_feature_id USING ERRCODE = 'P0002',
                        HINT = 'Send a created event first.';
                ELSIF old_retired IS NOT NULL THEN
                    RAISE EXCEPTION 'feature % is retired', p_feature_id USING ERRCODE = '55000',
                        DETAIL = format('It was retired at %s.', old_retired),
                        HINT = 'A retired feature takes no further edits; create a new feature id.';
                ELSIF attempt = 2 THEN
                    RAISE EXCEPTION 'feature % has no routing state after it was filled in', p_feature_id
                        USING ERRCODE = 'XX000';
                END IF;
                -- Written before 0.2.0: fill its state from the stored geometry; last edited before
                -- 0.3.0: its state's version. Both from the row under the lock just taken; then write
                -- the edit as above.
                INSERT INTO feature_state AS s (layer, feature_id, routing_key, h3_resolution, routing_point, bbox, version)
                SELECT 'features', f.id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
                       (_inspect_geometry(ST_AsBinary(f.geom), true, 4326, NULL))[3:6], f.version
                  FROM features f, _routing_point(f.geom) q  -- the point comes wrapped to [-180, 180]
                 WHERE f.id = p_feature_id
                ON CONFLICT (layer, feature_id) DO UPDATE SET version = EXCLUDED.version WHERE s.version IS NULL;
            END LOOP;
        END IF;
    ELSE
        -- A user layer. Its row is written by _layer_write with the calling role's rights; the state
        -- and outbox rows here, as the owner. The row's lock orders concurrent edits of one feature.
        IF g IS NOT NULL AND (NOT p_record OR reshaped) THEN
            -- The column's SRID: the input as given when it is in it already, else transformed. PROJ
            -- fails, or silently returns garbage, for shapes outside a projection's domain: transform
            -- back and compare, as for the input.
            IF (v_srid = lay.srid AND NOT reshaped) OR lay.srid = 4326 THEN
                store := CASE WHEN lay.srid = 4326 THEN g ELSE p_geom END;
            ELSE
                -- One area-of-use rule for every write: the column's CRS gets the test an input in
                -- that CRS gets, so nothing is stored that a later edit in the column's SRID refuses.
                IF v_srid <> lay.srid THEN
                    SELECT s.auth_name || ':' || s.auth_srid INTO store_crs FROM spatial_ref_sys s WHERE s.srid = lay.srid;
                    PERFORM _check_storage_area(ST_AsBinary(g), store_crs, p_layer);
                END IF;
                BEGIN
                    store := ST_Transform(g, lay.srid);
                    back := ST_Transform(store, 4326);
                EXCEPTION WHEN internal_error THEN
                    back := NULL;
                END;
                -- Near a projection's singularity (the antipode of a polar stereographic CRS's pole)
                -- the inverse still lands, but the forward coordinates run off to 1e23: no ordinate of
                -- a place on Earth exceeds 1e9 units (a million kilometres).
                IF back IS NULL OR greatest(abs(ST_XMin(back) - ST_XMin(g)), abs(ST_XMax(back) - ST_XMax(g)),
                                            abs(ST_YMin(back) - ST_YMin(g)), abs(ST_YMax(back) - ST_YMax(g))) > 1e-6
                   OR NOT greatest(abs(ST_XMin(store)), abs(ST_XMax(store)), abs(ST_YMin(store)), abs(ST_YMax(store))) <= 1e9 THEN
                    RAISE EXCEPTION 'the geometry cannot be stored in SRID % of layer %', lay.srid, p_layer
                        USING ERRCODE = '22023', DETAIL = format('%s in EPSG:4326 is outside the domain of SRID %s.',
                              ST_AsText(ST_Envelope(g)), lay.srid),
                        HINT = format('Column %I of %s is declared in SRID %s; this shape lies where that projection does not reach.',
                                      lay.geometry_column, lay.tbl, lay.srid);
                END IF;
            END IF;
            IF lay.geometry_type <> 'Geometry' THEN
                -- A single geometry into a column of its Multi form is promoted losslessly, as ST_Multi
                -- and ogr2ogr's PROMOTE_TO_MULTI do; the event carries it as stored.
                IF lay.geometry_type IN ('MultiPoint', 'MultiLineString', 'MultiPolygon')
                   AND GeometryType(store) = upper(substr(lay.geometry_type, 6)) THEN
                    store := ST_Multi(store);
                END IF;
                IF GeometryType(store) <> upper(lay.geometry_type) THEN
                    RAISE EXCEPTION 'layer % stores %, not %', p_layer, lay.geometry_type, substr(ST_GeometryType(store), 4)
                        USING ERRCODE = '22023', HINT = CASE WHEN reshaped
                              THEN 'ST_MakeValid (feature_outbox.invalid_geometry = repair) changed its type; repair it yourself, or set invalid_geometry = accept or reject.'
                              ELSE format('Its column %I is declared geometry(%s, %s).', lay.geometry_column, lay.geometry_type, lay.srid) END;
                END IF;
            END IF;
        END IF;
        fresh := p_event_type = 'created';
        IF NOT fresh THEN
            IF NOT lay.has_state THEN
                IF p_record AND p_geom IS NOT NULL THEN
                    -- The row holds the new geometry already: the one before it is unknown.
                    fresh := true;
                ELSE
                    -- A row written before the layer was registered: its state, from its stored geometry.
                    BEGIN
                        r := _as_caller_row(format('SELECT ST_AsHEXEWKB(ST_Transform(t.%I, 4326)) FROM %s t WHERE t.%I = $1::%s',
                                                   lay.geometry_column, lay.tbl, lay.id_column, v_cast), v_key);
                        shape := r[1]::geometry;
                        IF shape IS NOT NULL THEN
                            INSERT INTO feature_state (layer, feature_id, routing_key, h3_resolution, routing_point, bbox, feature_key)
                            SELECT p_layer, p_feature_id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
                                   (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[3:6], p_key
                              FROM _routing_point(shape) q
                            ON CONFLICT (layer, feature_id) DO NOTHING;
                        END IF;
                    EXCEPTION WHEN data_exception THEN
                        -- A stored geometry the edit path would refuse: no previous key, as for created.
                        IF new_key IS NULL THEN
                            RAISE;
                        END IF;
                        fresh := true;
                    END;
                    IF shape IS NULL THEN
                        fresh := true;
                    END IF;
                END IF;
            END IF;
        END IF;

        w := _layer_write_row(p_layer, CASE WHEN p_event_type = 'retired' AND lay.retired_column IS NULL THEN 'delete'
                                        WHEN p_record THEN 'record_' || p_event_type
                                        ELSE p_event_type END,
                          lay.tbl, lay.id_column, lay.geometry_column, lay.version_column, lay.retired_column,
                          v_key, v_cast, store, p_properties::text, keys, lay.properties::text[]);
        IF w IS NULL THEN
            r := _as_caller_row(format('SELECT (%s)::text FROM %s t WHERE t.%I = $1::%s',
                                       CASE WHEN lay.retired_column IS NULL THEN 'NULL::timestamptz'
                                            ELSE format('t.%I', lay.retired_column) END,
                                       lay.tbl, lay.id_column, v_cast), v_key);
            old_retired := r[1]::timestamptz;
            IF p_event_type = 'created' AND r IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = '23505', MESSAGE = format('feature %s already exists in layer %s%s',
                    v_key, p_layer, CASE WHEN old_retired IS NOT NULL THEN ' and is retired' ELSE '' END),
                    HINT = 'Send a moved or updated event to change it; ids of retired features are not reused.';
            ELSIF old_retired IS NOT NULL THEN
                RAISE EXCEPTION 'feature % of layer % is retired', v_key, p_layer USING ERRCODE = '55000',
                    DETAIL = format('It was retired at %s.', old_retired),
                    HINT = 'A retired feature takes no further edits; create a new feature id.';
            END IF;
            RAISE EXCEPTION 'feature % does not exist in layer %', v_key, p_layer USING ERRCODE = 'P0002',
                HINT = 'Send a created event first.';
        END IF;
        new_version := w[1]::integer;
        gd := w[3];
        pd := w[4];
        -- Routing follows the geometry: an updated event carries none, so the row must still hold
        -- the one its last event recorded. A plain UPDATE that moved it needs a moved event. (Read
        -- under the row's lock, which orders this feature's edits: the last committed one's state.)
        IF new_key IS NULL AND p_event_type = 'updated' THEN
            SELECT s.geometry_digest INTO state_gd FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = p_feature_id;
            IF state_gd IS DISTINCT FROM gd AND state_gd IS NOT NULL THEN
                RAISE EXCEPTION 'the geometry of feature % of layer % changed since its last event', v_key, p_layer
                    USING ERRCODE = '22023',
                    DETAIL = 'It was written outside edit_feature and record_edit; an updated event would keep its old routing key.',
                    HINT = format('Send a moved event with its geometry (after the application''s own write: record_edit(%L, %s, ''moved'')), or CALL feature_outbox.resync(%L).',
                                  p_layer, CASE WHEN p_key IS NULL THEN v_key ELSE quote_literal(v_key) END, p_layer);
            END IF;
        END IF;
        IF fresh AND new_key IS NULL THEN
            RAISE EXCEPTION 'feature % of layer % has no geometry to route its event by', v_key, p_layer
                USING ERRCODE = '22004', HINT = 'Send a moved event with its geometry.';
        END IF;

        IF fresh THEN
            INSERT INTO feature_state AS s (layer, feature_id, routing_key, h3_resolution, routing_point, bbox, row_version,
                                            geometry_digest, properties_digest, version, last_event, feature_key)
            VALUES (p_layer, p_feature_id, new_key, v_res, v_point, facts[3:6], w[2], gd, pd, new_version,
                    p_event_type, p_key)
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL,
                   row_version = EXCLUDED.row_version, geometry_digest = EXCLUDED.geometry_digest,
                   properties_digest = EXCLUDED.properties_digest, version = EXCLUDED.version,
                   last_event = EXCLUDED.last_event;
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer, geometry_digest, properties_digest,
                                feature_key)
            VALUES (p_feature_id, new_version, p_event_type, new_key, p_layer, gd, pd, p_key);
        ELSE
            WITH st AS (
                UPDATE feature_state s
                   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
                       previous_routing_point = s.routing_point, previous_bbox = s.bbox,
                       routing_key = coalesce(new_key, s.routing_key),
                       h3_resolution = CASE WHEN new_key IS NULL THEN s.h3_resolution ELSE v_res END,
                       routing_point = coalesce(v_point, s.routing_point),
                       bbox = coalesce(facts[3:6], s.bbox),
                       row_version = w[2],
                       geometry_digest = gd, properties_digest = pd,
                       version = new_version, last_event = p_event_type
                 WHERE s.layer = p_layer AND s.feature_id = p_feature_id
                RETURNING s.routing_key,
                          CASE WHEN s.previous_h3_resolution = v_res THEN s.previous_routing_key
                               ELSE _h3_cell(s.previous_routing_point[1], s.previous_routing_point[2], v_res)
                          END AS previous_key,
                          s.previous_bbox
            )
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key, layer, previous_bbox,
                                geometry_digest, properties_digest, feature_key)
            SELECT p_feature_id, new_version, p_event_type, st.routing_key, st.previous_key, p_layer, st.previous_bbox,
                   gd, pd, p_key FROM st;
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n = 0 THEN
                RAISE EXCEPTION 'feature % of layer % has no routing state', v_key, p_layer USING ERRCODE = 'XX000';
            END IF;
        END IF;
    END IF;

    IF _wake_relay_for(p_feature_id) IS NULL THEN END IF;  -- sets the owning relay worker's latch if and when this commits
    RETURN new_version;
END
$$;

-- Monitoring: failing_rows counts row-level failures only -----------------------------------------

CREATE OR REPLACE VIEW backlog AS
SELECT u.unpublished_rows,
       u.oldest_unpublished_at,
       greatest(now() - u.oldest_unpublished_at, interval '0') AS oldest_unpublished_age,
       (SELECT max(o.published_at) FROM outbox o WHERE o.published_at IS NOT NULL) AS last_published_at,
       u.failing_rows,
       u.parked_rows,
       u.oldest_parked_at,
       s.relay_workers_running,
       s.relay_last_active_at,
       s.relay_last_error,
       s.relay_last_error_at,
       -- Parked rows wait for a person: alert when this is not null (NULL when nothing is parked).
       CASE WHEN u.oldest_parked_at IS NOT NULL THEN greatest(now() - u.oldest_parked_at, interval '0') END
           AS oldest_parked_age,
       h.pid AS vacuum_held_by_pid,
       h.held_for AS vacuum_held_for
  FROM (SELECT count(*) AS unpublished_rows,
               -- Parked rows wait for a person, not the relay: they do not hold the age alert on.
               min(o.created_at) FILTER (WHERE o.parked_at IS NULL) AS oldest_unpublished_at,
               count(*) FILTER (WHERE o.row_failures > 0 AND o.parked_at IS NULL) AS failing_rows,
               count(*) FILTER (WHERE o.parked_at IS NOT NULL) AS parked_rows,
               min(o.parked_at) AS oldest_parked_at
          FROM (-- From the low-water mark up (relay/low_water): below it every row is published or
                -- parked, and the dead index entries of published rows there are never read.
                SELECT o.created_at, o.parked_at, o.row_failures FROM outbox o
                 WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
                UNION ALL
                SELECT o.created_at, o.parked_at, o.row_failures FROM outbox o
                 WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL AND o.id < _relay_low_water()) o) u
 CROSS JOIN _relay_status() s
  -- The session whose snapshot or transaction holds back VACUUM here the longest: row versions
  -- newer than its horizon stay, dead, and the relay's index scans walk them (README, "Monitoring").
  -- A walsender carries a standby's hot_standby_feedback. Reading other sessions needs pg_read_all_stats
  -- (pg_monitor has it); otherwise only one's own sessions show.
  LEFT JOIN LATERAL (
       SELECT a.pid, greatest(now() - coalesce(a.xact_start, a.backend_start), interval '0') AS held_for
         FROM pg_stat_activity a
        WHERE a.pid <> pg_backend_pid()
          AND greatest(age(a.backend_xmin), age(a.backend_xid)) IS NOT NULL
          AND (a.datname = current_database() OR a.backend_type = 'walsender')
        -- Equal horizons (no xid assigned between two snapshots): the older transaction, which
        -- the relay's own short ones never are.
        ORDER BY greatest(age(a.backend_xmin), age(a.backend_xid)) DESC, coalesce(a.xact_start, a.backend_start)
        LIMIT 1) h ON true;
COMMENT ON VIEW backlog IS 'Unpublished outbox rows, the age of the oldest, failing and parked rows, relay health.';

CREATE OR REPLACE FUNCTION metrics() RETURNS text
LANGUAGE sql STABLE
AS $$
    -- Every series carries database="<current_database()>": one Prometheus job can scrape many
    -- databases of one server (label values escaped per the exposition format).
    SELECT concat_ws(E'\n',
        '# HELP outbox_rows_relayed_total Outbox rows published and acknowledged since server start.',
        '# TYPE outbox_rows_relayed_total counter',
        format('outbox_rows_relayed_total{%s,event_type="created"} %s', l.db, s.relayed_created),
        format('outbox_rows_relayed_total{%s,event_type="moved"} %s', l.db, s.relayed_moved),
        format('outbox_rows_relayed_total{%s,event_type="retired"} %s', l.db, s.relayed_retired),
        format('outbox_rows_relayed_total{%s,event_type="updated"} %s', l.db, _relay_relayed('updated')),
        format('outbox_rows_relayed_total{%s,event_type="snapshot"} %s', l.db, _relay_relayed('snapshot')),
        (SELECT string_agg(format(E'# HELP %1$s %2$s\n# TYPE %1$s gauge\n%1$s{%4$s} %3$s', g.name, g.help, g.value, l.db),
                           E'\n' ORDER BY g.ord)
           FROM (VALUES
                 (1, 'outbox_unpublished_rows', 'Unpublished outbox rows, parked ones included.',
                  b.unpublished_rows::numeric),
                 (2, 'outbox_oldest_unpublished_age_seconds', 'Age of the oldest unpublished, unparked outbox row.',
                  coalesce(extract(epoch FROM b.oldest_unpublished_age), 0)),
                 (3, 'outbox_failing_rows', 'Unpublished rows that failed row-level (a sink outage counts elsewhere) and are not parked.',
                  b.failing_rows),
                 (4, 'outbox_parked_rows', 'Rows parked: after feature_outbox.max_attempts failures, or undeliverable as they are.',
                  b.parked_rows),
                 (5, 'outbox_relay_workers_running', 'Relay background workers running for this database.',
                  b.relay_workers_running),
                 (6, 'outbox_oldest_parked_age_seconds', 'Age of the oldest parked outbox row; 0 when none.',
                  coalesce(extract(epoch FROM b.oldest_parked_age), 0)),
                 (7, 'outbox_vacuum_held_for_seconds', 'Age of the transaction that holds back VACUUM of the outbox the longest.',
                  coalesce(extract(epoch FROM b.vacuum_held_for), 0))) AS g(ord, name, help, value))
    ) || E'\n'
      FROM backlog b, _relay_status() s,
           LATERAL (SELECT format('database="%s"',
                                  replace(replace(replace(current_database(), E'\\', E'\\\\'), '"', E'\\"'), E'\n', E'\\n'))) AS l(db)
$$;

CREATE OR REPLACE VIEW backlog_by_layer AS
SELECT l.layer,
       coalesce(u.unpublished_rows, 0) AS unpublished_rows,
       u.oldest_unpublished_at,
       greatest(now() - u.oldest_unpublished_at, interval '0') AS oldest_unpublished_age,
       (SELECT o.published_at FROM outbox o WHERE o.published_at IS NOT NULL AND o.layer = l.layer
         ORDER BY o.published_at DESC LIMIT 1) AS last_published_at,
       coalesce(u.failing_rows, 0) AS failing_rows,
       coalesce(u.parked_rows, 0) AS parked_rows,
       u.oldest_parked_at,
       b.relay_workers_running,
       b.relay_last_active_at,
       b.relay_last_error,
       b.relay_last_error_at,
       CASE WHEN u.oldest_parked_at IS NOT NULL THEN greatest(now() - u.oldest_parked_at, interval '0') END
           AS oldest_parked_age,
       b.vacuum_held_by_pid,
       b.vacuum_held_for,
       -- drift(): rows that differ from their last event at its last run (resync: rows it left).
       reg.drift_rows AS drifted_rows,
       reg.drift_checked_at,
       -- A held layer's rows wait for release_layer(): why, and since when.
       reg.held_since,
       reg.held_reason
  FROM (SELECT r.layer FROM layer_registry r
        UNION
        SELECT o.layer FROM outbox o WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
        UNION
        SELECT o.layer FROM outbox o WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL) l
  LEFT JOIN (
       SELECT o.layer,
              count(*) AS unpublished_rows,
              min(o.created_at) FILTER (WHERE o.parked_at IS NULL) AS oldest_unpublished_at,
              count(*) FILTER (WHERE o.row_failures > 0 AND o.parked_at IS NULL) AS failing_rows,
              count(*) FILTER (WHERE o.parked_at IS NOT NULL) AS parked_rows,
              min(o.parked_at) AS oldest_parked_at
         FROM (SELECT o.layer, o.created_at, o.parked_at, o.row_failures FROM outbox o
                WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
               UNION ALL
               SELECT o.layer, o.created_at, o.parked_at, o.row_failures FROM outbox o
                WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL AND o.id < _relay_low_water()) o
        GROUP BY o.layer) u ON u.layer = l.layer
  LEFT JOIN layer_registry reg ON reg.layer = l.layer
 CROSS JOIN backlog b;
COMMENT ON VIEW backlog_by_layer IS 'The backlog view''s columns, one row per layer.';

-- Digests, drift and resync (issue 20: routing follows the geometry, drift shown and repaired) ------

-- The digest of a layer row's registered properties (src/edit/digest.rs).
CREATE  FUNCTION "_properties_digest"(
	"row" anyelement /* AnyElement */
) RETURNS uuid /* Uuid */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_properties_digest_wrapper';

-- The layer write returns the row's digests and takes keys of any type; 0.2.0's _layer_write goes
-- (its symbol stays).
DROP FUNCTION _layer_write(text, text, oid, text, text, text, text, bigint, anyelement, text, text[]);
CREATE  FUNCTION "_layer_write_row"(
	"layer" TEXT, /* & str */
	"op" TEXT, /* & str */
	"tbl" oid, /* pg_sys :: Oid */
	"id_column" TEXT, /* & str */
	"geometry_column" TEXT, /* & str */
	"version_column" TEXT, /* & str */
	"retired_column" TEXT, /* Option < & str > */
	"key" TEXT, /* & str */
	"id_type" TEXT, /* & str */
	"geometry" anyelement, /* Option < AnyElement > */
	"properties" TEXT, /* Option < & str > */
	"keys" TEXT[], /* :: std :: option :: Option < Vec < String > > */
	"registered" TEXT[] /* :: std :: option :: Option < Vec < String > > */
) RETURNS TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
VOLATILE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_layer_write_row_wrapper';
CREATE  FUNCTION "_row_digests_sql"(
	"geometry_column" TEXT, /* & str */
	"properties" TEXT[] /* Vec < String > */
) RETURNS TEXT /* String */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_row_digests_sql_wrapper';
CREATE  FUNCTION "_as_caller_row"(
	"sql" TEXT, /* & str */
	"key" TEXT /* & str */
) RETURNS TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
STRICT VOLATILE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_as_caller_row_key_wrapper';
CREATE  FUNCTION "_as_caller_rows"(
	"sql" TEXT, /* & str */
	"args" TEXT[] /* Vec < Option < String > > */
) RETURNS SETOF TEXT[] /* Vec < Option < String > > */
STRICT VOLATILE 
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_as_caller_rows_text_wrapper';
REVOKE ALL ON FUNCTION _layer_write_row(text, text, oid, text, text, text, text, text, text, anyelement, text, text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_row(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_rows(text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _edit(text, bigint, geometry, text, bytea, jsonb, boolean, text) FROM PUBLIC;

-- uuid and text keys: record_edit of any key, edit_feature and record_edit forms for them.
CREATE OR REPLACE FUNCTION _record_edit(layer text, feature_id bigint, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN _record_edit_key(layer, feature_id::text, event_type);
END
$$;

-- The type a layer's statements cast a key (given as text) to: bigint for the integer types, whose
-- key is the feature's number, else the id column's own type (uuid, text, character varying).
CREATE FUNCTION _key_cast(id_type regtype) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN id_type IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype) THEN 'bigint' ELSE id_type::text END
$$;


-- A feature's number and canonical key: for a layer keyed by uuid or text, the number its first
-- event drew (feature_keys), or a new one from feature_key_seq, recorded there (two first events
-- of one key wait for each other and get the same number); the key as text in
-- the id type's canonical form (uuid: lowercase, hyphenated), so that one feature has one key
-- however the caller spelt it. For integer keys the number is the key and `canonical` is NULL.
-- 22P02 for a key that is not of the id column's type.
CREATE FUNCTION _feature_number(lay layer_registry, p_key text, OUT number bigint, OUT canonical text)
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF _key_cast(lay.id_type) = 'bigint' THEN
        number := p_key::bigint;
        RETURN;
    END IF;
    canonical := CASE WHEN lay.id_type = 'uuid'::regtype THEN p_key::uuid::text ELSE p_key END;
    SELECT k.feature_id INTO number FROM feature_keys k WHERE k.layer = lay.layer AND k.feature_key = canonical;
    IF number IS NULL THEN
        INSERT INTO feature_keys (layer, feature_key, feature_id) VALUES (lay.layer, canonical, nextval('feature_key_seq'))
        ON CONFLICT (layer, feature_key) DO NOTHING
        RETURNING feature_id INTO number;
        IF number IS NULL THEN  -- drawn meanwhile by a concurrent first event, now committed
            SELECT k.feature_id INTO number FROM feature_keys k WHERE k.layer = lay.layer AND k.feature_key = canonical;
        END IF;
    END IF;
END
$$;


-- edit_feature(layer, <uuid or text key>, ...): the feature's number, then _edit. Also serves
-- integer keys given as text ('42').
CREATE FUNCTION _edit_key(p_layer text, p_key text, p_geom geometry, p_event_type text, p_wkb bytea,
                          p_properties jsonb, p_record boolean) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry;
    f record;
BEGIN
    SELECT * INTO lay FROM layer_registry r WHERE r.layer = p_layer;
    IF NOT FOUND OR p_key IS NULL THEN  -- _edit raises the error (42704, 22004)
        RETURN _edit(p_layer, CASE WHEN p_key IS NOT NULL THEN 0 END, p_geom, p_event_type, p_wkb, p_properties, p_record);
    END IF;
    f := _feature_number(lay, p_key);
    RETURN _edit(p_layer, f.number, p_geom, p_event_type, p_wkb, p_properties, p_record, f.canonical);
END
$$;


-- For applications whose ORM writes the row itself: called after that write, in the same
-- transaction. The row version must be this transaction's (xmin, checked in Rust) and not already
-- recorded, so no role can invent an event for a change that did not happen. `key`: the feature's
-- key as text, of any id type.
CREATE FUNCTION _record_edit_key(layer text, key text, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry;
    f record;
    r text[];             -- {xmin, row version, geometry (HEXEWKB)}, read as the caller
    recorded text;
BEGIN
    IF layer = 'features' THEN
        RAISE EXCEPTION 'record_edit serves user layers' USING ERRCODE = '22023',
            HINT = 'The built-in layer features is written by edit_feature(feature_id, geometry, event_type).';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(layer));
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = _record_edit_key.layer;
    IF NOT FOUND OR key IS NULL OR event_type IS NULL
       OR event_type NOT IN ('created', 'moved', 'retired', 'updated') THEN
        RETURN _edit_key(layer, key, NULL, event_type, NULL, NULL, true);  -- raises the input's error
    END IF;
    f := _feature_number(lay, key);
    r := _as_caller_row(format('SELECT t.xmin::text, %s, ST_AsHEXEWKB(t.%I) FROM %s t WHERE t.%I = $1::%s',
                               't.tableoid::oid::text || '':'' || t.ctid::text || '':'' || t.xmin::text',
                               lay.geometry_column, lay.tbl, lay.id_column,
                               _key_cast(lay.id_type)),
                        coalesce(f.canonical, key));
    IF r IS NULL THEN
        RAISE EXCEPTION 'feature % does not exist in layer %', coalesce(f.canonical, key), layer USING ERRCODE = 'P0002',
            HINT = 'Call record_edit after the application''s own INSERT or UPDATE of the row, in the same transaction.';
    END IF;
    SELECT s.row_version INTO recorded FROM feature_state s
     WHERE s.layer = _record_edit_key.layer AND s.feature_id = f.number;
    IF event_type = 'created' AND FOUND THEN
        RAISE EXCEPTION 'feature % of layer % has events already', coalesce(f.canonical, key), layer USING ERRCODE = '23505',
            HINT = 'Record a moved or updated event for a row that was written before.';
    END IF;
    -- A retired event makes its change itself (sets the retired column, or deletes the row).
    IF event_type <> 'retired' AND NOT _written_by_this_transaction(r[1]::xid) THEN
        RAISE EXCEPTION 'feature % of layer % was not written by this transaction', coalesce(f.canonical, key), layer
            USING ERRCODE = '55000',
            HINT = 'record_edit records a change this transaction made: write the row first, then call it before COMMIT.';
    END IF;
    IF r[2] = recorded THEN
        RAISE EXCEPTION 'the current row of feature % of layer % has its event already', coalesce(f.canonical, key), layer
            USING ERRCODE = '55000', HINT = 'Write the row again before recording another event for it.';
    END IF;
    RETURN _edit(layer, f.number, CASE WHEN event_type IN ('created', 'moved') THEN r[3]::geometry END,
                 event_type, NULL, NULL, true, f.canonical);
END
$$;


-- The same forms for a layer keyed by uuid or text (0.3.0). A text key is converted to the id
-- column's type (22P02 when it does not fit), so text serves every layer, integer ones included.
CREATE FUNCTION edit_feature(layer text, feature_id text, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
CREATE FUNCTION edit_feature(layer text, feature_id text, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
CREATE FUNCTION edit_feature(layer text, feature_id uuid, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
CREATE FUNCTION edit_feature(layer text, feature_id uuid, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
CREATE FUNCTION record_edit(layer text, feature_id text, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
CREATE FUNCTION record_edit(layer text, feature_id uuid, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION edit_feature(text, text, text, text, jsonb) IS
    'edit_feature(layer, ...) for a layer keyed by uuid or text: the key as the application stores it (any id type, as text).';
COMMENT ON FUNCTION edit_feature(text, text, geometry, text, jsonb) IS
    'edit_feature(layer, ...) for a layer keyed by uuid or text: the key as the application stores it (any id type, as text).';
COMMENT ON FUNCTION edit_feature(text, uuid, text, text, jsonb) IS 'edit_feature(layer, ...) for a layer keyed by uuid.';
COMMENT ON FUNCTION edit_feature(text, uuid, geometry, text, jsonb) IS 'edit_feature(layer, ...) for a layer keyed by uuid.';
COMMENT ON FUNCTION record_edit(text, text, text) IS 'record_edit for a layer keyed by uuid or text (any id type, as text).';
COMMENT ON FUNCTION record_edit(text, uuid, text) IS 'record_edit for a layer keyed by uuid.';
REVOKE ALL ON FUNCTION edit_feature(text, text, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, text, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, uuid, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, uuid, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, uuid, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _edit_key(text, text, geometry, text, bytea, jsonb, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION _record_edit_key(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _feature_number(layer_registry, text) FROM PUBLIC;

-- backfill routes a row written since its last event on the geometry it holds now, and walks keys
-- of any type: its chunk takes the last key as text.
DROP FUNCTION _backfill_chunk(text, geometry, bigint, integer);
DROP FUNCTION __backfill_chunk(text, geometry, bigint, integer);
CREATE FUNCTION __backfill_chunk(p_layer text, p_area geometry, p_after text, p_limit integer) RETURNS text[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    lay layer_registry;
    v_res integer := current_setting('feature_outbox.h3_resolution')::integer;
    area geometry;
    candidates bigint[];   -- this chunk's live features (their numbers: the key, or feature_state's for uuid/text)
    ckeys text[];          -- their keys, in the id column's order
    keyed boolean;         -- the layer's key is uuid or text
    v_cast text;           -- the type the keys are cast to in the layer's statements
    versions integer[];    -- a user layer's: their versions, read under the row lock
    gds uuid[];            -- their geometry digests, and properties digests, as stored now
    pds uuid[];
    missing bigint[];      -- of those, the ones without per-feature state yet
    drifted bigint[];      -- the ones whose geometry differs from their last event's (or unknown)
    drifted_points float8[];  -- {lon, lat} of each one's current routing point, flattened
    locked bigint[];       -- the ones whose routing point lies in the area, state locked
    r text[];
    n bigint;
BEGIN
    IF NOT has_function_privilege(caller, 'feature_outbox.backfill(text, geometry, bigint)', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied for procedure backfill' USING ERRCODE = '42501',
            HINT = 'Snapshots reach every subscriber: GRANT EXECUTE ON PROCEDURE feature_outbox.backfill TO the role, as its owner.';
    END IF;
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = p_layer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(l.layer, ', ' ORDER BY l.layer) FROM layer_registry l));
    END IF;
    IF p_area IS NOT NULL THEN
        IF ST_SRID(p_area) = 0 THEN
            RAISE EXCEPTION 'area has no SRID' USING ERRCODE = '22023',
                HINT = 'Give it one, e.g. ST_SetSRID(area, 4326) for longitude/latitude degrees.';
        END IF;
        area := ST_Transform(p_area, 4326);
    END IF;
    -- As edits do: unregister_layer waits for this chunk, and this chunk for it.
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer));
    v_cast := _key_cast(lay.id_type);
    keyed := v_cast <> 'bigint';

    IF p_layer = 'features' THEN
        SELECT array_agg(c.id ORDER BY c.id), array_agg(c.id::text ORDER BY c.id) INTO candidates, ckeys
          FROM (SELECT f.id FROM features f WHERE (p_after IS NULL OR f.id > p_after::bigint) AND f.retired_at IS NULL
                 ORDER BY f.id LIMIT p_limit) c;
    ELSE
        -- A user layer's rows are read and locked as the caller, with its rights, before the state:
        -- the order its edits lock them in (the row, then the state), so the two never deadlock.
        SELECT array_agg(x[1] ORDER BY i), array_agg(x[2]::integer ORDER BY i),
               array_agg(x[3]::uuid ORDER BY i), array_agg(x[4]::uuid ORDER BY i)
          INTO ckeys, versions, gds, pds
          FROM _as_caller_rows(format('SELECT t.%1$I::text, t.%2$I::text, %5$s FROM %3$s t WHERE ($1[1] IS NULL OR t.%1$I > $1[1]::%6$s)%4$s ORDER BY t.%1$I LIMIT $1[2]::integer FOR SHARE OF t',
                                      lay.id_column, lay.version_column, lay.tbl,
                                      CASE WHEN lay.retired_column IS NOT NULL THEN format(' AND t.%I IS NULL', lay.retired_column) ELSE '' END,
                                      _row_digests_sql(lay.geometry_column, lay.properties::text[]), v_cast),
                               ARRAY[p_after, p_limit::text]) WITH ORDINALITY x(x, i);
        -- Each key's number: its own for integer keys, else the one its first event drew (a new one,
        -- recorded in feature_keys, for a row that has no event yet).
        IF keyed THEN
            INSERT INTO feature_keys (layer, feature_key, feature_id)
            SELECT p_layer, u.k, nextval('feature_key_seq') FROM unnest(ckeys) u(k)
             WHERE NOT EXISTS (SELECT 1 FROM feature_keys f WHERE f.layer = p_layer AND f.feature_key = u.k)
            ON CONFLICT (layer, feature_key) DO NOTHING;
        END IF;
        candidates := ARRAY(SELECT CASE WHEN NOT keyed THEN k::bigint
                                        ELSE (SELECT f.feature_id FROM feature_keys f WHERE f.layer = p_layer AND f.feature_key = k) END
                              FROM unnest(ckeys) WITH ORDINALITY u(k, i) ORDER BY i);
    END IF;
    IF ckeys IS NULL THEN
        RETURN ARRAY[NULL, '0'];
    END IF;

    -- Features without per-feature state (written before 0.2.0, or before the layer was registered):
    -- their state from the stored geometry, as their next edit would fill it. A stored geometry the
    -- edit path cannot route (NULL, empty) gets no state and no snapshot.
    missing := ARRAY(SELECT c FROM unnest(candidates) c
                      WHERE NOT EXISTS (SELECT 1 FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = c));
    IF cardinality(missing) > 0 THEN
        FOR r IN
            SELECT ARRAY[f.id::text, ST_AsHEXEWKB(f.geom)] FROM features f WHERE p_layer = 'features' AND f.id = ANY(missing)
        LOOP
            PERFORM __backfill_state(p_layer, r[1]::bigint, r[2]::geometry, v_res);
        END LOOP;
        IF p_layer <> 'features' THEN
            FOR r IN
                SELECT x FROM _as_caller_rows(format('SELECT t.%1$I::text, ST_AsHEXEWKB(ST_Transform(t.%2$I, 4326)) FROM %3$s t WHERE t.%1$I = ANY($1::%4$s[])',
                                                     lay.id_column, lay.geometry_column, lay.tbl, v_cast),
                                              ARRAY(SELECT ckeys[array_position(candidates, m)] FROM unnest(missing) m)) x
            LOOP
                PERFORM __backfill_state(p_layer, candidates[array_position(ckeys, r[1])], r[2]::geometry, v_res);
            END LOOP;
            IF keyed THEN
                UPDATE feature_state s SET feature_key = u.k
                  FROM unnest(candidates, ckeys) u(id, k)
                 WHERE s.layer = p_layer AND s.feature_id = u.id AND u.id = ANY(missing) AND s.feature_key IS NULL;
            END IF;
        END IF;
    END IF;

    -- Routing follows the geometry: a row written since its last event (outside the product, see
    -- drift()) is routed, and chosen for the area, on the geometry it holds now. Its state stays
    -- the last event's, so that resync() still sends the moved event its old cell needs.
    IF p_layer <> 'features' THEN
        drifted := ARRAY(SELECT u.id FROM unnest(candidates, gds) u(id, gd)
                           JOIN feature_state s ON s.layer = p_layer AND s.feature_id = u.id
                          WHERE s.geometry_digest IS DISTINCT FROM u.gd AND u.id <> ALL(missing) ORDER BY u.id);
        IF cardinality(drifted) > 0 THEN
            SELECT array_agg(candidates[array_position(ckeys, x[1])] ORDER BY candidates[array_position(ckeys, x[1])]),
                   array_agg(ARRAY[ST_X(q), ST_Y(q)] ORDER BY candidates[array_position(ckeys, x[1])])
              INTO drifted, drifted_points
              FROM _as_caller_rows(format('SELECT t.%1$I::text, ST_AsHEXEWKB(ST_Transform(t.%2$I, 4326)) FROM %3$s t WHERE t.%1$I = ANY($1::%4$s[])',
                                          lay.id_column, lay.geometry_column, lay.tbl, v_cast),
                                   ARRAY(SELECT ckeys[array_position(candidates, d)] FROM unnest(drifted) d)) x,
                   _routing_point(x[2]::geometry) q;
        END IF;
    END IF;

    -- The state of those in the area, locked. For the built-in table the state goes first and the
    -- feature row after it, the order edit_feature locks them in.
    locked := ARRAY(SELECT l.feature_id FROM (
                  SELECT s.feature_id FROM feature_state s
                    LEFT JOIN (SELECT d.id, drifted_points[d.i][1] AS lon, drifted_points[d.i][2] AS lat
                                 FROM unnest(drifted) WITH ORDINALITY d(id, i)) d ON d.id = s.feature_id
                   WHERE s.layer = p_layer AND s.feature_id = ANY(candidates)
                     AND (area IS NULL OR ST_Intersects(area, ST_SetSRID(ST_MakePoint(coalesce(d.lon, s.routing_point[1]),
                                                                                      coalesce(d.lat, s.routing_point[2])), 4326)))
                   ORDER BY s.feature_id
                     FOR SHARE OF s) l);
    IF p_layer = 'features' THEN
        SELECT array_agg(v.id ORDER BY v.id), array_agg(v.version ORDER BY v.id), array_agg(v.gd ORDER BY v.id),
               array_agg(md5('()')::uuid)
          INTO locked, versions, gds, pds
          FROM (SELECT f.id, f.version, md5(ST_AsEWKB(f.geom))::uuid AS gd FROM features f
                 WHERE f.id = ANY(locked) AND f.retired_at IS NULL ORDER BY f.id FOR SHARE OF f) v;
        candidates := locked;
        ckeys := locked::text[];
    END IF;

    INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer, geometry_digest, properties_digest,
                        feature_key)
    SELECT s.feature_id, u.version, 'snapshot',
           coalesce(_h3_cell(drifted_points[d.i][1], drifted_points[d.i][2], v_res), s.routing_key), p_layer, u.gd, u.pd,
           CASE WHEN keyed THEN u.k END
      FROM unnest(candidates, versions, gds, pds, ckeys) u(id, version, gd, pd, k)
      JOIN feature_state s ON s.layer = p_layer AND s.feature_id = u.id
      LEFT JOIN unnest(drifted) WITH ORDINALITY d(id, i) ON d.id = u.id
     WHERE u.id = ANY(locked)
     ORDER BY u.id;
    GET DIAGNOSTICS n = ROW_COUNT;
    -- A feature whose state this chunk started now has an event: the snapshot, with its digests.
    UPDATE feature_state s SET geometry_digest = u.gd, properties_digest = u.pd, version = u.version, last_event = 'snapshot'
      FROM unnest(candidates, versions, gds, pds) u(id, version, gd, pd)
     WHERE s.layer = p_layer AND s.feature_id = u.id AND u.id = ANY(missing) AND u.id = ANY(locked);
    IF n > 0 THEN
        PERFORM _wake_relay_at_commit();
    END IF;
    RETURN ARRAY[ckeys[cardinality(ckeys)], n::text];
END
$$;


CREATE FUNCTION _backfill_chunk(layer text, area geometry, after text, chunk integer) RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _backfill_chunk(text, geometry, text, integer) IS
    'One chunk of backfill(); callable only by roles that may execute backfill.';

CREATE OR REPLACE PROCEDURE backfill(layer text, area geometry DEFAULT NULL, INOUT written bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    after text;            -- the last key of the chunk before, in the id column's order
    r text[];
    -- The trace context in effect at CALL. Each COMMIT below ends a SET LOCAL, so every chunk's
    -- transaction sets it again, and each snapshot row records it (the outbox columns' defaults).
    tp text := coalesce(pg_catalog.current_setting('feature_outbox.traceparent', true), '');
    ts text := coalesce(pg_catalog.current_setting('feature_outbox.tracestate', true), '');
BEGIN
    written := 0;
    LOOP
        PERFORM pg_catalog.set_config('feature_outbox.traceparent', tp, true),
                pg_catalog.set_config('feature_outbox.tracestate', ts, true);
        r := feature_outbox._backfill_chunk(layer, area, after, 500);
        EXIT WHEN r[1] IS NULL;
        written := written + r[2]::bigint;
        after := r[1];
        COMMIT;
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION __backfill_chunk(text, geometry, text, integer) FROM PUBLIC;

-- drift() and resync() (sql/drift.sql).
-- What differs between a row and its feature's state. has_state: the feature has a state row;
-- last_event: its last event's type (NULL: written before 0.3.0); gd/pd: the row's digests now;
-- live: the row exists and is not retired (NULL: it does not exist). NULL when nothing differs.
CREATE FUNCTION __drift_change(has_state boolean, last_event text, state_gd uuid, state_pd uuid,
                               gd uuid, pd uuid, live boolean) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN NOT has_state THEN CASE WHEN live THEN 'no_event' END
        WHEN NOT coalesce(live, false) THEN CASE WHEN last_event <> 'retired' THEN 'gone' END
        WHEN last_event IS NULL THEN 'unknown'
        WHEN last_event = 'retired' THEN NULL
        WHEN state_gd IS DISTINCT FROM gd AND state_pd IS DISTINCT FROM pd THEN 'both'
        WHEN state_gd IS DISTINCT FROM gd THEN 'geometry'
        WHEN state_pd IS DISTINCT FROM pd THEN 'properties'
    END
$$;

-- One chunk of drift's two passes, in bounded memory. Phase 1 reads p_limit of the layer's rows
-- after key p_after, in the id column's order (as the caller, with its rights), and compares each
-- with its feature's state. Phase 2 reads p_limit state rows after number p_after and finds those
-- whose row is gone. next_phase and next_after: where the next chunk starts (next_phase NULL:
-- done). Returns each row that differs: its key, its number (NULL for a row without events) and
-- the change.
CREATE FUNCTION __drift_rows(lay layer_registry, p_phase integer, p_after text, p_limit integer,
                             OUT next_phase integer, OUT next_after text,
                             OUT keys text[], OUT numbers bigint[], OUT changes text[])
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_cast text := _key_cast(lay.id_type);
    keyed boolean := v_cast <> 'bigint';
    rk text[];            -- phase 1: the rows' keys, digests and liveness, in the table's order
    rgd uuid[];
    rpd uuid[];
    rlive boolean[];
    sn bigint[];          -- phase 2: state rows' numbers and keys
    sk text[];
BEGIN
    IF p_phase = 1 THEN
        IF lay.layer = 'features' THEN
            SELECT array_agg(f.id::text ORDER BY f.id), array_agg(f.gd ORDER BY f.id), array_agg(f.pd ORDER BY f.id),
                   array_agg(f.live ORDER BY f.id)
              INTO rk, rgd, rpd, rlive
              FROM (SELECT f.id, md5(ST_AsEWKB(f.geom))::uuid AS gd, md5('()')::uuid AS pd, f.retired_at IS NULL AS live
                      FROM features f WHERE p_after IS NULL OR f.id > p_after::bigint ORDER BY f.id LIMIT p_limit) f;
        ELSE
            SELECT array_agg(x[1] ORDER BY i), array_agg(x[2]::uuid ORDER BY i), array_agg(x[3]::uuid ORDER BY i),
                   array_agg(x[4]::boolean ORDER BY i)
              INTO rk, rgd, rpd, rlive
              FROM _as_caller_rows(format('SELECT t.%1$I::text, %2$s, (%3$s)::text FROM %4$s t WHERE ($1[1] IS NULL OR t.%1$I > $1[1]::%5$s) ORDER BY t.%1$I LIMIT $1[2]::integer',
                                          lay.id_column, _row_digests_sql(lay.geometry_column, lay.properties::text[]),
                                          CASE WHEN lay.retired_column IS NULL THEN 'true'
                                               ELSE format('t.%I IS NULL', lay.retired_column) END,
                                          lay.tbl, v_cast),
                                   ARRAY[p_after, p_limit::text]) WITH ORDINALITY x(x, i);
        END IF;
        IF coalesce(cardinality(rk), 0) >= p_limit THEN
            next_phase := 1;
            next_after := rk[cardinality(rk)];
        ELSE
            next_phase := 2;
        END IF;
        SELECT array_agg(c.k ORDER BY c.i), array_agg(c.number ORDER BY c.i), array_agg(c.change ORDER BY c.i)
          INTO keys, numbers, changes
          FROM (SELECT u.k, u.i, s.feature_id AS number,
                       __drift_change(s.feature_id IS NOT NULL, s.last_event, s.geometry_digest, s.properties_digest,
                                      u.gd, u.pd, u.live) AS change
                  FROM unnest(rk, rgd, rpd, rlive) WITH ORDINALITY u(k, gd, pd, live, i)
                  LEFT JOIN feature_state s ON s.layer = lay.layer
                        AND s.feature_id = CASE WHEN keyed THEN (SELECT f.feature_id FROM feature_keys f
                                                                  WHERE f.layer = lay.layer AND f.feature_key = u.k)
                                                ELSE u.k::bigint END) c
         WHERE c.change IS NOT NULL;
        RETURN;
    END IF;
    -- Phase 2: features whose last event says they exist, and whose row does not.
    SELECT array_agg(s.feature_id ORDER BY s.feature_id), array_agg(coalesce(s.feature_key, s.feature_id::text) ORDER BY s.feature_id)
      INTO sn, sk
      FROM (SELECT s.feature_id, s.feature_key FROM feature_state s
             WHERE s.layer = lay.layer AND s.feature_id > coalesce(p_after::bigint, -9223372036854775808)
               AND s.last_event IS NOT NULL AND s.last_event <> 'retired'
             ORDER BY s.feature_id LIMIT p_limit) s;
    IF coalesce(cardinality(sn), 0) >= p_limit THEN
        next_phase := 2;
        next_after := sn[cardinality(sn)]::text;
    END IF;
    IF sn IS NULL THEN
        RETURN;
    END IF;
    IF lay.layer = 'features' THEN
        SELECT array_agg(u.k ORDER BY u.n), array_agg(u.n ORDER BY u.n), array_agg('gone'::text) INTO keys, numbers, changes
          FROM unnest(sn, sk) u(n, k) WHERE NOT EXISTS (SELECT 1 FROM features f WHERE f.id = u.n);
    ELSE
        SELECT array_agg(u.k ORDER BY u.n), array_agg(u.n ORDER BY u.n), array_agg('gone'::text) INTO keys, numbers, changes
          FROM unnest(sn, sk) u(n, k)
         WHERE u.k NOT IN (SELECT x[1] FROM _as_caller_rows(format('SELECT t.%1$I::text FROM %2$s t WHERE t.%1$I = ANY($1::%3$s[])',
                                                                    lay.id_column, lay.tbl, v_cast), sk) x);
    END IF;
END
$$;

-- The layer for drift() and resync(), checked as their chunks run: registered, and the caller may
-- execute `what`.
CREATE FUNCTION __drift_layer(p_layer text, what text) RETURNS layer_registry
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    lay layer_registry;
BEGIN
    IF NOT has_function_privilege(_caller_role(), what, 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied for %', what USING ERRCODE = '42501',
            HINT = format('GRANT EXECUTE ON %s TO the role, as the extension''s owner.', what);
    END IF;
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = p_layer;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(l.layer, ', ' ORDER BY l.layer) FROM layer_registry l));
    END IF;
    RETURN lay;
END
$$;

-- The body of one drift() chunk, run as the extension's owner by the C entry _drift_chunk.
-- p_found: rows found by the chunks before; the last chunk records the total in layer_registry.
-- Returns {next phase (NULL: done), next position, then key, change, key, change, ...}.
CREATE FUNCTION __drift_chunk(p_layer text, p_phase integer, p_after text, p_limit integer, p_found bigint) RETURNS text[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry := __drift_layer(p_layer, 'feature_outbox.drift(text)');
    d record;
BEGIN
    d := __drift_rows(lay, p_phase, p_after, p_limit);
    IF d.next_phase IS NULL THEN
        UPDATE layer_registry l SET drift_rows = p_found + coalesce(cardinality(d.keys), 0), drift_checked_at = now()
         WHERE l.layer = p_layer;
    END IF;
    RETURN ARRAY[d.next_phase::text, d.next_after]
           || coalesce((SELECT array_agg(v ORDER BY i, k) FROM unnest(d.keys, d.changes) WITH ORDINALITY u(key, change, i),
                               LATERAL (VALUES (1, u.key), (2, u.change)) p(k, v)), '{}');
END
$$;

CREATE FUNCTION _drift_chunk(layer text, phase integer, after text, chunk integer, found bigint) RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _drift_chunk(text, integer, text, integer, bigint) IS
    'One chunk of drift(); callable only by roles that may execute drift.';

CREATE FUNCTION drift(layer text) RETURNS TABLE (feature_id text, change text)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    phase integer := 1;
    after text;
    found bigint := 0;
    r text[];
BEGIN
    LOOP
        r := feature_outbox._drift_chunk(layer, phase, after, 1000, found);
        FOR i IN 1 .. (cardinality(r) - 2) / 2 LOOP
            feature_id := r[2 * i + 1];
            change := r[2 * i + 2];
            found := found + 1;
            RETURN NEXT;
        END LOOP;
        EXIT WHEN r[1] IS NULL;
        phase := r[1]::integer;
        after := r[2];
    END LOOP;
END
$$;
COMMENT ON FUNCTION drift(text) IS
    'The rows of a layer that differ from their last event, read as the caller in one pass over the table and one over '
    'its features'' state (1,000 rows a chunk); feature_id is the key as text. change is geometry, properties or both (digests differ), no_event (a live row without one), gone (deleted or '
    'retired without a retired event) or unknown (last event written before 0.3.0). Records the count in '
    'backlog_by_layer.drifted_rows. EXECUTE is not granted to PUBLIC.';

-- The body of one resync() chunk, run as the extension's owner by the C entry _resync_chunk. Takes
-- drift's chunk at (p_phase, p_after); locks its drifted rows (SKIP LOCKED: a row an edit holds is
-- left for a later run), and writes each one's missing event until p_hold_ms / 2 have passed since
-- the locks were taken, so that no editor waits longer than about p_hold_ms. p_left: rows left by
-- the chunks before. Returns {next phase (NULL: done), next position, events written, rows left}.
CREATE FUNCTION __resync_chunk(p_layer text, p_phase integer, p_after text, p_limit integer, p_hold_ms integer,
                               p_left bigint) RETURNS text[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry := __drift_layer(p_layer, 'feature_outbox.resync(text, integer, bigint, bigint)');
    v_cast text := _key_cast(lay.id_type);
    keyed boolean := v_cast <> 'bigint';
    d record;
    v_res integer := current_setting('feature_outbox.h3_resolution')::integer;
    lkey text[];          -- the locked rows: keys, geometries (HEXEWKB), digests, liveness, versions
    lgeom text[];
    lgd uuid[];
    lpd uuid[];
    llive boolean[];
    lver integer[];
    present text[];       -- drifted rows that exist but could not be locked
    s feature_state;
    k integer;            -- the row's position in lkey
    j integer;            -- its position in the drift chunk
    change text;
    key text;
    locked_at timestamptz;
    written bigint := 0;
    left_over bigint := 0;
    next_phase integer;
    next_after text;
BEGIN
    IF p_layer = 'features' THEN
        RAISE EXCEPTION 'resync serves user layers' USING ERRCODE = '0A000',
            HINT = 'Only a superuser can write feature_outbox.features outside edit_feature: repair a row with edit_feature(id, geometry, ''moved'').';
    END IF;
    IF p_hold_ms IS NULL OR p_hold_ms < 1 THEN
        RAISE EXCEPTION 'max_hold_ms must be at least 1, not %', coalesce(p_hold_ms::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer));
    d := __drift_rows(lay, p_phase, p_after, p_limit);
    next_phase := d.next_phase;
    next_after := d.next_after;
    IF cardinality(d.keys) > 0 THEN
        locked_at := clock_timestamp();
        -- The rows, locked as edits lock them (the row, then its state), read again under the lock:
        -- an edit that committed since the scan may have sent the event already.
        SELECT coalesce(array_agg(x[1]), '{}'), array_agg(x[2]), array_agg(x[3]::uuid), array_agg(x[4]::uuid),
               array_agg(x[5]::boolean), array_agg(x[6]::integer)
          INTO lkey, lgeom, lgd, lpd, llive, lver
          FROM _as_caller_rows(
                   format('SELECT t.%1$I::text, ST_AsHEXEWKB(t.%2$I), %3$s, (%4$s)::text, t.%6$I::text FROM %5$s t WHERE t.%1$I = ANY($1::%7$s[]) ORDER BY t.%1$I FOR UPDATE OF t SKIP LOCKED',
                          lay.id_column, lay.geometry_column, _row_digests_sql(lay.geometry_column, lay.properties::text[]),
                          CASE WHEN lay.retired_column IS NULL THEN 'true' ELSE format('t.%I IS NULL', lay.retired_column) END,
                          lay.tbl, lay.version_column, v_cast), d.keys) x;
        present := ARRAY(SELECT x[1] FROM _as_caller_rows(format('SELECT t.%1$I::text FROM %2$s t WHERE t.%1$I = ANY($1::%3$s[])',
                                                                 lay.id_column, lay.tbl, v_cast),
                                                          ARRAY(SELECT i FROM unnest(d.keys) i WHERE i <> ALL(lkey))) x);
        FOR j IN 1 .. cardinality(d.keys) LOOP
            key := d.keys[j];
            IF clock_timestamp() - locked_at > make_interval(secs => p_hold_ms / 2000.0) THEN
                -- The rest in the next chunk, after this one commits: from the row before this one.
                next_phase := p_phase;
                next_after := CASE WHEN j = 1 THEN p_after
                                   WHEN p_phase = 1 THEN d.keys[j - 1] ELSE d.numbers[j - 1]::text END;
                EXIT;
            END IF;
            IF key = ANY(present) THEN  -- an edit holds it: that edit's event, or a later run, covers it
                left_over := left_over + 1;
                CONTINUE;
            END IF;
            k := array_position(lkey, key);
            s := NULL;
            SELECT * INTO s FROM feature_state f
             WHERE f.layer = p_layer AND f.feature_id = coalesce(d.numbers[j], CASE WHEN NOT keyed THEN key::bigint END)
               FOR UPDATE;
            change := __drift_change(s.layer IS NOT NULL, s.last_event, s.geometry_digest, s.properties_digest,
                                     lgd[k], lpd[k], llive[k]);
            CONTINUE WHEN change IS NULL;
            BEGIN
                IF change = 'unknown' THEN
                    -- Last event before 0.3.0: no digests to compare. The geometry is the one it
                    -- routed on when its bounding box still matches; take the digests then, else move.
                    IF (SELECT bool_and(abs(q.b - s.bbox[q.j]) < 1e-7)
                          FROM unnest((_inspect_geometry(ST_AsBinary(ST_Transform(lgeom[k]::geometry, 4326)), true, 4326, NULL))[3:6])
                               WITH ORDINALITY q(b, j)) THEN
                        UPDATE feature_state f SET geometry_digest = lgd[k], properties_digest = lpd[k],
                                                   version = lver[k], last_event = 'baseline'
                         WHERE f.layer = p_layer AND f.feature_id = s.feature_id;
                        CONTINUE;
                    END IF;
                    change := 'geometry';
                END IF;
                CASE change
                    WHEN 'no_event' THEN PERFORM _edit_key(p_layer, key, lgeom[k]::geometry, 'created', NULL, NULL, true);
                    WHEN 'geometry', 'both' THEN PERFORM _edit_key(p_layer, key, lgeom[k]::geometry, 'moved', NULL, NULL, true);
                    WHEN 'properties' THEN PERFORM _edit_key(p_layer, key, NULL, 'updated', NULL, NULL, true);
                    ELSE  -- gone
                        IF k IS NOT NULL THEN  -- retired by hand: the event, as record_edit writes it
                            PERFORM _edit_key(p_layer, key, NULL, 'retired', NULL, NULL, true);
                        ELSE                   -- deleted: nothing to write but the event
                            UPDATE feature_state f
                               SET previous_routing_key = f.routing_key, previous_h3_resolution = f.h3_resolution,
                                   previous_routing_point = f.routing_point, previous_bbox = f.bbox,
                                   version = f.version + 1, last_event = 'retired', row_version = NULL,
                                   geometry_digest = NULL, properties_digest = NULL
                             WHERE f.layer = p_layer AND f.feature_id = s.feature_id;
                            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key,
                                                layer, previous_bbox, feature_key)
                            VALUES (s.feature_id, s.version + 1, 'retired', s.routing_key,
                                    CASE WHEN s.h3_resolution = v_res THEN s.routing_key
                                         ELSE _h3_cell(s.routing_point[1], s.routing_point[2], v_res) END,
                                    p_layer, s.bbox, s.feature_key);
                            PERFORM _wake_relay_for(s.feature_id);
                        END IF;
                END CASE;
                written := written + 1;
            EXCEPTION WHEN OTHERS THEN
                IF SQLSTATE IN ('57014', '57P01', '40P01') THEN  -- cancel, shutdown, deadlock: stop
                    RAISE;
                END IF;
                RAISE WARNING 'resync of feature % of layer % failed: %', key, p_layer, SQLERRM
                    USING HINT = 'Repair the row, then CALL feature_outbox.resync again.';
                left_over := left_over + 1;
            END;
        END LOOP;
    END IF;
    IF next_phase IS NULL THEN
        UPDATE layer_registry l SET drift_rows = p_left + left_over, drift_checked_at = now() WHERE l.layer = p_layer;
    END IF;
    RETURN ARRAY[next_phase::text, next_after, written::text, left_over::text];
END
$$;

CREATE FUNCTION _resync_chunk(layer text, phase integer, after text, chunk integer, max_hold_ms integer, left_over bigint)
RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _resync_chunk(text, integer, text, integer, integer, bigint) IS
    'One chunk of resync(); callable only by roles that may execute resync.';

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT. Every name in it is
-- schema-qualified or a built-in.
CREATE PROCEDURE resync(layer text, max_hold_ms integer DEFAULT 100, INOUT written bigint DEFAULT NULL,
                        INOUT left_over bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    phase integer := 1;
    after text;
    r text[];
BEGIN
    written := 0;
    left_over := 0;
    LOOP
        r := feature_outbox._resync_chunk(layer, phase, after, 200, max_hold_ms, left_over);
        written := written + r[3]::bigint;
        left_over := left_over + r[4]::bigint;
        COMMIT;
        EXIT WHEN r[1] IS NULL;
        phase := r[1]::integer;
        after := r[2];
    END LOOP;
END
$$;
COMMENT ON PROCEDURE resync(text, integer, bigint, bigint) IS
    'Writes the missing event of every row drift() lists (created for no_event, moved for geometry or both, updated for '
    'properties, retired for gone), with correct previous routing keys, committing in chunks that hold an edit back at '
    'most about max_hold_ms milliseconds. Returns the events written, and left_over: rows an edit held or that were '
    'refused (each with a WARNING). CALL it outside a transaction block. EXECUTE is not granted to PUBLIC.';

REVOKE ALL ON FUNCTION drift(text) FROM PUBLIC;
REVOKE ALL ON PROCEDURE resync(text, integer, bigint, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_rows(layer_registry, integer, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_layer(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_chunk(text, integer, text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION __resync_chunk(text, integer, text, integer, integer, bigint) FROM PUBLIC;

-- unregister_layer also forgets the layer's key numbers.
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


-- Held layers: the relay holds a layer whose table or registered columns are gone (sql/layers.sql).
CREATE FUNCTION release_layer(layer text, tbl regclass DEFAULT NULL) RETURNS bigint
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';

-- A held layer (the relay found its table or a registered column gone) goes back to the relay once
-- its table matches the registration again: the same table with the column renamed or added back,
-- or `tbl`, a table restored or created in its place, whose registered columns have the types
-- recorded at registration. Its rows then publish, with the content that table holds (none for a
-- feature it no longer has, as for a deleted row).
CREATE FUNCTION _release_layer(layer text, tbl regclass) RETURNS bigint
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

REVOKE ALL ON FUNCTION release_layer(text, regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION _release_layer(text, regclass) FROM PUBLIC;

-- Privileges: registering layers and metrics() are no longer PUBLIC's ----------------------------

REVOKE ALL ON FUNCTION register_layer(text, regclass, name, name, name, name[], name) FROM PUBLIC;
REVOKE ALL ON FUNCTION unregister_layer(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION metrics() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION metrics() TO pg_monitor;

-- The DDL guard (sql/ddl_guard.sql) ----------------------------------------------------------------

CREATE  FUNCTION "_ddl_guard_on"() RETURNS bool /* bool */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_ddl_guard_on_wrapper';

CREATE FUNCTION _guard_layer_drops() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    hit record;
BEGIN
    IF NOT _ddl_guard_on() THEN
        RETURN;
    END IF;
    SELECT r.layer, d.object_type, d.address_names, c.role INTO hit
      FROM pg_event_trigger_dropped_objects() d
      JOIN layer_registry r ON r.tbl::oid = d.objid AND r.layer <> 'features'
      LEFT JOIN LATERAL _layer_columns(r) c ON d.objsubid > 0 AND c.col = d.address_names[3]
     WHERE d.classid = 'pg_class'::regclass AND (d.objsubid = 0 AND d.object_type = 'table' OR c.col IS NOT NULL)
     ORDER BY d.objsubid
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF hit.role IS NULL THEN
        RAISE EXCEPTION 'cannot drop table %.%: it is the table of layer %', quote_ident(hit.address_names[1]),
            quote_ident(hit.address_names[2]), hit.layer USING ERRCODE = '2BP01',
            DETAIL = 'Its unpublished outbox rows are read from it, and edits of the layer write to it.',
            HINT = format('Let the relay publish its rows (feature_outbox.backlog_by_layer), then SELECT '
                          'feature_outbox.unregister_layer(%L) before dropping it. For pg_restore --clean or a repair, '
                          'a superuser may SET feature_outbox.ddl_guard = off for the session.', hit.layer);
    END IF;
    RAISE EXCEPTION 'cannot drop column % of %.%: it is the % column of layer %', quote_ident(hit.address_names[3]),
        quote_ident(hit.address_names[1]), quote_ident(hit.address_names[2]), hit.role, hit.layer USING ERRCODE = '2BP01',
        DETAIL = 'Edits would commit and then fail in the relay, which reads the column for every event.',
        HINT = format('Unregister the layer and register it again without the column (SELECT feature_outbox.unregister_layer(%L) '
                      'once its rows are published). A superuser may SET feature_outbox.ddl_guard = off for the session.', hit.layer);
END
$$;

CREATE FUNCTION _guard_layer_columns() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    r layer_registry;
    now_types text[];
    bad record;
BEGIN
    IF NOT _ddl_guard_on() THEN
        RETURN;
    END IF;
    FOR r IN SELECT DISTINCT ON (l.layer) l.* FROM pg_event_trigger_ddl_commands() c
               JOIN layer_registry l ON l.tbl::oid = c.objid AND l.layer <> 'features' AND l.column_types IS NOT NULL
              WHERE c.classid = 'pg_class'::regclass
    LOOP
        now_types := _layer_column_types(r);
        IF now_types IS DISTINCT FROM r.column_types THEN
            SELECT c.col, c.role, r.column_types[c.ord] AS was, now_types[c.ord] AS is INTO bad
              FROM _layer_columns(r) c WHERE r.column_types[c.ord] IS DISTINCT FROM now_types[c.ord] ORDER BY c.ord LIMIT 1;
            RAISE EXCEPTION '%', CASE WHEN bad.is = 'missing'
                    THEN format('cannot rename column %I of %s: it is the %s column of layer %s', bad.col, r.tbl, bad.role, r.layer)
                    ELSE format('cannot change the type of column %I of %s from %s to %s: it is the %s column of layer %s',
                                bad.col, r.tbl, bad.was, bad.is, bad.role, r.layer) END
                USING ERRCODE = '2BP01',
                DETAIL = 'The layer was registered with these columns; edits and the relay read them by name and type.',
                HINT = format('Unregister the layer (SELECT feature_outbox.unregister_layer(%L) once its rows are published), '
                              'change the table, and register it again. A superuser may SET feature_outbox.ddl_guard = off '
                              'for the session.', r.layer);
        END IF;
    END LOOP;
END
$$;

CREATE EVENT TRIGGER feature_outbox_guard_drops ON sql_drop
    EXECUTE FUNCTION _guard_layer_drops();
CREATE EVENT TRIGGER feature_outbox_guard_columns ON ddl_command_end WHEN TAG IN ('ALTER TABLE')
    EXECUTE FUNCTION _guard_layer_columns();

-- Many databases: the cluster-wide view of the relay ------------------------------------------
CREATE  FUNCTION "_relay_databases"() RETURNS TABLE (
	"database" TEXT,  /* alloc::string::String */
	"state" TEXT,  /* alloc::string::String */
	"relay_workers" INT,  /* i32 */
	"workers_running" INT,  /* i32 */
	"worker_states" TEXT[],  /* alloc::vec::Vec<alloc::string::String> */
	"unpublished" bigint,  /* core::option::Option<i64> */
	"unpublished_at" timestamp with time zone,  /* core::option::Option<pgrx::datum::time_stamp_with_timezone::TimestampWithTimeZone> */
	"last_error" TEXT,  /* core::option::Option<alloc::string::String> */
	"last_error_at" timestamp with time zone  /* core::option::Option<pgrx::datum::time_stamp_with_timezone::TimestampWithTimeZone> */
)
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_relay_databases_wrapper';

-- Every database the relay serves on this server, from shared memory (issue: many databases). Like
-- the workers view it is for monitoring roles only.
CREATE VIEW relay_databases AS
SELECT database, state, relay_workers, workers_running, worker_states, unpublished, unpublished_at,
       last_error, last_error_at
  FROM _relay_databases();
COMMENT ON VIEW relay_databases IS 'Each database the relay serves on this server: its workers, state, last error and unpublished rows.';
REVOKE ALL ON FUNCTION _relay_databases() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION _relay_databases() TO pg_monitor;
GRANT SELECT ON relay_databases TO pg_monitor;

-- As sql/finalize.sql does at CREATE EXTENSION: pin search_path on every SQL and plpgsql function,
-- including those this script adds.
DO $pin$
DECLARE
    postgis_schema text := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                             WHERE e.extname = 'postgis');
    fn regprocedure;
BEGIN
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc p
               WHERE p.pronamespace = 'feature_outbox'::regnamespace AND p.prokind = 'f'
                 AND p.prolang IN (SELECT oid FROM pg_language WHERE lanname IN ('sql', 'plpgsql'))
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, feature_outbox, pg_temp', fn, postgis_schema);
    END LOOP;
END
$pin$;

-- Relay workers wait while the schema is older than their library; they resume when this commits.
SELECT _wake_relay_at_commit();
