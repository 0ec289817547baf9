-- feature_outbox 0.1.0 -> 0.2.0, run by ALTER EXTENSION feature_outbox UPDATE.
--
-- 0.2.0 is the open release: every change to the SQL surface made for it goes here, in the same
-- commit as the change to sql/*.sql or src/. pg_test/test_upgrade.py compares a database upgraded
-- by this script with a fresh CREATE EXTENSION and prints every difference.
-- Rules (README, "Upgrading"):
--   - the outbox holds the only copy of undelivered events: never drop or rewrite it;
--   - fill per-feature data lazily or in bounded steps, never with one long lock on a large table;
--   - new columns go at the end of their table, in sql/schema.sql too, so both orders agree;
--   - keep the two blocks below last.

\echo Use "ALTER EXTENSION feature_outbox UPDATE" to load this file. \quit

-- Preload state, hints, parked age, VACUUM horizon, monitoring grants -------------------------

-- CREATE EXTENSION's NOTICE and the backlog take the preload state from the library itself.
CREATE FUNCTION "_relay_preloaded"() RETURNS bool /* bool */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_relay_preloaded_wrapper';

-- The edit path, rebuilt (one pass through the geometry; per-feature state; poles; area of use) ----

-- Each feature's current state, kept by the edit path so that the next edit reads its previous
-- routing key instead of recomputing it, and the state before the last edit. Keyed by layer
-- ('features' is the built-in table), so the user's own tables, which cannot take extra columns,
-- use it unchanged. An edit updates its row first: the row lock orders the edits of one feature,
-- and SET previous_* = the old values hands the old state back through RETURNING.
CREATE TABLE feature_state (
    layer                   text     NOT NULL,
    feature_id              bigint   NOT NULL,
    routing_key             text     NOT NULL,  -- H3 cell of the current geometry's routing point
    h3_resolution           smallint NOT NULL,  -- the resolution routing_key was computed at
    routing_point           float8[] NOT NULL,  -- {longitude, latitude} in EPSG:4326 degrees
    -- Bounding box of the current geometry: {west, south, east, north} in EPSG:4326 degrees, as
    -- RFC 7946 §5.2 (west > east for a feature across the antimeridian).
    bbox                    float8[] NOT NULL,
    -- The same four before the last edit; NULL until the second edit.
    previous_routing_key    text,
    previous_h3_resolution  smallint,
    previous_routing_point  float8[],
    previous_bbox           float8[],
    -- The user-table row version (tableoid:ctid:xmin) the last event was recorded for, so that
    -- record_edit refuses a second event for an unchanged row. NULL for the built-in layer.
    row_version             text,
    PRIMARY KEY (layer, feature_id)
);
COMMENT ON TABLE feature_state IS 'Per-feature routing state written by edit_feature: routing key, its H3 resolution, routing point and bounding box, now and before the last edit.';
SELECT pg_catalog.pg_extension_config_dump('feature_state', '');
REVOKE ALL ON TABLE feature_state FROM PUBLIC;

-- The one pass, the polar cap and the H3 cell replace the 0.1.0 helpers. Their symbols stay in the
-- library for 0.1.0's script.
CREATE  FUNCTION "_inspect_geometry"(
	"wkb" bytea, /* & [u8] */
	"lonlat" bool, /* bool */
	"source_srid" INT, /* i32 */
	"crs" TEXT /* Option < & str > */
) RETURNS double precision[] /* Vec < f64 > */
STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_inspect_geometry_wrapper';
CREATE  FUNCTION "_close_polar_caps"(
	"wkb" bytea /* & [u8] */
) RETURNS bytea /* Vec < u8 > */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_close_polar_caps_wrapper';
CREATE  FUNCTION "_h3_cell"(
	"lon" double precision, /* f64 */
	"lat" double precision, /* f64 */
	"resolution" INT /* i32 */
) RETURNS TEXT /* String */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_h3_cell_wrapper';

DROP FUNCTION _edit(bigint, geometry, text);
DROP FUNCTION _prepare_geometry(geometry);

CREATE OR REPLACE FUNCTION _routing_point(g geometry) RETURNS geometry
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    shape geometry := CASE WHEN (ST_IsValidDetail(g)).valid THEN g ELSE ST_MakeValid(g) END;
    p geometry;
