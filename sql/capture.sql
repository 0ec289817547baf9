-- Capture (0.5.0): events for writes made outside edit_feature and record_edit (QGIS, ogr2ogr, psql,
-- migrations), read from a logical replication slot with the built-in pgoutput plugin, without
-- triggers. A captured layer's table is in the publication feature_outbox_capture (its key columns
-- only); the outbox's inserts are in feature_outbox_capture_edits, so that the worker can tell the
-- application's own edits (a transaction that wrote the outbox row of that feature) from the rest.
-- The capture worker (src/capture/) reads the slot a chunk at a time and writes the missing events
-- through __repair_row, resync's path (sql/drift.sql), under a replication origin of its own, so
-- that its writes (the version bump) are not read back as new changes. One slot, one origin and the
-- publications per database; the slot and origin are named after the database's OID.

-- The names of this database's slot and replication origin (both cluster-wide, hence the OID).
CREATE OR REPLACE FUNCTION _capture_slot_name() RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT 'feature_outbox_capture_' || d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database()
$$;

-- The columns a captured table publishes: its replica identity's and the id column. pgoutput needs
-- the replica identity's columns in a column list, or the table's UPDATE and DELETE fail; under
-- REPLICA IDENTITY FULL every column is published (NULL: no list). Raises 55000, naming the table,
-- when the replica identity cannot name a deleted row's id.
CREATE OR REPLACE FUNCTION _capture_columns(lay layer_registry) RETURNS name[]
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    ident "char" := (SELECT c.relreplident FROM pg_catalog.pg_class c WHERE c.oid = lay.tbl);
    cols name[];
BEGIN
    IF ident = 'f' THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(a.attname ORDER BY k.n) INTO cols
      FROM pg_catalog.pg_index i
      CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, n)
      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = lay.tbl AND ((ident = 'd' AND i.indisprimary) OR (ident = 'i' AND i.indisreplident));
    IF cols IS NULL OR NOT lay.id_column = ANY(cols) THEN
        RAISE EXCEPTION 'table % of layer % has no primary key or replica identity that includes its id column %',
                        lay.tbl, lay.layer, quote_ident(lay.id_column) USING ERRCODE = '55000',
            DETAIL = 'A captured DELETE names its row by the replica identity (PostgreSQL''s logical replication rule).',
            HINT = format('ALTER TABLE %s ADD PRIMARY KEY (%I), or ALTER TABLE %s REPLICA IDENTITY USING INDEX on a unique index of %I.',
                          lay.tbl, lay.id_column, lay.tbl, lay.id_column);
    END IF;
    RETURN cols;
END
$$;

-- Whether a captured table's publication still covers its replica identity, as pgoutput needs for
-- the table's UPDATE and DELETE to run (the DDL guard asks after each ALTER TABLE).
CREATE OR REPLACE FUNCTION _capture_identity_published(lay layer_registry) RETURNS boolean
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    wanted name[];
    listed name[];
BEGIN
    BEGIN
        wanted := _capture_columns(lay);
    EXCEPTION WHEN object_not_in_prerequisite_state THEN
        RETURN false;  -- no identity that names the id column any more
    END;
    SELECT ARRAY(SELECT a.attname FROM unnest(r.prattrs::int2[]) k(attnum)
                   JOIN pg_catalog.pg_attribute a ON a.attrelid = r.prrelid AND a.attnum = k.attnum)
      INTO listed
      FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
     WHERE p.pubname = 'feature_outbox_capture' AND r.prrelid = lay.tbl;
    IF NOT FOUND THEN
        RETURN true;  -- not published (yet): nothing to cover
    END IF;
    -- No column list publishes every column; FULL needs exactly that.
    RETURN CASE WHEN wanted IS NULL THEN cardinality(listed) = 0
                ELSE cardinality(listed) = 0 OR wanted <@ listed END;
END
$$;

-- Everything capture_layer checks before it changes anything. p_layer must be registered, a user
-- layer, not captured (unless its slot is gone: a restored copy, or a slot dropped by hand), and
-- the server must run wal_level = logical. A slot of this database's name that is not pgoutput's on
-- this database belongs to another tool: 42710.
CREATE OR REPLACE FUNCTION _capture_check(p_layer text) RETURNS layer_registry
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    lay layer_registry := _registered_layer(p_layer);
    slot record;
