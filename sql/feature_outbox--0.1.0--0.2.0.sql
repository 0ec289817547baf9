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

CREATE FUNCTION _edit(p_feature_id bigint, p_geom geometry, p_event_type text, p_wkb bytea) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_res integer;        -- feature_outbox.h3_resolution
    v_srid integer;
    crs text;             -- auth_name:auth_srid of a source SRID other than 4326
    g geometry;           -- the geometry to store, in EPSG:4326
    facts float8[];       -- _inspect_geometry: {crosses antimeridian, pole, west, south, east, north, resolution}
    shape geometry;       -- what the routing point is taken from
    back geometry;
    tolerance float8;
    p geometry;
    new_key text;
    v_point float8[];      -- the routing point, {longitude, latitude}
    old_retired timestamptz;
    new_version integer;
BEGIN
    IF p_event_type IS NULL OR p_event_type NOT IN ('created', 'moved', 'retired') THEN
        RAISE EXCEPTION 'unknown event_type %', coalesce(quote_literal(p_event_type), 'NULL')
            USING ERRCODE = '22023', HINT = 'event_type must be one of: created, moved, retired.';
    END IF;
    IF p_feature_id IS NULL THEN
        RAISE EXCEPTION 'feature_id must not be NULL' USING ERRCODE = '22004';
    END IF;

    IF p_geom IS NULL THEN
        IF p_event_type <> 'retired' THEN
            RAISE EXCEPTION 'geometry must not be NULL for a % event', p_event_type USING ERRCODE = '22004',
                HINT = 'Only a retired event may omit the geometry; it then keeps the last one.';
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

    IF p_event_type = 'created' THEN
        WITH f AS (
            INSERT INTO features AS f (id, geom, version) VALUES (p_feature_id, g, 1)
            ON CONFLICT (id) DO NOTHING
            RETURNING f.version
        )
        INSERT INTO outbox (feature_id, feature_version, event_type, routing_key)
        SELECT p_feature_id, f.version, 'created', new_key FROM f
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
                          END AS previous_key
            ), f AS (
                UPDATE features f
                   SET geom = coalesce(g, f.geom),
                       version = f.version + 1,
                       updated_at = now(),
                       retired_at = CASE WHEN p_event_type = 'retired' THEN now() END
                  FROM st
                 WHERE f.id = p_feature_id AND f.retired_at IS NULL
                RETURNING f.version, st.previous_key
            )
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key)
            SELECT p_feature_id, f.version, p_event_type, coalesce(new_key, f.previous_key), f.previous_key FROM f
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

    PERFORM _wake_relay_at_commit();  -- sets the relay workers' latches if and when this commits
    RETURN new_version;
END
$$;

CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry text, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    wkb bytea := _geojson_to_ewkb($2);
BEGIN
    RETURN _edit($1, ST_GeomFromEWKB(wkb), $3, wkb);
END
$$;
COMMENT ON FUNCTION edit_feature(bigint, text, text) IS
    'Writes a feature edit and its outbox row in the caller''s transaction. geometry: GeoJSON geometry '
    '(RFC 7946, WGS84 unless crs says otherwise); event_type: created | moved | retired. Returns the new version.';

CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry geometry, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    RETURN _edit($1, $2, $3, NULL);
END
$$;
COMMENT ON FUNCTION edit_feature(bigint, geometry, text) IS
    'Writes a feature edit and its outbox row in the caller''s transaction. geometry: any known SRID, '
    'transformed to 4326; event_type: created | moved | retired. Returns the new version.';
REVOKE ALL ON FUNCTION _edit(bigint, geometry, text, bytea) FROM PUBLIC;

DROP FUNCTION _check_coordinates(bytea, boolean);
DROP FUNCTION _crosses_antimeridian(bytea);
DROP FUNCTION _routing_cell(bytea);

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

CREATE OR REPLACE FUNCTION metrics() RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT concat_ws(E'\n',
        '# HELP outbox_rows_relayed_total Outbox rows published and acknowledged since server start.',
        '# TYPE outbox_rows_relayed_total counter',
        format('outbox_rows_relayed_total{event_type="created"} %s', s.relayed_created),
        format('outbox_rows_relayed_total{event_type="moved"} %s', s.relayed_moved),
        format('outbox_rows_relayed_total{event_type="retired"} %s', s.relayed_retired),
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

-- Monitoring roles read the views.
GRANT SELECT ON backlog, workers TO pg_monitor;

-- As sql/finalize.sql does at CREATE EXTENSION: pin search_path on every SQL and plpgsql function,
-- including those this script adds. PostGIS's schema is known only at run time.
DO $pin$
DECLARE
    postgis_schema text := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                             WHERE e.extname = 'postgis');
    fn regprocedure;
BEGIN
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc p
               WHERE p.pronamespace = 'feature_outbox'::regnamespace
                 AND p.prolang IN (SELECT oid FROM pg_language WHERE lanname IN ('sql', 'plpgsql'))
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, feature_outbox, pg_temp', fn, postgis_schema);
    END LOOP;
END
$pin$;

-- Relay workers wait while the schema is older than their library; they resume when this commits.
SELECT _wake_relay_at_commit();
