-- Drift: rows of a layer that differ from what their last event told subscribers, because something
-- wrote them outside edit_feature and record_edit (a plain UPDATE, INSERT or DELETE, a bulk load).
-- Every event records digests of the row as written (outbox and feature_state: geometry_digest,
-- properties_digest); drift() compares each row with its feature's, one pass over the layer in id
-- order, a chunk at a time, and resync() writes the events that are missing.
--
-- It cannot see a write that a later edit of the same row overwrote: that edit's event carries the
-- row as it then was, so subscribers end up right, but the intermediate state was never announced.

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

-- One chunk of the pass: the layer's rows with ids above p_after, p_limit of them in id order (read
-- as the caller, with its rights), and the state rows of the same id range. next_after: the last id
-- read when the chunk was full, NULL when the table is done.
CREATE FUNCTION __drift_rows(lay layer_registry, p_after bigint, p_limit integer,
                             OUT next_after bigint, OUT ids bigint[], OUT changes text[])
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    rid bigint[];
    rgd uuid[];
    rpd uuid[];
    rlive boolean[];
BEGIN
    IF lay.layer = 'features' THEN
        SELECT array_agg(f.id ORDER BY f.id), array_agg(f.gd ORDER BY f.id), array_agg(f.pd ORDER BY f.id),
               array_agg(f.live ORDER BY f.id)
          INTO rid, rgd, rpd, rlive
          FROM (SELECT f.id, md5(ST_AsEWKB(f.geom))::uuid AS gd, md5('()')::uuid AS pd, f.retired_at IS NULL AS live
                  FROM features f WHERE f.id > p_after ORDER BY f.id LIMIT p_limit) f;
    ELSE
        SELECT array_agg(x[1]::bigint ORDER BY x[1]::bigint), array_agg(x[2]::uuid ORDER BY x[1]::bigint),
               array_agg(x[3]::uuid ORDER BY x[1]::bigint), array_agg(x[4]::boolean ORDER BY x[1]::bigint)
          INTO rid, rgd, rpd, rlive
          FROM _as_caller_rows(format('SELECT t.%1$I::text, %2$s, (%3$s)::text FROM %4$s t WHERE t.%1$I > $1[1] ORDER BY t.%1$I LIMIT $1[2]',
                                      lay.id_column, _row_digests_sql(lay.geometry_column, lay.properties::text[]),
                                      CASE WHEN lay.retired_column IS NULL THEN 'true'
                                           ELSE format('t.%I IS NULL', lay.retired_column) END,
                                      lay.tbl),
                               ARRAY[p_after, p_limit]) x;
    END IF;
    IF coalesce(cardinality(rid), 0) >= p_limit THEN
        next_after := rid[cardinality(rid)];
    END IF;
    SELECT array_agg(c.id ORDER BY c.id), array_agg(c.change ORDER BY c.id) INTO ids, changes
      FROM (SELECT coalesce(u.id, s.feature_id) AS id,
                   __drift_change(s.feature_id IS NOT NULL, s.last_event, s.geometry_digest, s.properties_digest,
                                  u.gd, u.pd, u.live) AS change
              FROM unnest(rid, rgd, rpd, rlive) u(id, gd, pd, live)
              FULL JOIN (SELECT * FROM feature_state s
                          WHERE s.layer = lay.layer AND s.feature_id > p_after
                            AND (next_after IS NULL OR s.feature_id <= next_after)) s ON s.feature_id = u.id) c
     WHERE c.change IS NOT NULL;
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
-- Returns {next id to start after (NULL: done), then id, change, id, change, ...}.
CREATE FUNCTION __drift_chunk(p_layer text, p_after bigint, p_limit integer, p_found bigint) RETURNS text[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry := __drift_layer(p_layer, 'feature_outbox.drift(text)');
    d record;
BEGIN
    d := __drift_rows(lay, p_after, p_limit);
    IF d.next_after IS NULL THEN
        UPDATE layer_registry l SET drift_rows = p_found + coalesce(cardinality(d.ids), 0), drift_checked_at = now()
         WHERE l.layer = p_layer;
    END IF;
    RETURN ARRAY[d.next_after::text]
           || coalesce((SELECT array_agg(v ORDER BY i, k) FROM unnest(d.ids, d.changes) WITH ORDINALITY u(id, change, i),
                               LATERAL (VALUES (1, u.id::text), (2, u.change)) p(k, v)), '{}');
END
$$;

CREATE FUNCTION _drift_chunk(layer text, after bigint, chunk integer, found bigint) RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _drift_chunk(text, bigint, integer, bigint) IS
    'One chunk of drift(); callable only by roles that may execute drift.';

CREATE FUNCTION drift(layer text) RETURNS TABLE (feature_id bigint, change text)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    after bigint := -9223372036854775808;
    found bigint := 0;
    r text[];
BEGIN
    LOOP
        r := feature_outbox._drift_chunk(layer, after, 1000, found);
        FOR i IN 1 .. (cardinality(r) - 1) / 2 LOOP
            feature_id := r[2 * i]::bigint;
            change := r[2 * i + 1];
            found := found + 1;
            RETURN NEXT;
        END LOOP;
        EXIT WHEN r[1] IS NULL;
        after := r[1]::bigint;
    END LOOP;
END
$$;
COMMENT ON FUNCTION drift(text) IS
    'The rows of a layer that differ from their last event, read as the caller in one pass (1,000 rows a chunk): '
    'change is geometry, properties or both (digests differ), no_event (a live row without one), gone (deleted or '
    'retired without a retired event) or unknown (last event written before 0.3.0). Records the count in '
    'backlog_by_layer.drifted_rows. EXECUTE is not granted to PUBLIC.';

-- The body of one resync() chunk, run as the extension's owner by the C entry _resync_chunk. Scans
-- p_limit rows above p_after; locks the drifted ones (SKIP LOCKED: a row an edit holds is left for
-- a later run), and writes each one's missing event until p_hold_ms / 2 have passed since the
-- locks were taken, so that no editor waits longer than about p_hold_ms. p_left: rows left by the
-- chunks before. Returns {next id to start after (NULL: done), events written, rows left}.
CREATE FUNCTION __resync_chunk(p_layer text, p_after bigint, p_limit integer, p_hold_ms integer, p_left bigint)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry := __drift_layer(p_layer, 'feature_outbox.resync(text, integer, bigint, bigint)');
    d record;
    v_res integer := current_setting('feature_outbox.h3_resolution')::integer;
    lid bigint[];         -- the locked rows: ids, geometries (HEXEWKB), digests and liveness
    lgeom text[];
    lgd uuid[];
    lpd uuid[];
    llive boolean[];
    lver integer[];
    present bigint[];     -- drifted rows that exist but could not be locked
    s feature_state;
    k integer;            -- the row's position in lid
    change text;
    id bigint;
    locked_at timestamptz;
    written bigint := 0;
    left_over bigint := 0;
    next_after bigint;
BEGIN
    IF p_layer = 'features' THEN
        RAISE EXCEPTION 'resync serves user layers' USING ERRCODE = '0A000',
            HINT = 'Only a superuser can write feature_outbox.features outside edit_feature: repair a row with edit_feature(id, geometry, ''moved'').';
    END IF;
    IF p_hold_ms IS NULL OR p_hold_ms < 1 THEN
        RAISE EXCEPTION 'max_hold_ms must be at least 1, not %', coalesce(p_hold_ms::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer));
    d := __drift_rows(lay, p_after, p_limit);
    next_after := d.next_after;
    IF cardinality(d.ids) > 0 THEN
        locked_at := clock_timestamp();
        -- The rows, locked as edits lock them (the row, then its state), read again under the lock:
        -- an edit that committed since the scan may have sent the event already.
        SELECT coalesce(array_agg(x[1]::bigint), '{}'), array_agg(x[2]), array_agg(x[3]::uuid), array_agg(x[4]::uuid),
               array_agg(x[5]::boolean), array_agg(x[6]::integer)
          INTO lid, lgeom, lgd, lpd, llive, lver
          FROM _as_caller_rows(
                   format('SELECT t.%1$I::text, ST_AsHEXEWKB(t.%2$I), %3$s, (%4$s)::text, t.%6$I::text FROM %5$s t WHERE t.%1$I = ANY($1) ORDER BY t.%1$I FOR UPDATE OF t SKIP LOCKED',
                          lay.id_column, lay.geometry_column, _row_digests_sql(lay.geometry_column, lay.properties::text[]),
                          CASE WHEN lay.retired_column IS NULL THEN 'true' ELSE format('t.%I IS NULL', lay.retired_column) END,
                          lay.tbl, lay.version_column), d.ids) x;
        present := ARRAY(SELECT x[1]::bigint FROM _as_caller_rows(format('SELECT t.%1$I::text FROM %2$s t WHERE t.%1$I = ANY($1)',
                                                                         lay.id_column, lay.tbl),
                                                                  ARRAY(SELECT i FROM unnest(d.ids) i WHERE i <> ALL(lid))) x);
        FOREACH id IN ARRAY d.ids LOOP
            IF clock_timestamp() - locked_at > make_interval(secs => p_hold_ms / 2000.0) THEN
                next_after := id - 1;  -- the rest in the next chunk, after this one commits
                EXIT;
            END IF;
            IF id = ANY(present) THEN  -- an edit holds it: that edit's event, or a later run, covers it
                left_over := left_over + 1;
                CONTINUE;
            END IF;
            k := array_position(lid, id);
            SELECT * INTO s FROM feature_state f WHERE f.layer = p_layer AND f.feature_id = id FOR UPDATE;
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
                         WHERE f.layer = p_layer AND f.feature_id = id;
                        CONTINUE;
                    END IF;
                    change := 'geometry';
                END IF;
                CASE change
                    WHEN 'no_event' THEN PERFORM _edit(p_layer, id, lgeom[k]::geometry, 'created', NULL, NULL, true);
                    WHEN 'geometry', 'both' THEN PERFORM _edit(p_layer, id, lgeom[k]::geometry, 'moved', NULL, NULL, true);
                    WHEN 'properties' THEN PERFORM _edit(p_layer, id, NULL, 'updated', NULL, NULL, true);
                    ELSE  -- gone
                        IF k IS NOT NULL THEN  -- retired by hand: the event, as record_edit writes it
                            PERFORM _edit(p_layer, id, NULL, 'retired', NULL, NULL, true);
                        ELSE                   -- deleted: nothing to write but the event
                            UPDATE feature_state f
                               SET previous_routing_key = f.routing_key, previous_h3_resolution = f.h3_resolution,
                                   previous_routing_point = f.routing_point, previous_bbox = f.bbox,
                                   version = f.version + 1, last_event = 'retired', row_version = NULL,
                                   geometry_digest = NULL, properties_digest = NULL
                             WHERE f.layer = p_layer AND f.feature_id = id;
                            INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key,
                                                layer, previous_bbox)
                            VALUES (id, s.version + 1, 'retired', s.routing_key,
                                    CASE WHEN s.h3_resolution = v_res THEN s.routing_key
                                         ELSE _h3_cell(s.routing_point[1], s.routing_point[2], v_res) END,
                                    p_layer, s.bbox);
                            PERFORM _wake_relay_for(id);
                        END IF;
                END CASE;
                written := written + 1;
            EXCEPTION WHEN OTHERS THEN
                IF SQLSTATE IN ('57014', '57P01', '40P01') THEN  -- cancel, shutdown, deadlock: stop
                    RAISE;
                END IF;
                RAISE WARNING 'resync of feature % of layer % failed: %', id, p_layer, SQLERRM
                    USING HINT = 'Repair the row, then CALL feature_outbox.resync again.';
                left_over := left_over + 1;
            END;
        END LOOP;
    END IF;
    IF next_after IS NULL THEN
        UPDATE layer_registry l SET drift_rows = p_left + left_over, drift_checked_at = now() WHERE l.layer = p_layer;
    END IF;
    RETURN ARRAY[next_after, written, left_over];