BEGIN
    IF p_layer = 'features' THEN
        RAISE EXCEPTION 'the built-in layer features is not captured' USING ERRCODE = '0A000',
            HINT = 'Only edit_feature writes feature_outbox.features (and a superuser); capture serves user layers.';
    END IF;
    IF NOT _relay_preloaded() THEN
        RAISE EXCEPTION 'capture needs feature_outbox in shared_preload_libraries' USING ERRCODE = '55000',
            HINT = 'Its worker reads the slot: add feature_outbox to shared_preload_libraries and restart the server.';
    END IF;
    IF current_setting('wal_level') <> 'logical' THEN
        RAISE EXCEPTION 'capture needs wal_level = logical, not %', current_setting('wal_level') USING ERRCODE = '55000',
            HINT = 'ALTER SYSTEM SET wal_level = logical, then restart the server: the setting takes effect only at start.';
    END IF;
    IF _relay_workers_configured() = 0 THEN
        RAISE EXCEPTION 'capture needs the relay to serve database %', current_database() USING ERRCODE = '55000',
            DETAIL = 'The capture worker is started with the relay workers; none runs for this database.',
            HINT = 'Name it in feature_outbox.database (or *) and set feature_outbox.relay_workers above 0.';
    END IF;
    PERFORM _capture_columns(lay);
    SELECT s.slot_type, s.plugin, s.database, s.active_pid INTO slot
      FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = _capture_slot_name();
    IF FOUND AND (slot.slot_type <> 'logical' OR slot.plugin <> 'pgoutput' OR slot.database <> current_database()) THEN
        RAISE EXCEPTION 'replication slot % exists and is not this extension''s', _capture_slot_name() USING ERRCODE = '42710',
            DETAIL = format('It is a %s slot%s.', slot.slot_type,
                            CASE WHEN slot.slot_type = 'logical' THEN format(' of plugin %s on database %s', slot.plugin, slot.database) ELSE '' END),
            HINT = 'Drop it with pg_drop_replication_slot if nothing uses it; capture names its slot after the database''s OID.';
    END IF;
    IF lay.captured_at IS NOT NULL AND FOUND THEN
        RAISE EXCEPTION 'layer % is captured already', p_layer USING ERRCODE = '42710',
            HINT = 'uncapture_layer stops it.';
    END IF;
    RETURN lay;
END
$$;

-- Step 1 of capture_layer, committed before the slot exists: the publications, and the layer's
-- table in them. pgoutput reads a publication in the catalog as it was when each decoded
-- transaction began, so it must exist before the slot does (else decoding fails for good).
CREATE OR REPLACE FUNCTION _capture_publish(p_layer text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    lay layer_registry := _capture_check(p_layer);
    cols name[] := _capture_columns(lay);
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = 'feature_outbox_capture') THEN
        -- Through a partitioned table's root: its events name the registered table.
        CREATE PUBLICATION feature_outbox_capture WITH (publish = 'insert, update, delete, truncate', publish_via_partition_root = true);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication p WHERE p.pubname = 'feature_outbox_capture_edits') THEN
        -- The application's edits, by their outbox rows: which feature each transaction recorded.
        CREATE PUBLICATION feature_outbox_capture_edits WITH (publish = 'insert');
    END IF;
    -- Added whenever missing: pg_dump keeps the publication but not an extension table's place in
    -- it, so a restored copy has it empty (and would send the application's edits twice).
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
                    WHERE p.pubname = 'feature_outbox_capture_edits' AND r.prrelid = 'feature_outbox.outbox'::regclass) THEN
        ALTER PUBLICATION feature_outbox_capture_edits ADD TABLE feature_outbox.outbox (id, feature_id, layer, feature_key);
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
                    WHERE p.pubname = 'feature_outbox_capture' AND r.prrelid = lay.tbl) THEN
        EXECUTE format('ALTER PUBLICATION feature_outbox_capture ADD TABLE %s%s', lay.tbl,
                       CASE WHEN cols IS NOT NULL THEN format(' (%s)', (SELECT string_agg(quote_ident(c), ', ') FROM unnest(cols) c)) ELSE '' END);
    END IF;