BEGIN
    IF (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[1] = 0 THEN
        RETURN ST_PointOnSurface(shape);
    END IF;
    p := ST_PointOnSurface(ST_ShiftLongitude(shape));
    RETURN CASE WHEN ST_X(p) > 180 THEN ST_Translate(p, -360, 0) ELSE p END;
END
$$;

CREATE OR REPLACE FUNCTION routing_key(g geometry) RETURNS text
LANGUAGE plpgsql STABLE STRICT PARALLEL SAFE
AS $$
DECLARE
    p geometry := _routing_point(g);
BEGIN
    RETURN _h3_cell(ST_X(p), ST_Y(p), current_setting('feature_outbox.h3_resolution')::integer);
END
$$;
COMMENT ON FUNCTION routing_key(geometry) IS
    'H3 cell (lowercase hex) of the routing point of an EPSG:4326 geometry, at feature_outbox.h3_resolution: '
    'ST_PointOnSurface of its shape in 4326 (of a made-valid copy when invalid; across the antimeridian, of the '
    'longitude-shifted shape). edit_feature routes every edit this way, except a polygon that encloses a pole in '
    'its source CRS, which it routes on its point on surface in that CRS.';

CREATE FUNCTION _check_types(g geometry) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    curved text;
    unsupported text;
BEGIN
    SELECT string_agg(DISTINCT t.kind, ', ') FILTER (WHERE t.kind IN ('CIRCULARSTRING', 'COMPOUNDCURVE',
                          'CURVEPOLYGON', 'MULTICURVE', 'MULTISURFACE')),
           string_agg(DISTINCT t.kind, ', ') FILTER (WHERE t.kind IN ('TRIANGLE', 'TIN', 'POLYHEDRALSURFACE'))
      INTO curved, unsupported
      FROM _member_types(g) t;
    IF curved IS NOT NULL OR ST_HasArc(g) THEN
        RAISE EXCEPTION 'curved geometry type % is not supported', coalesce(curved, GeometryType(g)) USING ERRCODE = '22023',
            HINT = 'Linearize it first with ST_CurveToLine(geom).';
    ELSIF unsupported IS NOT NULL THEN
        RAISE EXCEPTION 'geometry type % is not supported', unsupported USING ERRCODE = '22023',
            HINT = 'Use Point, LineString, Polygon, their Multi forms or a GeometryCollection of them.';
    END IF;
END
$$;

-- The user-table write (with the caller's rights), reads as the caller, and record_edit's check
-- (src/edit/layers.rs).
CREATE  FUNCTION "_layer_write"(
	"layer" TEXT, /* & str */
	"op" TEXT, /* & str */
	"tbl" oid, /* pg_sys :: Oid */
	"id_column" TEXT, /* & str */
	"geometry_column" TEXT, /* & str */
	"version_column" TEXT, /* & str */
	"retired_column" TEXT, /* Option < & str > */
	"feature_id" bigint, /* i64 */
	"geometry" anyelement, /* Option < AnyElement > */
	"properties" TEXT, /* Option < & str > */
	"keys" TEXT[] /* :: std :: option :: Option < Vec < String > > */
) RETURNS TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
VOLATILE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_layer_write_wrapper';

CREATE  FUNCTION "_written_by_this_transaction"(
	"xmin" xid /* pg_sys :: TransactionId */
) RETURNS bool /* bool */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_written_by_this_transaction_wrapper';

CREATE  FUNCTION "_as_caller_row"(
	"sql" TEXT, /* & str */
	"feature_id" bigint /* i64 */
) RETURNS TEXT[] /* :: std :: option :: Option < Vec < Option < String > > > */
STRICT VOLATILE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_as_caller_row_wrapper';

-- The write path behind every edit_feature form and record_edit. p_layer: a registered layer
-- ('features' is the built-in table). p_wkb: the geometry's (E)WKB when the caller has it already
-- (the GeoJSON form), else NULL. p_properties: registered columns to set. p_record: record_edit,
-- whose caller wrote the row itself (p_geom is then the stored geometry, NULL for updated and
-- retired). Every failure is a class-22 (or 23505/42704/P0002/55000) error raised before anything
-- is written.
CREATE FUNCTION _edit(p_layer text, p_feature_id bigint, p_geom geometry, p_event_type text, p_wkb bytea,
                      p_properties jsonb, p_record boolean) RETURNS integer
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
    w text[];             -- _layer_write: {new version, row version}
    fresh boolean;        -- the event starts the feature's state (created, or record_edit without state)
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
        PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer));
        -- One statement for both: the layer, and whether the feature has its state yet.
        SELECT r.*, EXISTS (SELECT 1 FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = p_feature_id) AS has_state
          INTO lay FROM layer_registry r WHERE r.layer = p_layer;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
                HINT = format('Registered layers: %s. Add one with register_layer().',
                              (SELECT string_agg(r.layer, ', ' ORDER BY r.layer) FROM layer_registry r));
        END IF;
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
                    g := ST_MakeValid(g);
                    shape := g;
                    reshaped := true;
                    facts := _inspect_geometry(ST_AsBinary(g), true, 4326, NULL);  -- the stored shape's box
                ELSE
                    -- accept: store as given; route on a made-valid copy, crossing as that copy has it
                    shape := ST_MakeValid(g);
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
            WITH f AS (
                INSERT INTO features AS f (id, geom, version) VALUES (p_feature_id, g, 1)
                ON CONFLICT (id) DO NOTHING
                RETURNING f.version
            )
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer)
            SELECT p_feature_id, f.version, 'created', new_key, 'features' FROM f
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
            INSERT INTO feature_state AS s (layer, feature_id, routing_key, h3_resolution, routing_point, bbox)
            VALUES ('features', p_feature_id, new_key, v_res, v_point, facts[3:6])
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL;
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
                           bbox = coalesce(facts[3:6], s.bbox)
                     WHERE s.layer = 'features' AND s.feature_id = p_feature_id
                    RETURNING CASE WHEN s.previous_h3_resolution = v_res THEN s.previous_routing_key
                                   -- the resolution changed since: the old routing point at the new one
                                   ELSE _h3_cell(s.previous_routing_point[1], s.previous_routing_point[2], v_res)
                              END AS previous_key,
                              s.previous_bbox
                ), f AS (
                    UPDATE features f
                       SET geom = coalesce(g, f.geom),
                           version = f.version + 1,
                           updated_at = now(),
                           retired_at = CASE WHEN p_event_type = 'retired' THEN now() END
                      FROM st
                     WHERE f.id = p_feature_id AND f.retired_at IS NULL
                    RETURNING f.version, st.previous_key, st.previous_bbox
                )
                INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key, layer, previous_bbox)
                SELECT p_feature_id, f.version, p_event_type, coalesce(new_key, f.previous_key), f.previous_key, 'features',
                       f.previous_bbox FROM f
                RETURNING feature_version INTO new_version;
                EXIT WHEN new_version IS NOT NULL;

                -- Nothing written: the feature is missing or retired, or has no state yet. Raising
                -- undoes the state update above.
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
                -- Written before 0.2.0: fill its state from the stored geometry (under the row lock
                -- just taken), then write the edit as above.
                INSERT INTO feature_state (layer, feature_id, routing_key, h3_resolution, routing_point, bbox)
                SELECT 'features', f.id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
                       (_inspect_geometry(ST_AsBinary(f.geom), true, 4326, NULL))[3:6]
                  FROM features f, _routing_point(f.geom) q  -- the point comes wrapped to [-180, 180]
                 WHERE f.id = p_feature_id
                ON CONFLICT (layer, feature_id) DO NOTHING;
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
            IF lay.geometry_type <> 'Geometry' AND GeometryType(store) <> upper(lay.geometry_type) THEN
                RAISE EXCEPTION 'layer % stores %, not %', p_layer, lay.geometry_type, substr(ST_GeometryType(store), 4)
                    USING ERRCODE = '22023', HINT = CASE WHEN reshaped
                          THEN 'ST_MakeValid (feature_outbox.invalid_geometry = repair) changed its type; repair it yourself, or set invalid_geometry = accept or reject.'
                          ELSE format('Its column %I is declared geometry(%s, %s).', lay.geometry_column, lay.geometry_type, lay.srid) END;
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
                        r := _as_caller_row(format('SELECT ST_AsHEXEWKB(ST_Transform(t.%I, 4326)) FROM %s t WHERE t.%I = $1',
                                                   lay.geometry_column, lay.tbl, lay.id_column), p_feature_id);
                        shape := r[1]::geometry;
                        IF shape IS NOT NULL THEN
                            INSERT INTO feature_state (layer, feature_id, routing_key, h3_resolution, routing_point, bbox)
                            SELECT p_layer, p_feature_id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
                                   (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[3:6]
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

        w := _layer_write(p_layer, CASE WHEN p_event_type = 'retired' AND lay.retired_column IS NULL THEN 'delete'
                                        WHEN p_record THEN 'record_' || p_event_type
                                        ELSE p_event_type END,
                          lay.tbl, lay.id_column, lay.geometry_column, lay.version_column, lay.retired_column,
                          p_feature_id, store, p_properties::text, keys);
        IF w IS NULL THEN
            r := _as_caller_row(format('SELECT (%s)::text FROM %s t WHERE t.%I = $1',
                                       CASE WHEN lay.retired_column IS NULL THEN 'NULL::timestamptz'
                                            ELSE format('t.%I', lay.retired_column) END,
                                       lay.tbl, lay.id_column), p_feature_id);
            old_retired := r[1]::timestamptz;
            IF p_event_type = 'created' AND r IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = '23505', MESSAGE = format('feature %s already exists in layer %s%s',
                    p_feature_id, p_layer, CASE WHEN old_retired IS NOT NULL THEN ' and is retired' ELSE '' END),
                    HINT = 'Send a moved or updated event to change it; ids of retired features are not reused.';
            ELSIF old_retired IS NOT NULL THEN
                RAISE EXCEPTION 'feature % of layer % is retired', p_feature_id, p_layer USING ERRCODE = '55000',
                    DETAIL = format('It was retired at %s.', old_retired),
                    HINT = 'A retired feature takes no further edits; create a new feature id.';
            END IF;
            RAISE EXCEPTION 'feature % does not exist in layer %', p_feature_id, p_layer USING ERRCODE = 'P0002',
                HINT = 'Send a created event first.';
        END IF;
        new_version := w[1]::integer;
        IF fresh AND new_key IS NULL THEN
            RAISE EXCEPTION 'feature % of layer % has no geometry to route its event by', p_feature_id, p_layer
                USING ERRCODE = '22004', HINT = 'Send a moved event with its geometry.';
        END IF;

        IF fresh THEN
            INSERT INTO feature_state AS s (layer, feature_id, routing_key, h3_resolution, routing_point, bbox, row_version)
            VALUES (p_layer, p_feature_id, new_key, v_res, v_point, facts[3:6], w[2])
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL,
                   row_version = EXCLUDED.row_version;
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer)
            VALUES (p_feature_id, new_version, p_event_type, new_key, p_layer);
        ELSE
            WITH st AS (
                UPDATE feature_state s
                   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
                       previous_routing_point = s.routing_point, previous_bbox = s.bbox,
                       routing_key = coalesce(new_key, s.routing_key),
                       h3_resolution = CASE WHEN new_key IS NULL THEN s.h3_resolution ELSE v_res END,
                       routing_point = coalesce(v_point, s.routing_point),
                       bbox = coalesce(facts[3:6], s.bbox),
                       row_version = w[2]
                 WHERE s.layer = p_layer AND s.feature_id = p_feature_id
                RETURNING s.routing_key,
                          CASE WHEN s.previous_h3_resolution = v_res THEN s.previous_routing_key
                               ELSE _h3_cell(s.previous_routing_point[1], s.previous_routing_point[2], v_res)
                          END AS previous_key,
                          s.previous_bbox
            )
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key, layer, previous_bbox)
            SELECT p_feature_id, new_version, p_event_type, st.routing_key, st.previous_key, p_layer, st.previous_bbox FROM st;
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n = 0 THEN
                RAISE EXCEPTION 'feature % of layer % has no routing state', p_feature_id, p_layer USING ERRCODE = 'XX000';
            END IF;
        END IF;
    END IF;

    PERFORM _wake_relay_for(p_feature_id);  -- sets the owning relay worker's latch if and when this commits
    RETURN new_version;
