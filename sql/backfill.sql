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
CREATE OR REPLACE FUNCTION __backfill_state(p_layer text, p_feature_id bigint, shape geometry, v_res integer) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF shape IS NULL OR ST_IsEmpty(shape) THEN
        RETURN;
    END IF;
    INSERT INTO feature_state (layer, feature_id, routing_key, h3_resolution, routing_point, bbox)
    SELECT p_layer, p_feature_id, _h3_cell(ST_X(q), ST_Y(q), v_res), v_res, ARRAY[ST_X(q), ST_Y(q)],
           (_inspect_geometry(ST_AsBinary(shape), true, 4326, NULL)).bbox
      FROM _routing_point(shape) q
    ON CONFLICT (layer, feature_id) DO NOTHING;
EXCEPTION WHEN data_exception THEN
    NULL;
END
$$;

-- The body of one chunk, run as the extension's owner by the C entry _backfill_chunk (which records
-- the calling role, as edit_feature(layer, ...) does). p_after: the last key of the chunk before, as
-- text (NULL at first); chunks follow the id column's own order. Returns {last key looked at (NULL:
-- none left), snapshots written}.
CREATE OR REPLACE FUNCTION __backfill_chunk(p_layer text, p_area geometry, p_after text, p_limit integer) RETURNS text[]
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
    snapshots bigint[];    -- the outbox ids of the snapshots written
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

    WITH written AS (
        INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, layer, geometry_digest, properties_digest,
                            feature_key)
        SELECT s.feature_id, u.version, 'snapshot',
               coalesce(_h3_cell(drifted_points[d.i][1], drifted_points[d.i][2], v_res), s.routing_key), p_layer, u.gd, u.pd,
               CASE WHEN keyed THEN u.k END
          FROM unnest(candidates, versions, gds, pds, ckeys) u(id, version, gd, pd, k)
          JOIN feature_state s ON s.layer = p_layer AND s.feature_id = u.id
          LEFT JOIN unnest(drifted) WITH ORDINALITY d(id, i) ON d.id = u.id
         WHERE u.id = ANY(locked)
         ORDER BY u.id
        RETURNING id
    )
    SELECT array_agg(w.id) INTO snapshots FROM written w;
    n := coalesce(cardinality(snapshots), 0);
    -- A layer with an expire output (sql/tiles.sql): each snapshot expires its feature's tiles, by
    -- its kept shape, or its box where none was kept.
    IF n > 0 AND EXISTS (SELECT 1 FROM expire_rules e WHERE e.layer = p_layer) THEN
        PERFORM _tile_keep(w.id, NULL) FROM unnest(snapshots) w(id);
    END IF;
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

CREATE OR REPLACE FUNCTION _backfill_chunk(layer text, area geometry, after text, chunk integer) RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_backfill_chunk';
COMMENT ON FUNCTION _backfill_chunk(text, geometry, text, integer) IS
    'One chunk of backfill(); callable only by roles that may execute backfill.';

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT. Every name in it is
-- schema-qualified or a built-in.
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
COMMENT ON PROCEDURE backfill(text, geometry, bigint) IS
    'Writes one snapshot event per live feature of a layer whose routing point lies in area (any SRID; NULL: all), '
    'committing every 500 features, and returns their count in written. CALL it outside a transaction block. '
    'EXECUTE is not granted to PUBLIC: snapshots reach every subscriber of the area.';