END
$$;

-- Step 2, in a transaction that has written nothing yet (PostgreSQL's rule for a new logical
-- slot): the slot, if there is none; a failover slot on PostgreSQL 17 and later, so that capture
-- goes on after a promotion. Returns true when it created it. Waits for the transactions running
-- now to end, as every new logical slot does.
CREATE OR REPLACE FUNCTION _capture_create_slot() RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    -- Held until commit: the worker drops the slot of a database without captured layers only
    -- under it (src/capture/slot.rs), so not the one made here before the layer is marked.
    PERFORM pg_advisory_xact_lock(1179601241, 1129338964);
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = _capture_slot_name()) THEN
        RETURN false;
    END IF;
    IF current_setting('server_version_num')::integer >= 170000 THEN
        EXECUTE 'SELECT pg_catalog.pg_create_logical_replication_slot($1, ''pgoutput'', false, false, true)' USING _capture_slot_name();
    ELSE
        PERFORM pg_catalog.pg_create_logical_replication_slot(_capture_slot_name(), 'pgoutput');
    END IF;
    RETURN true;
END
$$;

-- Step 3: the replication origin the worker writes under, and the layer marked captured.
CREATE OR REPLACE FUNCTION _capture_mark(p_layer text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    IF pg_catalog.pg_replication_origin_oid(_capture_slot_name()) IS NULL THEN
        PERFORM pg_catalog.pg_replication_origin_create(_capture_slot_name());
    END IF;
    UPDATE layer_registry l SET captured_at = now() WHERE l.layer = p_layer;
END
$$;

-- A layer out of the publication, when it is not captured (capture_layer failed after step 1, or
-- uncapture_layer); the slot too when no layer is captured and it is not in use (else the worker
-- drops it once it sees none).
CREATE OR REPLACE FUNCTION _capture_unpublish(p_layer text, p_drop_slot boolean) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    rel regclass := (SELECT l.tbl FROM layer_registry l WHERE l.layer = p_layer);
BEGIN
    IF rel IS NOT NULL AND (SELECT l.captured_at IS NULL FROM layer_registry l WHERE l.layer = p_layer) AND EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
                                    WHERE p.pubname = 'feature_outbox_capture' AND r.prrelid = rel) THEN
        EXECUTE format('ALTER PUBLICATION feature_outbox_capture DROP TABLE %s', rel);
    END IF;
    IF p_drop_slot AND NOT EXISTS (SELECT 1 FROM layer_registry l WHERE l.captured_at IS NOT NULL)
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = _capture_slot_name() AND s.active_pid IS NULL) THEN
        PERFORM pg_catalog.pg_drop_replication_slot(_capture_slot_name());
    END IF;
END
$$;

-- No SET clause and no SECURITY DEFINER: a procedure with either cannot COMMIT, and capture must
-- commit its publication before it creates the slot. Every name in it is schema-qualified. It and
-- its steps are the extension owner's (it makes a replication slot): EXECUTE is not granted to PUBLIC.
CREATE OR REPLACE PROCEDURE capture_layer(layer text)
LANGUAGE plpgsql
AS $$
DECLARE
    created boolean := false;
    failed boolean := false;
    code text;
    message text;
    detail text;
    hint text;
BEGIN
    PERFORM feature_outbox._capture_outside_transaction('capture_layer');
    PERFORM feature_outbox._capture_publish(layer);
    COMMIT;
    BEGIN
        -- Checked again: a concurrent capture_layer or uncapture_layer may have run meanwhile.
        PERFORM feature_outbox._capture_check(layer);
        created := feature_outbox._capture_create_slot();
        PERFORM feature_outbox._capture_mark(layer);
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- A cancel too (statement_timeout while the slot waits for old transactions).
        GET STACKED DIAGNOSTICS code = RETURNED_SQLSTATE, message = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL,
                                hint = PG_EXCEPTION_HINT;
        failed := true;
    END;
    IF failed THEN
        -- Committed before the error is raised again, which would roll the cleanup back with it:
        -- step 1's publication entry must not outlive a failed capture.
        PERFORM feature_outbox._capture_unpublish(layer, created);
        COMMIT;
        PERFORM feature_outbox._capture_raise(code, message, detail, hint);
    END IF;
    COMMIT;
    PERFORM feature_outbox._capture_wake();