END
$$;

CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry text, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    wkb bytea := _geojson_to_ewkb($2);
BEGIN
    RETURN _edit('features', $1, ST_GeomFromEWKB(wkb), $3, wkb, NULL, false);
END
$$;
COMMENT ON FUNCTION edit_feature(bigint, text, text) IS
    'Writes an edit of the built-in layer features and its outbox row in the caller''s transaction. geometry: GeoJSON '
    'geometry (RFC 7946, WGS84 unless crs says otherwise); event_type: created | moved | updated | retired. Returns the new version.';

CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry geometry, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    RETURN _edit('features', $1, $2, $3, NULL, NULL, false);
END
$$;
COMMENT ON FUNCTION edit_feature(bigint, geometry, text) IS
    'Writes an edit of the built-in layer features and its outbox row in the caller''s transaction. geometry: any known '
    'SRID, transformed to 4326; event_type: created | moved | updated | retired. Returns the new version.';

-- A user layer's forms, and record_edit: C entry points (src/edit/layers.rs) that record the
-- calling role, then run _edit (or _record_edit) as the extension's owner. The row is written with
-- the caller's own rights; the outbox row, which no role may write directly, as the owner.
CREATE FUNCTION edit_feature(layer text, feature_id bigint, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION edit_feature(text, bigint, text, text, jsonb) IS
    'Writes an edit of a layer''s row and its outbox row in the caller''s transaction. geometry: GeoJSON (RFC 7946), '
    'stored in the column''s SRID; NULL keeps the current one (updated, retired). event_type: created | moved | updated '
    '| retired. properties: registered columns to set. Returns the new version.';

CREATE FUNCTION edit_feature(layer text, feature_id bigint, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION edit_feature(text, bigint, geometry, text, jsonb) IS
    'Writes an edit of a layer''s row and its outbox row in the caller''s transaction. geometry: any known SRID, stored '
    'in the column''s SRID; NULL keeps the current one (updated, retired). event_type: created | moved | updated | '
    'retired. properties: registered columns to set. Returns the new version.';

CREATE FUNCTION record_edit(layer text, feature_id bigint, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';

-- For applications whose ORM writes the row itself: called after that write, in the same
-- transaction. The row version must be this transaction's (xmin, checked in Rust) and not already
-- recorded, so no role can invent an event for a change that did not happen.
CREATE FUNCTION _record_edit(layer text, feature_id bigint, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry;
    r text[];             -- {xmin, row version, geometry (HEXEWKB)}, read as the caller
    recorded text;
BEGIN
    IF layer = 'features' THEN
        RAISE EXCEPTION 'record_edit serves user layers' USING ERRCODE = '22023',
            HINT = 'The built-in layer features is written by edit_feature(feature_id, geometry, event_type).';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(layer));
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = _record_edit.layer;
    IF NOT FOUND OR feature_id IS NULL OR event_type IS NULL
       OR event_type NOT IN ('created', 'moved', 'retired', 'updated') THEN
        RETURN _edit(layer, feature_id, NULL, event_type, NULL, NULL, true);  -- raises the input's error
    END IF;
    r := _as_caller_row(format('SELECT t.xmin::text, %s, ST_AsHEXEWKB(t.%I) FROM %s t WHERE t.%I = $1',
                               't.tableoid::oid::text || '':'' || t.ctid::text || '':'' || t.xmin::text',
                               lay.geometry_column, lay.tbl, lay.id_column), feature_id);
    IF r IS NULL THEN
        RAISE EXCEPTION 'feature % does not exist in layer %', feature_id, layer USING ERRCODE = 'P0002',
            HINT = 'Call record_edit after the application''s own INSERT or UPDATE of the row, in the same transaction.';
    END IF;
    SELECT s.row_version INTO recorded FROM feature_state s
     WHERE s.layer = _record_edit.layer AND s.feature_id = _record_edit.feature_id;
    IF event_type = 'created' AND FOUND THEN
        RAISE EXCEPTION 'feature % of layer % has events already', feature_id, layer USING ERRCODE = '23505',
            HINT = 'Record a moved or updated event for a row that was written before.';
    END IF;
    -- A retired event makes its change itself (sets the retired column, or deletes the row).
    IF event_type <> 'retired' AND NOT _written_by_this_transaction(r[1]::xid) THEN
        RAISE EXCEPTION 'feature % of layer % was not written by this transaction', feature_id, layer
            USING ERRCODE = '55000',
            HINT = 'record_edit records a change this transaction made: write the row first, then call it before COMMIT.';
    END IF;
    IF r[2] = recorded THEN
        RAISE EXCEPTION 'the current row of feature % of layer % has its event already', feature_id, layer
            USING ERRCODE = '55000', HINT = 'Write the row again before recording another event for it.';
    END IF;
    RETURN _edit(layer, feature_id, CASE WHEN event_type IN ('created', 'moved') THEN r[3]::geometry END,
                 event_type, NULL, NULL, true);
END
$$;
COMMENT ON FUNCTION record_edit(text, bigint, text) IS
    'Records the event of a row the application wrote itself in this transaction: sets its version (1 for created, +1 '
    'otherwise) and writes the outbox row, routed on the row''s geometry. retired deletes the row when the layer has no '
    'retired_column. Returns the new version. Refuses (55000) a row this transaction did not write since its last event.';

REVOKE ALL ON FUNCTION edit_feature(bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(bigint, geometry, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, bigint, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, bigint, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _edit(text, bigint, geometry, text, bytea, jsonb, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION _record_edit(text, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _layer_write(text, text, oid, text, text, text, text, bigint, anyelement, text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_row(text, bigint) FROM PUBLIC;

DROP FUNCTION _check_coordinates(bytea, boolean);
DROP FUNCTION _crosses_antimeridian(bytea);
DROP FUNCTION _routing_cell(bytea);

-- Layers: the user's own tables (sql/layers.sql) ------------------------------------------------

-- Every outbox row names its layer; rows written before are the built-in table's. A constant
-- default fills the existing rows without rewriting the outbox (PostgreSQL 11+), then goes.
ALTER TABLE outbox ADD COLUMN layer text NOT NULL DEFAULT 'features';
ALTER TABLE outbox ALTER COLUMN layer DROP DEFAULT;
ALTER TABLE outbox ALTER COLUMN schema_version SET DEFAULT 3;
-- The box before each edit (events' previous_bbox); NULL for the rows written before.
ALTER TABLE outbox ADD COLUMN previous_bbox float8[];
-- A wider CHECK: every existing row passes it, so NOT VALID then VALIDATE holds no long lock.
ALTER TABLE outbox DROP CONSTRAINT outbox_event_type_check;
ALTER TABLE outbox ADD CONSTRAINT outbox_event_type_check
    CHECK (event_type IN ('created', 'moved', 'retired', 'updated', 'snapshot')) NOT VALID;
ALTER TABLE outbox VALIDATE CONSTRAINT outbox_event_type_check;

-- The layers: tables whose rows edit_feature and record_edit write events for. The built-in table is
-- the layer 'features'; register_layer adds the user's own (sql/layers.sql).
CREATE TABLE layer_registry (
    layer            text     PRIMARY KEY CHECK (layer ~ '^[a-z0-9_-]{1,64}$'),  -- a NATS subject token
    tbl              regclass NOT NULL,
    id_column        name     NOT NULL,
    geometry_column  name     NOT NULL,
    version_column   name     NOT NULL,
    properties       name[]   NOT NULL DEFAULT '{}',
    retired_column   name,                -- NULL: retired deletes the row
    srid             integer  NOT NULL,   -- the geometry column's declared SRID
    geometry_type    text     NOT NULL,   -- the column's declared type (postgis_typmod_type), e.g. Polygon
    -- Outbox rows below this id were written for an earlier layer of the same name (unregistered since).
    since_id         bigint   NOT NULL DEFAULT 0,
    registered_at    timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE layer_registry IS 'One row per layer: the table, its id, geometry, version and retired columns, and the properties each event carries.';
INSERT INTO layer_registry (layer, tbl, id_column, geometry_column, version_column, retired_column, srid, geometry_type)
VALUES ('features', 'features', 'id', 'geom', 'version', 'retired_at', 4326, 'Geometry');
-- CREATE EXTENSION writes the built-in row again at restore: dump the user's layers only.
SELECT pg_catalog.pg_extension_config_dump('layer_registry', 'WHERE layer <> ''features''');
REVOKE ALL ON TABLE layer_registry FROM PUBLIC;

CREATE  FUNCTION "_caller_role"() RETURNS oid /* pg_sys :: Oid */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_caller_role_wrapper';

-- Edits of a layer hold this advisory lock shared until they commit; unregister_layer takes it
-- exclusively: (1179601241, hashtext(layer)). The first key spells FOLY.

CREATE FUNCTION _column_type(tbl regclass, col name, what text) RETURNS pg_attribute
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

CREATE FUNCTION register_layer(layer text, tbl regclass, id_column name DEFAULT 'id',
                               geometry_column name DEFAULT 'geom', version_column name DEFAULT 'version',
                               properties name[] DEFAULT '{}', retired_column name DEFAULT NULL) RETURNS void
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';

CREATE FUNCTION _register_layer(layer text, tbl regclass, id_column name, geometry_column name, version_column name,
                                properties name[], retired_column name) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    rel pg_class;
    a pg_attribute;
    v_srid integer;
    v_type text;
    p name;
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
    IF a.atttypid NOT IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype) THEN
        RAISE EXCEPTION 'id column % is of type %', quote_ident(id_column), format_type(a.atttypid, a.atttypmod)
            USING ERRCODE = '22023', HINT = 'The id column must be smallint, integer or bigint.';
    END IF;
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
            HINT = format('Declare it: ALTER TABLE %s ALTER COLUMN %I TYPE geometry(Geometry, <srid>) USING ST_SetSRID(%I, <srid>).',
                          tbl, geometry_column, geometry_column);
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
                                srid, geometry_type, since_id)
    VALUES (layer, tbl, id_column, geometry_column, version_column, properties, retired_column, v_srid, v_type,
            nextval('outbox_id_seq'));
END
$$;
COMMENT ON FUNCTION register_layer(text, regclass, name, name, name, name[], name) IS
    'Registers a table as a layer: edit_feature(layer, ...) and record_edit write its rows'' events. layer: a NATS '
    'subject token [a-z0-9_-]{1,64}; tbl: a table the caller owns; id: smallint/integer/bigint, unique NOT NULL; '
    'geometry: geometry with a declared SRID; version: integer NOT NULL; properties: columns each event carries; '
    'retired_column: a nullable timestamptz that retired sets (NULL: retired deletes the row).';

CREATE FUNCTION unregister_layer(layer text) RETURNS void
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';

CREATE FUNCTION _unregister_layer(layer text) RETURNS void
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
END
$$;
COMMENT ON FUNCTION unregister_layer(text) IS
    'Removes a layer and its per-feature state. Refuses (55006) while the layer has unpublished, unparked outbox rows.';

CREATE VIEW layers AS
SELECT r.layer, r.tbl AS table_name, r.id_column, r.geometry_column, r.version_column, r.retired_column,
       r.properties, r.srid, r.geometry_type, r.registered_at
  FROM layer_registry r;
COMMENT ON VIEW layers IS 'One row per layer: its table, id, geometry, version and retired columns, properties and SRID.';

REVOKE ALL ON FUNCTION _register_layer(text, regclass, name, name, name, name[], name) FROM PUBLIC;
REVOKE ALL ON FUNCTION _unregister_layer(text) FROM PUBLIC;
GRANT SELECT ON layers TO PUBLIC;

-- Per-feature order with many workers (src/claim.rs) ---------------------------------------------

-- A committing edit wakes only the relay worker that owns its feature.
CREATE  FUNCTION "_wake_relay_for"(
	"feature_id" bigint /* i64 */
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_wake_relay_for_wrapper';

-- Rows waiting for their per-row retry time, whose features' later rows the claim holds back. It
-- indexes only failing rows: the update builds it with one scan of the outbox.
CREATE INDEX outbox_waiting ON outbox (feature_id) WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;

-- The claim's low-water mark (src/low_water.rs) --------------------------------------------------

CREATE FUNCTION "_relay_low_water"() RETURNS bigint /* i64 */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_relay_low_water_wrapper';

CREATE FUNCTION "_relay_low_water_reset"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_relay_low_water_reset_wrapper';

-- Parked rows below the mark, which the backlog counts without walking the rest. It scans the
-- outbox once, under a lock that holds edits back while it builds.
CREATE INDEX outbox_parked ON outbox (id) WHERE parked_at IS NOT NULL AND published_at IS NULL;

-- retry_parked() resets the mark at its commit.
CREATE OR REPLACE FUNCTION retry_parked() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    n bigint;
BEGIN
    UPDATE outbox SET parked_at = NULL, next_attempt_at = NULL, row_failures = 0
     WHERE parked_at IS NOT NULL AND published_at IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM _relay_low_water_reset();  -- the rows are below the claim's low-water mark
        PERFORM _wake_relay_at_commit();
    END IF;
    RETURN n;
END
$$;

-- backlog gains oldest_parked_age and the session holding back VACUUM (at the end, as CREATE OR REPLACE
-- VIEW requires); metrics() their gauges.
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
               count(*) FILTER (WHERE o.attempts > 0 AND o.parked_at IS NULL) AS failing_rows,
               count(*) FILTER (WHERE o.parked_at IS NOT NULL) AS parked_rows,
               min(o.parked_at) AS oldest_parked_at
          FROM (-- From the low-water mark up (relay/low_water): below it every row is published or
                -- parked, and the dead index entries of published rows there are never read.
                SELECT o.created_at, o.parked_at, o.attempts FROM outbox o
                 WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
                UNION ALL
                SELECT o.created_at, o.parked_at, o.attempts FROM outbox o
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
        ORDER BY greatest(age(a.backend_xmin), age(a.backend_xid)) DESC
        LIMIT 1) h ON true;

-- Rows relayed by type, for updated (new in 0.2.0).
CREATE  FUNCTION "_relay_relayed"(
	"event_type" TEXT /* & str */
) RETURNS bigint /* i64 */
STRICT STABLE PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_relay_relayed_wrapper';

CREATE OR REPLACE FUNCTION metrics() RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT concat_ws(E'\n',
        '# HELP outbox_rows_relayed_total Outbox rows published and acknowledged since server start.',
        '# TYPE outbox_rows_relayed_total counter',
        format('outbox_rows_relayed_total{event_type="created"} %s', s.relayed_created),
        format('outbox_rows_relayed_total{event_type="moved"} %s', s.relayed_moved),
        format('outbox_rows_relayed_total{event_type="retired"} %s', s.relayed_retired),
        format('outbox_rows_relayed_total{event_type="updated"} %s', _relay_relayed('updated')),
        format('outbox_rows_relayed_total{event_type="snapshot"} %s', _relay_relayed('snapshot')),
        (SELECT string_agg(format(E'# HELP %1$s %2$s\n# TYPE %1$s gauge\n%1$s %3$s', g.name, g.help, g.value),
                           E'\n' ORDER BY g.ord)
           FROM (VALUES
                 (1, 'outbox_unpublished_rows', 'Unpublished outbox rows, parked ones included.',
                  b.unpublished_rows::numeric),
                 (2, 'outbox_oldest_unpublished_age_seconds', 'Age of the oldest unpublished, unparked outbox row.',
                  coalesce(extract(epoch FROM b.oldest_unpublished_age), 0)),
                 (3, 'outbox_failing_rows', 'Unpublished rows with failed attempts that are not parked.',
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
      FROM backlog b, _relay_status() s
$$;

-- The backlog per layer, with the backlog view's columns. Registered layers always have a row; a
-- layer unregistered since has one while rows of it wait. last_published_at walks the published
-- rows by time until it meets the layer's newest one.
CREATE VIEW backlog_by_layer AS
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
       b.vacuum_held_for
  FROM (SELECT r.layer FROM layer_registry r
        UNION
        SELECT o.layer FROM outbox o WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
        UNION
        SELECT o.layer FROM outbox o WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL) l
  LEFT JOIN (
       SELECT o.layer,
              count(*) AS unpublished_rows,
              min(o.created_at) FILTER (WHERE o.parked_at IS NULL) AS oldest_unpublished_at,
              count(*) FILTER (WHERE o.attempts > 0 AND o.parked_at IS NULL) AS failing_rows,
              count(*) FILTER (WHERE o.parked_at IS NOT NULL) AS parked_rows,
              min(o.parked_at) AS oldest_parked_at
         FROM (SELECT o.layer, o.created_at, o.parked_at, o.attempts FROM outbox o
                WHERE o.published_at IS NULL AND o.id >= _relay_low_water()
               UNION ALL
               SELECT o.layer, o.created_at, o.parked_at, o.attempts FROM outbox o
                WHERE o.parked_at IS NOT NULL AND o.published_at IS NULL AND o.id < _relay_low_water()) o
        GROUP BY o.layer) u ON u.layer = l.layer
 CROSS JOIN backlog b;
COMMENT ON VIEW backlog_by_layer IS 'The backlog view''s columns, one row per layer.';

-- Monitoring roles read the views.
GRANT SELECT ON backlog, workers, backlog_by_layer TO pg_monitor;

-- Area subscriptions: hierarchical subjects, departure notices, bounding boxes, the backlog by
-- cell and backfills (sql/backfill.sql) ------------------------------------------------------------

-- H3 parents, for backlog_by_cell.
CREATE  FUNCTION "_h3_parent"(
	"cell" TEXT, /* & str */
	"resolution" INT /* i32 */
) RETURNS TEXT /* String */
IMMUTABLE STRICT PARALLEL SAFE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_h3_parent_wrapper';

-- backfill's reads of a layer's table, as the caller.
CREATE  FUNCTION "_as_caller_rows"(
	"sql" TEXT, /* & str */
	"args" bigint[] /* Vec < Option < i64 > > */
) RETURNS SETOF TEXT[] /* Vec < Option < String > > */
STRICT VOLATILE
LANGUAGE c /* Rust */
AS 'MODULE_PATHNAME', '_as_caller_rows_wrapper';
REVOKE ALL ON FUNCTION _as_caller_rows(text, bigint[]) FROM PUBLIC;

-- The backlog by area: unpublished, unparked rows per layer and H3 parent of their routing key at
-- `resolution`. Its cost follows the unpublished rows (the partial index, from the low-water mark
-- up: below it every row is published or parked), never the published history.
CREATE FUNCTION backlog_by_cell(resolution integer DEFAULT 5)
RETURNS TABLE (layer text, cell text, unpublished_rows bigint, oldest_unpublished_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
AS $$
BEGIN
    IF resolution IS NULL OR resolution NOT BETWEEN 0 AND 15 THEN
        RAISE EXCEPTION 'H3 resolution % is outside 0-15', coalesce(resolution::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    RETURN QUERY
    SELECT o.layer, _h3_parent(o.routing_key, resolution), count(*), min(o.created_at)
      FROM outbox o
     WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.id >= _relay_low_water()
     GROUP BY 1, 2
     ORDER BY 1, 2;
END
$$;
COMMENT ON FUNCTION backlog_by_cell(integer) IS
    'Unpublished, unparked outbox rows per layer and H3 parent cell (at resolution 0-15, default 5) of their routing '
    'key, with the oldest one''s time. 22023 for a resolution finer than a routing key''s own.';
REVOKE ALL ON FUNCTION backlog_by_cell(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION backlog_by_cell(integer) TO pg_monitor;


-- Backfill: one snapshot event per live feature of a layer (in an area), for a consumer that starts
-- empty. A procedure, so that it commits in chunks: each chunk holds its features' row locks for
-- milliseconds, never the whole layer for the whole run.
--
-- Consistency: each chunk locks its feature rows FOR SHARE, in the order edits lock them, while it
-- writes their snapshot rows. An edit racing with it therefore commits either before the chunk (the
-- snapshot carries its version) or after it (its outbox row is written after the snapshot's, and the
-- relay's per-feature order delivers it after the snapshot).

-- The per-feature state of a feature that has none, from its stored geometry (EPSG:4326), as its
-- next edit would fill it. A shape the edit path cannot route (NULL, empty, refused) gets none, and
-- so no snapshot.
CREATE FUNCTION __backfill_state(p_layer text, p_feature_id bigint, shape geometry, v_res integer) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF shape IS NULL OR ST_IsEmpty(shape) THEN
        RETURN;
    END IF;
    INSERT INTO feature_state (layer, feature_id, routing_key, h3_resolution, routing_point, bbox)
    SELECT p_layer, p_feature_id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
           (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL))[3:6]
      FROM _routing_point(shape) q
    ON CONFLICT (layer, feature_id) DO NOTHING;
EXCEPTION WHEN data_exception THEN
    NULL;
END
$$;

-- The body of one chunk, run as the extension's owner by the C entry _backfill_chunk (which records
-- the calling role, as edit_feature(layer, ...) does). p_after: the last feature id of the chunk
-- before (-2^63 at first). Returns {last feature id looked at (NULL: none left), snapshots written}.
CREATE FUNCTION __backfill_chunk(p_layer text, p_area geometry, p_after bigint, p_limit integer) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    caller oid := _caller_role();
    lay layer_registry;
    v_res integer := current_setting('feature_outbox.h3_resolution')::integer;
    area geometry;
    candidates bigint[];   -- this chunk's live features, in id order
    versions integer[];    -- a user layer's: their versions, read under the row lock
    missing bigint[];      -- of those, the ones without per-feature state yet
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

    IF p_layer = 'features' THEN
        SELECT array_agg(c.id ORDER BY c.id) INTO candidates
          FROM (SELECT f.id FROM features f WHERE f.id > p_after AND f.retired_at IS NULL ORDER BY f.id LIMIT p_limit) c;
    ELSE
        -- A user layer's rows are read and locked as the caller, with its rights, before the state:
        -- the order its edits lock them in (the row, then the state), so the two never deadlock.
        SELECT array_agg(x[1]::bigint ORDER BY x[1]::bigint), array_agg(x[2]::integer ORDER BY x[1]::bigint)
          INTO candidates, versions
          FROM _as_caller_rows(format('SELECT t.%1$I::text, t.%2$I::text FROM %3$s t WHERE t.%1$I > $1[1]%4$s ORDER BY t.%1$I LIMIT $1[2] FOR SHARE OF t',
                                      lay.id_column, lay.version_column, lay.tbl,
                                      CASE WHEN lay.retired_column IS NOT NULL THEN format(' AND t.%I IS NULL', lay.retired_column) ELSE '' END),
                               ARRAY[p_after, p_limit]) x;
    END IF;
    IF candidates IS NULL THEN
        RETURN ARRAY[NULL, 0]::bigint[];
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
                SELECT x FROM _as_caller_rows(format('SELECT t.%1$I::text, ST_AsHEXEWKB(ST_Transform(t.%2$I, 4326)) FROM %3$s t WHERE t.%1$I = ANY($1)',
                                                     lay.id_column, lay.geometry_column, lay.tbl), missing) x
            LOOP
                PERFORM __backfill_state(p_layer, r[1]::bigint, r[2]::geometry, v_res);
            END LOOP;
        END IF;
    END IF;

    -- The state of those in the area, locked. For the built-in table the state goes first and the
    -- feature row after it, the order edit_feature locks them in.
    locked := ARRAY(SELECT l.feature_id FROM (
                  SELECT s.feature_id FROM feature_state s
                   WHERE s.layer = p_layer AND s.feature_id = ANY(candidates)
                     AND (area IS NULL OR ST_Intersects(area, ST_SetSRID(ST_MakePoint(s.routing_point[1], s.routing_point[2]), 4326)))
                   ORDER BY s.feature_id
                     FOR SHARE OF s) l);
    IF p_layer = 'features' THEN
        SELECT array_agg(v.id ORDER BY v.id), array_agg(v.version ORDER BY v.id) INTO locked, versions
          FROM (SELECT f.id, f.version FROM features f WHERE f.id = ANY(locked) AND f.retired_at IS NULL
                 ORDER BY f.id FOR SHARE OF f) v;
        candidates := locked;
    END IF;

    INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer)
    SELECT s.feature_id, u.version, 'snapshot', s.routing_key, p_layer
      FROM unnest(candidates, versions) u(id, version)
      JOIN feature_state s ON s.layer = p_layer AND s.feature_id = u.id
     WHERE u.id = ANY(locked)
     ORDER BY u.id;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM _wake_relay_at_commit();
    END IF;
    RETURN ARRAY[(SELECT max(c) FROM unnest(candidates) c), n];
END
$$;

CREATE FUNCTION _backfill_chunk(layer text, area geometry, after bigint, chunk integer) RETURNS bigint[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _backfill_chunk(text, geometry, bigint, integer) IS
    'One chunk of backfill(); callable only by roles that may execute backfill.';

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT. Every name in it is
-- schema-qualified or a built-in.
CREATE PROCEDURE backfill(layer text, area geometry DEFAULT NULL, INOUT written bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    after bigint := -9223372036854775808;
    r bigint[];
BEGIN
    written := 0;
    LOOP
        r := feature_outbox._backfill_chunk(layer, area, after, 500);
        EXIT WHEN r[1] IS NULL;
        written := written + r[2];
        after := r[1];
        COMMIT;
    END LOOP;
END
$$;
COMMENT ON PROCEDURE backfill(text, geometry, bigint) IS
    'Writes one snapshot event per live feature of a layer whose routing point lies in area (any SRID; NULL: all), '
    'committing every 500 features, and returns their count in written. CALL it outside a transaction block. '
    'EXECUTE is not granted to PUBLIC: snapshots reach every subscriber of the area.';
REVOKE ALL ON FUNCTION __backfill_chunk(text, geometry, bigint, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION __backfill_state(text, bigint, geometry, integer) FROM PUBLIC;
REVOKE ALL ON PROCEDURE backfill(text, geometry, bigint) FROM PUBLIC;

-- Replays for a sink that lost what it had acknowledged ---------------------------------------------
-- Publishes again the rows published since `since` (of one layer, or all): for a sink that lost
-- messages it had acknowledged (a JetStream cluster that lost its stream's tail, a restored backup
-- of a webhook receiver). Same event_ids: consumers deduplicate. Only rows retention has not
-- deleted yet can be replayed (feature_outbox.retention). Returns how many.
CREATE FUNCTION replay_published(since timestamptz, layer text DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    n bigint;
BEGIN
    IF since IS NULL THEN
        RAISE EXCEPTION 'since must not be NULL' USING ERRCODE = '22004',
            HINT = 'Give the time from which the sink lost what it had acknowledged.';
    END IF;
    UPDATE outbox o SET published_at = NULL
     WHERE o.published_at IS NOT NULL AND o.published_at >= since
       AND (replay_published.layer IS NULL OR o.layer = replay_published.layer);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM _relay_low_water_reset();  -- the rows are below the claim's low-water mark
        PERFORM _wake_relay_at_commit();
    END IF;
    RETURN n;
END
$$;
COMMENT ON FUNCTION replay_published(timestamptz, text) IS
    'Requeues outbox rows published at or after since (of one layer, or all) to be published again, with the same '
    'event_ids; for a sink that lost acknowledged messages. Returns how many. EXECUTE is not granted to PUBLIC.';
REVOKE ALL ON FUNCTION replay_published(timestamptz, text) FROM PUBLIC;

-- As sql/finalize.sql does at CREATE EXTENSION: pin search_path on every SQL and plpgsql function,
-- including those this script adds. PostGIS's schema is known only at run time. Procedures are
-- left out: one with a SET clause cannot COMMIT.
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
