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
CREATE OR REPLACE FUNCTION __drift_change(has_state boolean, last_event text, state_gd uuid, state_pd uuid,
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
CREATE OR REPLACE FUNCTION __drift_rows(lay layer_registry, p_phase integer, p_after text, p_limit integer,
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
CREATE OR REPLACE FUNCTION __drift_layer(p_layer text, what text) RETURNS layer_registry
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF NOT has_function_privilege(_caller_role(), what, 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied for %', what USING ERRCODE = '42501',
            HINT = format('GRANT EXECUTE ON %s TO the role, as the extension''s owner.', what);
    END IF;
    RETURN _registered_layer(p_layer);
END
$$;

-- The body of one drift() chunk, run as the extension's owner by the C entry _drift_chunk.
-- p_found: rows found by the chunks before; the last chunk records the total in layer_registry.
-- Returns {next phase (NULL: done), next position, then key, change, key, change, ...}.
CREATE OR REPLACE FUNCTION __drift_chunk(p_layer text, p_phase integer, p_after text, p_limit integer, p_found bigint) RETURNS text[]
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

CREATE OR REPLACE FUNCTION _drift_chunk(layer text, phase integer, after text, chunk integer, found bigint) RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_drift_chunk';
COMMENT ON FUNCTION _drift_chunk(text, integer, text, integer, bigint) IS
    'One chunk of drift(); callable only by roles that may execute drift.';

CREATE OR REPLACE FUNCTION drift(layer text) RETURNS TABLE (feature_id text, change text)
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
-- Locks the rows of p_keys as edits lock them (the row first, its state later) and reads them under
-- the lock, as the extension's owner would see them with the caller's rights: key, geometry
-- (HEXEWKB), digests, liveness (not retired) and version, in key order. p_skip: SKIP LOCKED (resync
-- leaves a row an edit holds for later); else wait for the edit (capture must not lose the change).
-- FOR NO KEY UPDATE, the lock an edit's UPDATE takes: FOR UPDATE also waited for the KEY SHARE lock
-- of a foreign key's check (a long transaction inserting a row that references this one), and
-- every editor of a row locked before it in the batch waited with it.
-- A key without a row is absent from the result.
CREATE OR REPLACE FUNCTION __lock_rows(lay layer_registry, p_keys text[], p_skip boolean,
                            OUT keys text[], OUT geoms text[], OUT gds uuid[], OUT pds uuid[], OUT lives boolean[],
                            OUT versions integer[])
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    SELECT coalesce(array_agg(x[1]), '{}'), array_agg(x[2]), array_agg(x[3]::uuid), array_agg(x[4]::uuid),
           array_agg(x[5]::boolean), array_agg(x[6]::integer)
      INTO keys, geoms, gds, pds, lives, versions
      FROM _as_caller_rows(
               format('SELECT t.%1$I::text, ST_AsHEXEWKB(t.%2$I), %3$s, (%4$s)::text, t.%6$I::text FROM %5$s t WHERE t.%1$I = ANY($1::%7$s[]) ORDER BY t.%1$I FOR NO KEY UPDATE OF t%8$s',
                      lay.id_column, lay.geometry_column, _row_digests_sql(lay.geometry_column, lay.properties::text[]),
                      CASE WHEN lay.retired_column IS NULL THEN 'true' ELSE format('t.%I IS NULL', lay.retired_column) END,
                      lay.tbl, lay.version_column, _key_cast(lay.id_type), CASE WHEN p_skip THEN ' SKIP LOCKED' ELSE '' END),
               p_keys) x;
END
$$;

-- Writes the event that makes what subscribers last heard of one row equal to the row: resync's
-- repair of a drifted row, and the capture worker's of a decoded change (sql/capture.sql). The
-- caller has locked the row; p_found: it exists, then p_geom (HEXEWKB), p_gd and p_pd (its digests),
-- p_live (not retired) and p_version describe it. p_number: the feature's number, NULL for a key
-- without events. Returns 'written', 'same' (nothing differs, or a pre-0.3.0 state took the row's
-- digests) or 'refused' (the edit path refused the row, said in a WARNING with p_hint). With p_hint
-- NULL a refusal is raised to the caller instead: no subtransaction per row (each costs about a
-- fifth of a captured row's work, and a MultiXact for every row the caller locked), for a caller
-- that runs a whole chunk in one and does it again row by row, with a hint, when it fails.
-- p_moves_only: only a moved geometry or a gone row counts as a difference (capture, after the
-- application's edit of the row in the same transaction).
CREATE OR REPLACE FUNCTION __repair_row(lay layer_registry, p_key text, p_number bigint, p_found boolean, p_geom text,
                             p_gd uuid, p_pd uuid, p_live boolean, p_version integer, p_hint text,
                             p_moves_only boolean DEFAULT false) RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    s feature_state;
    change text;
BEGIN
    SELECT * INTO s FROM feature_state f WHERE f.layer = lay.layer AND f.feature_id = p_number FOR UPDATE;
    IF s.last_event = 'retired' AND p_found AND p_live THEN
        -- A row written again under a retired feature's id: ids of retired features are not reused
        -- (edit_feature refuses it too), so subscribers hear nothing of it. Said, not skipped quietly.
        RAISE WARNING 'feature % of layer % was retired, and its id is written again: no event', p_key, lay.layer
            USING HINT = 'Ids of retired features are not reused: give the row a new id.';
        RETURN 'refused';
    END IF;
    change := __drift_change(s.layer IS NOT NULL, s.last_event, s.geometry_digest, s.properties_digest, p_gd, p_pd,
                             CASE WHEN p_found THEN p_live END);
    IF change IS NULL OR (p_moves_only AND change NOT IN ('geometry', 'both', 'gone')) THEN
        RETURN 'same';
    END IF;
    IF p_hint IS NULL THEN
        RETURN __repair_event(lay, s, change, p_key, p_found, p_geom, p_gd, p_pd, p_version);
    END IF;
    BEGIN
        RETURN __repair_event(lay, s, change, p_key, p_found, p_geom, p_gd, p_pd, p_version);
    EXCEPTION WHEN OTHERS THEN
        -- Cancel, shutdown, deadlock, lock timeout, serialization failure: stop, and try again later.
        IF SQLSTATE IN ('57014', '57P01', '40P01', '55P03', '40001') THEN
            RAISE;
        END IF;
        RAISE WARNING 'the event of feature % of layer % was refused: %', p_key, lay.layer, SQLERRM
            USING HINT = format('Repair the row, then %s.', p_hint);
        RETURN 'refused';
    END;
END
$$;

-- __repair_row's write of the event for `change` (__drift_change's), s being the feature's state
-- (locked): 'written', or 'same' when a pre-0.3.0 state only takes the row's digests.
CREATE OR REPLACE FUNCTION __repair_event(lay layer_registry, s feature_state, change text, p_key text, p_found boolean,
                               p_geom text, p_gd uuid, p_pd uuid, p_version integer) RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_res integer;
BEGIN
    IF change = 'unknown' THEN
        -- Last event before 0.3.0: no digests to compare. The geometry is the one it
        -- routed on when its bounding box still matches; take the digests then, else move.
        IF (SELECT bool_and(abs(q.b - s.bbox[q.j]) < 1e-7)
              FROM unnest((_inspect_geometry(ST_AsBinary(ST_Transform(p_geom::geometry, 4326)), true, 4326, NULL)).bbox)
                   WITH ORDINALITY q(b, j)) THEN
            UPDATE feature_state f SET geometry_digest = p_gd, properties_digest = p_pd,
                                       version = p_version, last_event = 'baseline'
             WHERE f.layer = lay.layer AND f.feature_id = s.feature_id;
            RETURN 'same';
        END IF;
        change := 'geometry';
    END IF;
    CASE change
        WHEN 'no_event' THEN PERFORM _edit_key(lay.layer, p_key, p_geom::geometry, 'created', NULL, NULL, true);
        WHEN 'geometry', 'both' THEN PERFORM _edit_key(lay.layer, p_key, p_geom::geometry, 'moved', NULL, NULL, true);
        WHEN 'properties' THEN PERFORM _edit_key(lay.layer, p_key, NULL, 'updated', NULL, NULL, true);
        ELSE  -- gone
            IF p_found THEN  -- retired by hand: the event, as record_edit writes it
                PERFORM _edit_key(lay.layer, p_key, NULL, 'retired', NULL, NULL, true);
            ELSE             -- deleted: nothing to write but the event
                v_res := current_setting('feature_outbox.h3_resolution')::integer;
                UPDATE feature_state f
                   SET previous_routing_key = f.routing_key, previous_h3_resolution = f.h3_resolution,
                       previous_routing_point = f.routing_point, previous_bbox = f.bbox,
                       version = f.version + 1, last_event = 'retired', row_version = NULL,
                       geometry_digest = NULL, properties_digest = NULL
                 WHERE f.layer = lay.layer AND f.feature_id = s.feature_id;
                INSERT INTO outbox (feature_id, feature_version, event_type, routing_key, previous_routing_key,
                                    layer, previous_bbox, feature_key)
                VALUES (s.feature_id, s.version + 1, 'retired', s.routing_key,
                        CASE WHEN s.h3_resolution = v_res THEN s.routing_key
                             ELSE _h3_cell(s.routing_point[1], s.routing_point[2], v_res) END,
                        lay.layer, s.bbox, s.feature_key);
                PERFORM _tile_keep(currval('outbox_id_seq'), NULL);  -- its tiles, when the layer has an output
                PERFORM _wake_relay_for(s.feature_id);
            END IF;
    END CASE;
    RETURN 'written';
END
$$;

-- drift's chunk at (p_phase, p_after); locks its drifted rows (SKIP LOCKED: a row an edit holds is
-- left for a later run), and writes each one's missing event until p_hold_ms / 2 have passed since
-- the locks were taken, so that no editor waits longer than about p_hold_ms. p_left: rows left by
-- the chunks before. Returns {next phase (NULL: done), next position, events written, rows left}.
CREATE OR REPLACE FUNCTION __resync_chunk(p_layer text, p_phase integer, p_after text, p_limit integer, p_hold_ms integer,
                               p_left bigint) RETURNS text[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry := __drift_layer(p_layer, 'feature_outbox.resync(text, integer, bigint, bigint)');
    v_cast text := _key_cast(lay.id_type);
    keyed boolean := v_cast <> 'bigint';
    d record;
    lkey text[];          -- the locked rows: keys, geometries (HEXEWKB), digests, liveness, versions
    lgeom text[];
    lgd uuid[];
    lpd uuid[];
    llive boolean[];
    lver integer[];
    present text[];       -- drifted rows that exist but could not be locked
    k integer;            -- the row's position in lkey
    j integer;            -- its position in the drift chunk
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
        SELECT * INTO lkey, lgeom, lgd, lpd, llive, lver FROM __lock_rows(lay, d.keys, true);
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
            CASE __repair_row(lay, key, coalesce(d.numbers[j], CASE WHEN NOT keyed THEN key::bigint END), k IS NOT NULL,
                              lgeom[k], lgd[k], lpd[k], llive[k], lver[k], 'CALL feature_outbox.resync again')
                WHEN 'written' THEN written := written + 1;
                WHEN 'refused' THEN left_over := left_over + 1;
                ELSE NULL;
            END CASE;
        END LOOP;
    END IF;
    IF next_phase IS NULL THEN
        UPDATE layer_registry l SET drift_rows = p_left + left_over, drift_checked_at = now() WHERE l.layer = p_layer;
    END IF;
    RETURN ARRAY[next_phase::text, next_after, written::text, left_over::text];
END
$$;

CREATE OR REPLACE FUNCTION _resync_chunk(layer text, phase integer, after text, chunk integer, max_hold_ms integer, left_over bigint)
RETURNS text[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_resync_chunk';
COMMENT ON FUNCTION _resync_chunk(text, integer, text, integer, integer, bigint) IS
    'One chunk of resync(); callable only by roles that may execute resync.';

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT. Every name in it is
-- schema-qualified or a built-in.
CREATE OR REPLACE PROCEDURE resync(layer text, max_hold_ms integer DEFAULT 100, INOUT written bigint DEFAULT NULL,
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
