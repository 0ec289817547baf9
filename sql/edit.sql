-- edit_feature: one call writes the feature and exactly one outbox row in the caller's transaction.
-- No triggers. Geometry work stays in PostGIS; GeoJSON parsing, coordinate checks and the H3 cell
-- are Rust (_geojson_to_ewkb, _check_coordinates, _crosses_antimeridian, _routing_cell).

-- The routing point: ST_PointOnSurface of a made-valid copy when invalid, computed on the
-- longitude-shifted shape when a ring crosses the antimeridian, then wrapped back to [-180, 180].
-- It lies inside the feature's footprint, unlike ST_Centroid (the guide's gotcha 6).
CREATE FUNCTION _routing_point(g geometry) RETURNS geometry
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    WITH base AS (
        SELECT CASE WHEN (ST_IsValidDetail(g)).valid THEN g ELSE ST_MakeValid(g) END AS g
    ), shifted AS (
        SELECT CASE WHEN _crosses_antimeridian(ST_AsBinary(base.g))
                    THEN ST_PointOnSurface(ST_ShiftLongitude(base.g))
                    ELSE ST_PointOnSurface(base.g) END AS p
          FROM base
    )
    SELECT CASE WHEN ST_X(p) > 180 THEN ST_Translate(p, -360, 0) ELSE p END FROM shifted
$$;

CREATE FUNCTION routing_key(g geometry) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE
AS $$ SELECT _routing_cell(ST_AsBinary(_routing_point(g))) $$;
COMMENT ON FUNCTION routing_key(geometry) IS
    'H3 cell (lowercase hex) of the routing point of an EPSG:4326 geometry, at feature_outbox.h3_resolution.';

-- GeometryType of a geometry and, for a collection, of every member at any depth.
CREATE FUNCTION _member_types(g geometry) RETURNS TABLE (kind text)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
AS $$
    WITH RECURSIVE member(geom) AS (
        SELECT g
        UNION ALL
        SELECT ST_GeometryN(m.geom, i)
          FROM member m, generate_series(1, ST_NumGeometries(m.geom)) i
         WHERE GeometryType(m.geom) = 'GEOMETRYCOLLECTION'
    )
    SELECT GeometryType(geom) FROM member
$$;

-- Validates a geometry, transforms it to EPSG:4326 and applies feature_outbox.invalid_geometry.
-- Every failure is a class-22 error raised before anything is written.
CREATE FUNCTION _prepare_geometry(g geometry) RETURNS geometry
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_srid integer := ST_SRID(g);
    kind text := GeometryType(g);
    curved text;
    unsupported text;
    detail record;
    original geometry := g;
    back geometry;
    tolerance float8;
BEGIN
    IF v_srid = 0 THEN
        RAISE EXCEPTION 'geometry has SRID 0 (unknown coordinate system)' USING ERRCODE = '22023',
            HINT = 'Give it one, e.g. ST_SetSRID(geom, 4326) for longitude/latitude in degrees.';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM spatial_ref_sys s WHERE s.srid = v_srid) THEN
        RAISE EXCEPTION 'unknown SRID %', v_srid USING ERRCODE = '22023',
            HINT = 'Use an EPSG code listed in spatial_ref_sys, or transform to 4326 first.';
    END IF;
    -- Types GeoJSON cannot carry, at the top or inside a collection at any depth.
    SELECT string_agg(DISTINCT t.kind, ', ') FILTER (WHERE t.kind IN ('CIRCULARSTRING', 'COMPOUNDCURVE',
                          'CURVEPOLYGON', 'MULTICURVE', 'MULTISURFACE')),
           string_agg(DISTINCT t.kind, ', ') FILTER (WHERE t.kind IN ('TRIANGLE', 'TIN', 'POLYHEDRALSURFACE'))
      INTO curved, unsupported
      FROM _member_types(g) t;
    IF curved IS NOT NULL OR ST_HasArc(g) THEN
        RAISE EXCEPTION 'curved geometry type % is not supported', coalesce(curved, kind) USING ERRCODE = '22023',
            HINT = 'Linearize it first with ST_CurveToLine(geom).';
    ELSIF unsupported IS NOT NULL THEN
        RAISE EXCEPTION 'geometry type % is not supported', unsupported USING ERRCODE = '22023',
            HINT = 'Use Point, LineString, Polygon, their Multi forms or a GeometryCollection of them.';
    END IF;
    IF ST_NDims(g) > 2 THEN
        RAISE EXCEPTION 'geometry has % ordinates; features are 2-D', (ARRAY['M', 'Z', 'Z and M'])[ST_Zmflag(g)]
            USING ERRCODE = '22023', HINT = 'Drop them first with ST_Force2D(geom).';
    END IF;

    IF v_srid <> 4326 THEN
        PERFORM _check_coordinates(ST_AsBinary(g), false);
        BEGIN
            g := ST_Transform(g, 4326);
            -- PROJ wraps coordinates far outside a projection's domain instead of failing (EPSG:3857
            -- x = 4e7 m becomes longitude 0). Transforming back exposes it: compare the bounding boxes.
            back := ST_Transform(ST_SetSRID(g, 4326), v_srid);
            tolerance := 1e-6 * greatest(1, abs(ST_XMin(original)), abs(ST_XMax(original)), abs(ST_YMin(original)), abs(ST_YMax(original)));
            IF greatest(abs(ST_XMin(back) - ST_XMin(original)), abs(ST_XMax(back) - ST_XMax(original)),
                        abs(ST_YMin(back) - ST_YMin(original)), abs(ST_YMax(back) - ST_YMax(original))) > tolerance THEN
                RAISE EXCEPTION 'coordinates are outside the area where SRID % can be transformed to 4326', v_srid
                    USING ERRCODE = '22023', DETAIL = format('%s transforms to %s and back to %s.',
                          ST_AsText(ST_Envelope(original)), ST_AsText(ST_Envelope(g)), ST_AsText(ST_Envelope(back))),
                    HINT = 'Check the coordinates and their SRID; are x and y swapped, or the units wrong?';
            END IF;
        EXCEPTION WHEN internal_error THEN
            RAISE EXCEPTION 'cannot transform geometry from SRID % to 4326', v_srid USING ERRCODE = '22023',
                DETAIL = SQLERRM, HINT = 'Check the SRID''s definition in spatial_ref_sys and that the coordinates lie inside its area of use.';
        END;
    END IF;
    PERFORM _check_coordinates(ST_AsBinary(g), true);

    detail := ST_IsValidDetail(g);
    IF NOT detail.valid THEN
        CASE current_setting('feature_outbox.invalid_geometry')
        WHEN 'reject' THEN
            RAISE EXCEPTION 'geometry is not valid: %', detail.reason USING ERRCODE = '22023',
                DETAIL = format('ST_IsValidReason: %s', ST_IsValidReason(g)),
                HINT = 'Repair it with ST_MakeValid(geom), or set feature_outbox.invalid_geometry = repair.';
        WHEN 'repair' THEN
            g := ST_MakeValid(g);
        ELSE
            NULL;  -- accept: store as given; the routing point still comes from a made-valid copy
        END CASE;
    END IF;
    RETURN g;