END
$$;

-- An error caught by capture_layer, raised again as it was (without its context).
CREATE OR REPLACE FUNCTION _capture_raise(code text, message text, detail text, hint text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF coalesce(detail, '') <> '' AND coalesce(hint, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, DETAIL = detail, HINT = hint;
    ELSIF coalesce(detail, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, DETAIL = detail;
    ELSIF coalesce(hint, '') <> '' THEN
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, HINT = hint;
    ELSE
        RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message;
    END IF;
END
$$;
COMMENT ON PROCEDURE capture_layer(text) IS
    'Starts capture of a user layer: from the commit on, every INSERT, UPDATE, DELETE and TRUNCATE of its table that '
    'edit_feature or record_edit did not record becomes an event (origin captured) within about 100 ms. Needs '
    'wal_level = logical and a primary key or replica identity with the id column. CALL it outside a transaction block.';

CREATE OR REPLACE PROCEDURE uncapture_layer(layer text)
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM feature_outbox._capture_outside_transaction('uncapture_layer');
    PERFORM feature_outbox._uncapture(layer);
    COMMIT;
    PERFORM feature_outbox._capture_wake();
END
$$;
COMMENT ON PROCEDURE uncapture_layer(text) IS
    'Stops capture of a layer: writes committed after it produce no event. The slot is dropped with the last captured layer.';

CREATE OR REPLACE FUNCTION _uncapture(p_layer text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    lay layer_registry := _registered_layer(p_layer);
BEGIN
    PERFORM pg_advisory_xact_lock(1179601241, 1129338964);
    IF lay.captured_at IS NULL AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication_rel r JOIN pg_catalog.pg_publication p ON p.oid = r.prpubid
                                                WHERE p.pubname = 'feature_outbox_capture' AND r.prrelid = lay.tbl) THEN
        RAISE EXCEPTION 'layer % is not captured', p_layer USING ERRCODE = '55000';
    END IF;
    -- Not captured but still published: a capture_layer whose session ended while it waited for
    -- the slot. Taken out of the publication, where it would still constrain the table's UPDATEs.
    UPDATE layer_registry l SET captured_at = NULL WHERE l.layer = p_layer;
    PERFORM _capture_unpublish(p_layer, true);
END
$$;

-- The capture worker's work on one layer: the rows of p_keys (the id column as text) had decoded
-- changes. Each is locked as an edit locks it (waiting for an edit that holds it) and compared with
-- what its last event said; a difference is written as resync writes it: created, moved, updated or
-- retired, the version column bumped. p_after_edit: those of them written again after the
-- application's edit in their transaction, for which only a move or a deletion is written (the
-- edit's event carries the row's properties as the relay reads them, not its new routing key).
-- Returns {written, same, refused}. All rows in one subtransaction; when the edit path refuses a
-- row, it is rolled back and the rows done again one subtransaction each (__repair_row with a
-- hint), so that only that row goes without its event.
CREATE OR REPLACE FUNCTION __capture_rows(p_layer text, p_keys text[], p_after_edit text[]) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry;
    keyed boolean;
    r record;
    numbers bigint[];
    k integer;
    done bigint[];
BEGIN
    SELECT * INTO lay FROM layer_registry l WHERE l.layer = p_layer AND l.captured_at IS NOT NULL;
    IF NOT FOUND THEN  -- uncaptured or unregistered since the change: nothing to write
        RETURN ARRAY[0, 0, 0];
    END IF;
    keyed := _key_cast(lay.id_type) <> 'bigint';
    PERFORM pg_advisory_xact_lock_shared(1179601241, hashtext(p_layer));
    p_keys := ARRAY(SELECT DISTINCT u FROM unnest(p_keys) u ORDER BY u);
    IF keyed THEN
        numbers := ARRAY(SELECT f.feature_id FROM unnest(p_keys) WITH ORDINALITY u(k, i)
                           LEFT JOIN feature_keys f ON f.layer = p_layer AND f.feature_key = u.k ORDER BY u.i);
    END IF;
    FOR attempt IN 1 .. 2 LOOP
        BEGIN
            done := ARRAY[0, 0, 0];
            r := __lock_rows(lay, p_keys, false);
            FOR j IN 1 .. cardinality(p_keys) LOOP
                k := array_position(r.keys, p_keys[j]);
                CASE __repair_row(lay, p_keys[j], CASE WHEN keyed THEN numbers[j] ELSE p_keys[j]::bigint END, k IS NOT NULL,
                                  r.geoms[k], r.gds[k], r.pds[k], r.lives[k], r.versions[k],
                                  CASE WHEN attempt = 2 THEN 'write it again' END,
                                  p_keys[j] = ANY(coalesce(p_after_edit, '{}')))
                    WHEN 'written' THEN done[1] := done[1] + 1;
                    WHEN 'same' THEN done[2] := done[2] + 1;
                    ELSE done[3] := done[3] + 1;
                END CASE;
            END LOOP;
            RETURN done;
        EXCEPTION WHEN OTHERS THEN
            -- Cancel, shutdown, deadlock, lock timeout, serialization failure: stop, as __repair_row does.
            IF attempt = 2 OR SQLSTATE IN ('57014', '57P01', '40P01', '55P03', '40001') THEN
                RAISE;
            END IF;
        END;
    END LOOP;
END
$$;

-- The worker calls this C entry (src/edit/entry.rs), which records the worker's role for the row
-- reads, then runs __capture_rows as the extension's owner.
CREATE OR REPLACE FUNCTION _capture_rows(layer text, keys text[], after_edit text[]) RETURNS bigint[]
LANGUAGE c VOLATILE
AS 'MODULE_PATHNAME', 'feature_outbox_capture_rows';

-- A captured TRUNCATE: every feature of the layer whose last event says it exists.
CREATE OR REPLACE FUNCTION _capture_truncated(p_layer text) RETURNS bigint[]
LANGUAGE sql VOLATILE
AS $$
    SELECT _capture_rows(p_layer, ARRAY(SELECT coalesce(s.feature_key, s.feature_id::text) FROM feature_state s
                                         WHERE s.layer = p_layer AND s.last_event IS DISTINCT FROM 'retired'), '{}')
$$;

-- What capture is doing in this database: its slot, worker, figures and how far it is behind.
-- lag_bytes: WAL written since the slot's confirmed position; lag_seconds: since the worker last
-- had read every committed change; retained_wal_bytes: WAL the slot keeps on disk (see
-- max_slot_wal_keep_size).
CREATE OR REPLACE VIEW capture AS
SELECT _capture_slot_name() AS slot_name,
       CASE WHEN NOT EXISTS (SELECT 1 FROM layer_registry l WHERE l.captured_at IS NOT NULL) THEN 'off'
            WHEN s.slot_name IS NULL THEN 'no slot'
            WHEN s.wal_status = 'lost' THEN 'slot invalidated'
            ELSE coalesce(w.state, 'starting') END AS state,
       ARRAY(SELECT l.layer FROM layer_registry l WHERE l.captured_at IS NOT NULL ORDER BY l.layer) AS layers,
       w.pid,
       CASE WHEN s.slot_name IS NOT NULL AND NOT pg_catalog.pg_is_in_recovery()
            THEN pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint END AS lag_bytes,
       CASE WHEN s.slot_name IS NOT NULL THEN coalesce(extract(epoch FROM clock_timestamp() - w.caught_up_at)::float8, 0) END AS lag_seconds,
       CASE WHEN s.slot_name IS NOT NULL AND NOT pg_catalog.pg_is_in_recovery()
            THEN pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_lsn(), s.restart_lsn)::bigint END AS retained_wal_bytes,
       s.wal_status,
       w.events, w.refused, w.last_error, w.last_error_at
  FROM (SELECT 1) one
  LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name = _capture_slot_name()
  LEFT JOIN _capture_status() w ON true;
COMMENT ON VIEW capture IS 'Capture of direct writes in this database: state, captured layers, worker, slot lag in bytes and seconds, retained WAL, events written and rows refused.';
