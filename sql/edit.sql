-- edit_feature: one call writes the feature, its per-feature state and exactly one outbox row, in
-- the caller's transaction. No triggers.
-- PostGIS does what only it does: ST_Transform, ST_IsValidDetail/ST_MakeValid, ST_PointOnSurface.
-- One Rust pass over the geometry's WKB (_inspect_geometry) does the rest: dimensions, emptiness,
-- finiteness, range, the source CRS's area of use, antimeridian, rings around a pole, bounding box;
-- _h3_cell turns the routing point into the H3 cell.
-- The hottest path, a valid EPSG:4326 shape moved through either built-in form, is Rust with kept
-- plans (src/edit/moved.rs); the rest is PL/pgSQL, whose statements are planned once per session. No
-- SQL-language function sits in either: PostgreSQL 15 plans a non-inlined SQL function's body again
-- at every call.

-- ST_MakeValid, or where its default method (linework) gives NULL, as PostGIS 3.5 with GEOS 3.13
-- does for polygons with a ring collapsed to too few points (5 of the shared counties), the
-- structure method. Raises 22023 when neither repairs the shape, never hands on a NULL.
CREATE OR REPLACE FUNCTION _made_valid(g geometry) RETURNS geometry
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
    IF NOT (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL)).antimeridian THEN
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

-- GeometryType of a geometry and, for a collection, of every member at any depth.
CREATE OR REPLACE FUNCTION _member_types(g geometry) RETURNS TABLE (kind text)
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

-- Types GeoJSON cannot carry, at the top or inside a collection at any depth. Only geometries whose
-- top-level type is not one of the six simple ones reach this.
CREATE OR REPLACE FUNCTION _check_types(g geometry) RETURNS void
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