END
$$;

CREATE FUNCTION _resync_chunk(layer text, after bigint, chunk integer, max_hold_ms integer, left_over bigint) RETURNS bigint[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_entry';
COMMENT ON FUNCTION _resync_chunk(text, bigint, integer, integer, bigint) IS
    'One chunk of resync(); callable only by roles that may execute resync.';

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT. Every name in it is
-- schema-qualified or a built-in.
CREATE PROCEDURE resync(layer text, max_hold_ms integer DEFAULT 100, INOUT written bigint DEFAULT NULL,
                        INOUT left_over bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    after bigint := -9223372036854775808;
    r bigint[];
BEGIN
    written := 0;
    left_over := 0;
    LOOP
        r := feature_outbox._resync_chunk(layer, after, 200, max_hold_ms, left_over);
        written := written + r[2];
        left_over := left_over + r[3];
        COMMIT;
        EXIT WHEN r[1] IS NULL;
        after := r[1];
    END LOOP;
END
$$;
COMMENT ON PROCEDURE resync(text, integer, bigint, bigint) IS
    'Writes the missing event of every row drift() lists (created for no_event, moved for geometry or both, updated for '
    'properties, retired for gone), with correct previous routing keys, committing in chunks that hold an edit back at '
    'most about max_hold_ms milliseconds. Returns the events written, and left_over: rows an edit held or that were '
    'refused (each with a WARNING). CALL it outside a transaction block. EXECUTE is not granted to PUBLIC.';