END
$$;

CREATE FUNCTION _edit(p_feature_id bigint, p_geom geometry, p_event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    g geometry;
    old_geom geometry;
    old_retired timestamptz;
    new_version integer;
    previous_key text;
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
    ELSIF ST_IsEmpty(p_geom) THEN
        RAISE EXCEPTION 'geometry is empty' USING ERRCODE = '22023',
            HINT = 'A feature needs a non-empty geometry. To remove a feature, send a retired event.';
    ELSE
        g := _prepare_geometry(p_geom);
    END IF;

    IF p_event_type = 'created' THEN
        INSERT INTO features AS f (id, geom, version) VALUES (p_feature_id, g, 1)
        ON CONFLICT (id) DO NOTHING
        RETURNING f.version INTO new_version;
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
    ELSE
        SELECT f.geom, f.retired_at INTO old_geom, old_retired
          FROM features f WHERE f.id = p_feature_id FOR UPDATE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'feature % does not exist', p_feature_id USING ERRCODE = 'P0002',
                HINT = 'Send a created event first.';
        END IF;
        IF old_retired IS NOT NULL THEN
            RAISE EXCEPTION 'feature % is retired', p_feature_id USING ERRCODE = '55000',
                DETAIL = format('It was retired at %s.', old_retired),
                HINT = 'A retired feature takes no further edits; create a new feature id.';
        END IF;
        previous_key := routing_key(old_geom);
        UPDATE features f
           SET geom = coalesce(g, f.geom),
               version = f.version + 1,
               updated_at = now(),
               retired_at = CASE WHEN p_event_type = 'retired' THEN now() END
         WHERE f.id = p_feature_id
        RETURNING f.version INTO new_version;
        g := coalesce(g, old_geom);
    END IF;

    INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key)
    VALUES (p_feature_id, new_version, p_event_type, routing_key(g), previous_key);
    PERFORM _wake_relay_at_commit();  -- sets the relay workers' latches if and when this commits
    RETURN new_version;
END
$$;

CREATE FUNCTION edit_feature(feature_id bigint, geometry text, event_type text) RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
AS $$ SELECT _edit($1, ST_GeomFromEWKB(_geojson_to_ewkb($2)), $3) $$;
COMMENT ON FUNCTION edit_feature(bigint, text, text) IS
    'Writes a feature edit and its outbox row in the caller''s transaction. geometry: GeoJSON geometry '
    '(RFC 7946, WGS84 unless crs says otherwise); event_type: created | moved | retired. Returns the new version.';

CREATE FUNCTION edit_feature(feature_id bigint, geometry geometry, event_type text) RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
AS $$ SELECT _edit($1, $2, $3) $$;
COMMENT ON FUNCTION edit_feature(bigint, geometry, text) IS
    'Writes a feature edit and its outbox row in the caller''s transaction. geometry: any known SRID, '
    'transformed to 4326; event_type: created | moved | retired. Returns the new version.';