-- The write path behind every edit_feature form and record_edit. p_layer: a registered layer
-- ('features' is the built-in table). p_wkb: the geometry's (E)WKB when the caller has it already
-- (the GeoJSON form), else NULL. p_properties: registered columns to set. p_record: record_edit,
-- whose caller wrote the row itself (p_geom is then the stored geometry, NULL for updated and
-- retired). p_key: a uuid or text key, canonical (see _edit_key), whose number p_feature_id is;
-- NULL for integer keys. Every failure is a class-22 (or 23505/42704/P0002/55000) error raised
-- before anything is written.
CREATE OR REPLACE FUNCTION _edit(p_layer text, p_feature_id bigint, p_geom geometry, p_event_type text, p_wkb bytea,
                      p_properties jsonb, p_record boolean, p_key text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    user_layer boolean := p_layer IS DISTINCT FROM 'features';
    lay record;           -- a user layer's layer_registry row; has_state: its feature has a state row; expires: it has an expire output
    v_res integer;        -- feature_outbox.h3_resolution
    v_srid integer;
    crs text;             -- auth_name:auth_srid of a source SRID other than 4326
    g geometry;           -- the geometry, in EPSG:4326
    facts geometry_facts; -- _inspect_geometry: antimeridian, polar, bbox, h3_resolution
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
    w layer_write;        -- _layer_write_row: the row as written (version, row_version, its digests)
    state_gd uuid;        -- the geometry digest the feature's last event recorded
    fresh boolean;        -- the event starts the feature's state (created, or record_edit without state)
    v_digest uuid;        -- the built-in layer's: digest of the geometry written
    v_key text;           -- a user layer's key as text: p_key (uuid, text), or p_feature_id
    v_cast text;          -- the type a statement casts v_key to
    bad text;
    keys text[];          -- the keys of p_properties
    r text[];             -- a row read from the layer's table, as the caller
    n bigint;
    expires boolean;      -- the layer is attached to an expire output (sql/tiles.sql)
    prev_key text;        -- the built-in layer's state row hands back the routing key before (at v_res),
    prev_bbox float8[];   -- the box before,
    st_gd uuid;           -- and the digests this edit recorded
    st_pd uuid;
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
               EXISTS (SELECT 1 FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = p_feature_id) AS has_state,
               _layer_expires(p_layer) AS expires
          INTO lay FROM layer_registry r WHERE r.layer = p_layer;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(p_layer), 'NULL') USING ERRCODE = '42704',
                HINT = format('Registered layers: %s. Add one with register_layer().',
                              (SELECT string_agg(r.layer, ', ' ORDER BY r.layer) FROM layer_registry r));
        END IF;
        v_key := coalesce(p_key, p_feature_id::text);
        v_cast := CASE WHEN p_key IS NULL THEN 'bigint' ELSE lay.id_type::text END;
        expires := lay.expires;
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
        IF v_srid <> 4326 THEN
            IF v_srid = 0 THEN
                RAISE EXCEPTION 'geometry has SRID 0 (unknown coordinate system)' USING ERRCODE = '22023',
                    HINT = 'Give it one, e.g. ST_SetSRID(geom, 4326) for longitude/latitude in degrees.';
            END IF;
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
            IF facts.polar <> 0 THEN
                -- A ring winds round a pole: in its source CRS the polygon encloses it. Rebuild it as a
                -- polar cap from a copy densified in that CRS, and route it on its source point on surface.
                g := ST_GeomFromEWKB(_close_polar_caps(ST_AsBinary(ST_Transform(ST_Segmentize(p_geom,
                         greatest(ST_XMax(p_geom) - ST_XMin(p_geom), ST_YMax(p_geom) - ST_YMin(p_geom)) / 256), 4326))));
                IF NOT (ST_IsValidDetail(g)).valid
                   OR NOT ST_Covers(g, ST_SetSRID(ST_MakePoint(0, 90 * facts.polar), 4326)) THEN
                    RAISE EXCEPTION 'a polygon around the % Pole in SRID % cannot be stored as a valid EPSG:4326 polygon',
                        CASE WHEN facts.polar < 0 THEN 'South' ELSE 'North' END, v_srid USING ERRCODE = '22023',
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
                    facts.antimeridian := (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL)).antimeridian;
                END CASE;
            END IF;
            p := ST_PointOnSurface(CASE WHEN facts.antimeridian THEN ST_ShiftLongitude(shape) ELSE shape END);
        END IF;
        -- {longitude, latitude}, wrapped back when taken on the longitude-shifted shape.
        v_point := ARRAY[CASE WHEN ST_X(p) > 180 THEN ST_X(p) - 360 ELSE ST_X(p) END, ST_Y(p)];
        v_res := facts.h3_resolution;
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
            RETURNING feature_version, _layer_expires('features')
                 INTO new_version, expires;
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
            VALUES ('features', p_feature_id, new_key, v_res, v_point, facts.bbox, v_digest, md5('()')::uuid, 1, 'created')
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL,
                   geometry_digest = EXCLUDED.geometry_digest, properties_digest = EXCLUDED.properties_digest,
                   version = 1, last_event = 'created';
        ELSE
            FOR attempt IN 1..2 LOOP
                -- The state row first: its lock orders the edits of this feature, and RETURNING hands
                -- back the state the last committed edit left. A retired event without a geometry
                -- keeps the last one, and its state. Then the feature, then the outbox row: three
                -- plain statements start for about 20,000 instructions less than one that joins
                -- them through two CTEs (callgrind, bench/edit_steps.py).
                UPDATE feature_state s
                   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
                       previous_routing_point = s.routing_point, previous_bbox = s.bbox,
                       routing_key = coalesce(new_key, s.routing_key),
                       h3_resolution = CASE WHEN new_key IS NULL THEN s.h3_resolution ELSE v_res END,
                       routing_point = coalesce(v_point, s.routing_point),
                       bbox = coalesce(facts.bbox, s.bbox),
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
                          END,
                          s.previous_bbox, s.geometry_digest, s.properties_digest
                     INTO prev_key, prev_bbox, st_gd, st_pd;
                IF FOUND THEN
                    UPDATE features f
                       SET geom = coalesce(g, f.geom),
                           version = f.version + 1,
                           updated_at = now(),
                           retired_at = CASE WHEN p_event_type = 'retired' THEN now() END
                     WHERE f.id = p_feature_id AND f.retired_at IS NULL
                    RETURNING f.version INTO new_version;
                    IF FOUND THEN
                        -- With it, whether the layer is attached to an expire output (below).
                        INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key, layer,
                                            previous_bbox, geometry_digest, properties_digest)
                        VALUES (p_feature_id, new_version, p_event_type, coalesce(new_key, prev_key), prev_key, 'features',
                                prev_bbox, st_gd, st_pd)
                        RETURNING _layer_expires('features') INTO expires;
                        EXIT;
                    END IF;
                END IF;

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
                       (_inspect_geometry(ST_AsBinary(f.geom), true, 4326, NULL)).bbox, f.version
                  FROM features f, _routing_point(f.geom) q  -- the point comes wrapped to [-180, 180]
                 WHERE f.id = p_feature_id
                ON CONFLICT (layer, feature_id) DO UPDATE SET version = EXCLUDED.version WHERE s.version IS NULL;
            END LOOP;
        END IF;
    ELSE
        -- A user layer. Its row is written by _layer_write_row with the calling role's rights; the state
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
                                   (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL)).bbox, p_key
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
        new_version := w.version;
        -- Routing follows the geometry: an updated event carries none, so the row must still hold
        -- the one its last event recorded. A plain UPDATE that moved it needs a moved event. (Read
        -- under the row's lock, which orders this feature's edits: the last committed one's state.)
        IF new_key IS NULL AND p_event_type = 'updated' THEN
            SELECT s.geometry_digest INTO state_gd FROM feature_state s WHERE s.layer = p_layer AND s.feature_id = p_feature_id;
            IF state_gd IS DISTINCT FROM w.geometry_digest AND state_gd IS NOT NULL THEN
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
            VALUES (p_layer, p_feature_id, new_key, v_res, v_point, facts.bbox, w.row_version, w.geometry_digest,
                    w.properties_digest, new_version, p_event_type, p_key)
            ON CONFLICT (layer, feature_id) DO UPDATE  -- a row left by a feature deleted by hand
               SET routing_key = EXCLUDED.routing_key, h3_resolution = EXCLUDED.h3_resolution,
                   routing_point = EXCLUDED.routing_point, bbox = EXCLUDED.bbox, previous_routing_key = NULL,
                   previous_h3_resolution = NULL, previous_routing_point = NULL, previous_bbox = NULL,
                   row_version = EXCLUDED.row_version, geometry_digest = EXCLUDED.geometry_digest,
                   properties_digest = EXCLUDED.properties_digest, version = EXCLUDED.version,
                   last_event = EXCLUDED.last_event;
            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer, geometry_digest, properties_digest,
                                feature_key)
            VALUES (p_feature_id, new_version, p_event_type, new_key, p_layer, w.geometry_digest, w.properties_digest, p_key);
        ELSE
            WITH st AS (
                UPDATE feature_state s
                   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
                       previous_routing_point = s.routing_point, previous_bbox = s.bbox,
                       routing_key = coalesce(new_key, s.routing_key),
                       h3_resolution = CASE WHEN new_key IS NULL THEN s.h3_resolution ELSE v_res END,
                       routing_point = coalesce(v_point, s.routing_point),
                       bbox = coalesce(facts.bbox, s.bbox),
                       row_version = w.row_version,
                       geometry_digest = w.geometry_digest, properties_digest = w.properties_digest,
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
                   w.geometry_digest, w.properties_digest, p_key FROM st;
            GET DIAGNOSTICS n = ROW_COUNT;
            IF n = 0 THEN
                RAISE EXCEPTION 'feature % of layer % has no routing state', v_key, p_layer USING ERRCODE = 'XX000';
            END IF;
        END IF;
    END IF;

    -- Tile expiry (sql/tiles.sql): a layer attached to an expire output keeps this edit's shapes.
    -- (`expires`: the built-in layer's outbox INSERT looked it up, a user layer's registry read.)
    IF expires THEN
        PERFORM _tile_keep(currval('outbox_id_seq'), ST_AsBinary(g), p_layer, p_feature_id, p_event_type,
                           CASE WHEN user_layer THEN w.properties_digest ELSE md5('()')::uuid END);
    END IF;
    IF _wake_relay_for(p_feature_id) IS NULL THEN END IF;  -- sets the owning relay worker's latch if and when this commits
    RETURN new_version;
END
$$;

-- The built-in layer's two forms, GeoJSON text and geometry: C entry points (src/edit/entry.rs) that
-- run the edit most applications make most, a valid EPSG:4326 shape moved, themselves
-- (src/edit/moved.rs: _edit's steps for that case, with the same checks, statements and rows,
-- without a PL/pgSQL call and its pinned search_path; issue 51), as the extension's owner, and hand
-- anything else to _edit. Regression test 32_moved_fast_path holds both paths' rows equal.
CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry text, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_built_in_geojson';
COMMENT ON FUNCTION edit_feature(bigint, text, text) IS
    'Writes an edit of the built-in layer features and its outbox row in the caller''s transaction. geometry: GeoJSON '
    'geometry (RFC 7946, WGS84 unless crs says otherwise); event_type: created | moved | updated | retired. Returns the new version.';

CREATE OR REPLACE FUNCTION edit_feature(feature_id bigint, geometry geometry, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_built_in_geometry';
COMMENT ON FUNCTION edit_feature(bigint, geometry, text) IS
    'Writes an edit of the built-in layer features and its outbox row in the caller''s transaction. geometry: any known '
    'SRID, transformed to 4326; event_type: created | moved | updated | retired. Returns the new version.';

-- A user layer's forms, and record_edit: C entry points (src/edit/entry.rs, one symbol each, which
-- states what it runs) that record the calling role, then run _edit (or _record_edit) as the
-- extension's owner. The row is written with
-- the caller's own rights; the outbox row, which no role may write directly, as the owner.
CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id bigint, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_geojson';
COMMENT ON FUNCTION edit_feature(text, bigint, text, text, jsonb) IS
    'Writes an edit of a layer''s row and its outbox row in the caller''s transaction. geometry: GeoJSON (RFC 7946), '
    'stored in the column''s SRID; NULL keeps the current one (updated, retired). event_type: created | moved | updated '
    '| retired. properties: registered columns to set. Returns the new version.';

CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id bigint, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_geometry';
COMMENT ON FUNCTION edit_feature(text, bigint, geometry, text, jsonb) IS
    'Writes an edit of a layer''s row and its outbox row in the caller''s transaction. geometry: any known SRID, stored '
    'in the column''s SRID; NULL keeps the current one (updated, retired). event_type: created | moved | updated | '
    'retired. properties: registered columns to set. Returns the new version.';

CREATE OR REPLACE FUNCTION record_edit(layer text, feature_id bigint, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_record_edit';

-- The same forms for a layer keyed by uuid or text (0.3.0). A text key is converted to the id
-- column's type (22P02 when it does not fit), so text serves every layer, integer ones included.
CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id text, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_text_key_geojson';
CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id text, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_text_key_geometry';
CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id uuid, geometry text, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_uuid_key_geojson';
CREATE OR REPLACE FUNCTION edit_feature(layer text, feature_id uuid, geometry geometry, event_type text,
                             properties jsonb DEFAULT NULL) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_edit_uuid_key_geometry';
CREATE OR REPLACE FUNCTION record_edit(layer text, feature_id text, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_record_edit_text_key';
CREATE OR REPLACE FUNCTION record_edit(layer text, feature_id uuid, event_type text) RETURNS integer
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_record_edit_uuid_key';
COMMENT ON FUNCTION edit_feature(text, text, text, text, jsonb) IS
    'edit_feature(layer, ...) for a layer keyed by uuid or text: the key as the application stores it (any id type, as text).';
COMMENT ON FUNCTION edit_feature(text, text, geometry, text, jsonb) IS
    'edit_feature(layer, ...) for a layer keyed by uuid or text: the key as the application stores it (any id type, as text).';
COMMENT ON FUNCTION edit_feature(text, uuid, text, text, jsonb) IS 'edit_feature(layer, ...) for a layer keyed by uuid.';
COMMENT ON FUNCTION edit_feature(text, uuid, geometry, text, jsonb) IS 'edit_feature(layer, ...) for a layer keyed by uuid.';
COMMENT ON FUNCTION record_edit(text, text, text) IS 'record_edit for a layer keyed by uuid or text (any id type, as text).';
COMMENT ON FUNCTION record_edit(text, uuid, text) IS 'record_edit for a layer keyed by uuid.';

CREATE OR REPLACE FUNCTION _record_edit(layer text, feature_id bigint, event_type text) RETURNS integer
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN _record_edit_key(layer, feature_id::text, event_type);
END
$$;

-- The type a layer's statements cast a key (given as text) to: bigint for the integer types, whose
-- key is the feature's number, else the id column's own type (uuid, text, character varying).
CREATE OR REPLACE FUNCTION _key_cast(id_type regtype) RETURNS text
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
CREATE OR REPLACE FUNCTION _feature_number(lay layer_registry, p_key text, OUT number bigint, OUT canonical text)
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
CREATE OR REPLACE FUNCTION _edit_key(p_layer text, p_key text, p_geom geometry, p_event_type text, p_wkb bytea,
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
CREATE OR REPLACE FUNCTION _record_edit_key(layer text, key text, event_type text) RETURNS integer
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
            HINT = 'Call record_edit after the application''s own INSERT or UPDATE of the row, in the same transaction. To retire a feature, do not DELETE the row: record_edit(layer, id, ''retired'') deletes it and records the event.';
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
COMMENT ON FUNCTION record_edit(text, bigint, text) IS
    'Records the event of a row the application wrote itself in this transaction: sets its version (1 for created, +1 '
    'otherwise) and writes the outbox row, routed on the row''s geometry. retired deletes the row when the layer has no '
    'retired_column. Returns the new version. Refuses (55000) a row this transaction did not write since its last event.';
