-- Monitoring: the backlog view, one row per relay worker, Prometheus text, and requeueing parked rows.

-- The backlog in one row. Its cost follows the unpublished rows (partial index) and one index probe
-- for last_published_at, never the retained published history. Alert on the age (guide, gotcha 4).
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
       h.held_for AS vacuum_held_for,
       -- Not NULL while this database is held as a copy of another (sql/identity.sql): its rows
       -- wait for resolve_copy(), which the text names. They are held, not failing. On a standby
       -- it says that the relay starts at promotion (0.5.0).
       _relay_held() AS relay_held_reason,
       -- 0.5.0: the workers a primary runs here (feature_outbox.relay_workers when the relay serves
       -- this database, else 0), so that "fewer running than configured" needs no number of its own.
       _relay_workers_configured() AS relay_workers_configured
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

CREATE OR REPLACE VIEW workers AS
SELECT w.worker, w.pid, w.state, w.relayed_rows, w.duplicate_acks, w.failed_attempts, w.last_active_at, w.last_error,
       w.last_error_at, w.sink_up, w.sink_errors, w.sink_last_success_at,
       -- 0.5.0: the standby gate (feature_outbox.standby_slots, wait_for_synchronous_standbys).
       g.standby_waiting_on, g.standby_wait_bytes, g.standby_wait_seconds, g.standby_held_batches,
       g.standby_unconfirmed_batches
  FROM _relay_workers() w LEFT JOIN _relay_standby_gate() g ON g.worker = w.worker;
COMMENT ON VIEW workers IS 'One row per relay background worker serving this database; counters since server start.';

-- Prometheus exposition text (version 0.0.4): the guide's metrics and the relay's health.
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
                  coalesce(extract(epoch FROM b.vacuum_held_for), 0)),
                 (8, 'outbox_relay_held', '1 while this database is held as a copy of another: its rows wait for resolve_copy().',
                  (b.relay_held_reason IS NOT NULL AND NOT pg_is_in_recovery())::integer),
                 -- 0.5.0: the server's role, and the workers a primary runs here, so that a rule can
                 -- say "fewer running than configured, on a primary" without a number of its own.
                 (9, 'outbox_server_in_recovery', '1 while this server is a standby (in recovery): no relay runs until it is promoted, and no sink series is reported.',
                  pg_is_in_recovery()::integer),
                 (10, 'outbox_relay_workers_configured', 'Relay workers this server runs for this database as a primary (feature_outbox.relay_workers when the relay serves it, else 0).',
                  b.relay_workers_configured)) AS g(ord, name, help, value)),
        -- Sink health per relay worker (0.4.0): "NATS down, no edits" shows within one poll interval.
        -- A standby's workers have no sink yet (sink_up NULL): no sample, rather than one that reads
        -- as down; likewise no last-success sample before a first success.
        '# HELP outbox_sink_up 1 when the worker''s sink is connected and working as last seen (each poll interval when idle; for HTTP the last request).',
        '# TYPE outbox_sink_up gauge',
        (SELECT string_agg(format('outbox_sink_up{%s,worker="%s"} %s', l.db, w.worker, w.sink_up::integer), E'\n' ORDER BY w.worker)
           FROM _relay_workers() w WHERE w.sink_up IS NOT NULL),
        '# HELP outbox_sink_errors_total Sink-level failures (failed connects, outages) of the worker since server start.',
        '# TYPE outbox_sink_errors_total counter',
        (SELECT string_agg(format('outbox_sink_errors_total{%s,worker="%s"} %s', l.db, w.worker, w.sink_errors), E'\n' ORDER BY w.worker)
           FROM _relay_workers() w WHERE w.sink_up IS NOT NULL),
        '# HELP outbox_sink_last_success_timestamp_seconds Unix time the worker''s sink last worked (connect, acknowledged batch, idle check); no sample before the first.',
        '# TYPE outbox_sink_last_success_timestamp_seconds gauge',
        (SELECT string_agg(format('outbox_sink_last_success_timestamp_seconds{%s,worker="%s"} %s', l.db, w.worker,
                                  round(extract(epoch FROM w.sink_last_success_at), 3)), E'\n' ORDER BY w.worker)
           FROM _relay_workers() w WHERE w.sink_last_success_at IS NOT NULL AND w.sink_up IS NOT NULL),
        -- The standby gate per relay worker (0.5.0): what a batch waits for, and since when; the
        -- gauges are 0 while nothing waits, so a rule sees a wait end. None on a standby.
        '# HELP outbox_standby_wait_bytes Bytes of WAL the standby a worker''s batch waits on still lacks; 0 when none waits, -1 while that standby cannot confirm at all (its slot missing, logical or invalidated, or not connected).',
        '# TYPE outbox_standby_wait_bytes gauge',
        (SELECT string_agg(format('outbox_standby_wait_bytes{%s,worker="%s"} %s', l.db, g.worker,
                                  CASE WHEN g.standby_waiting_on IS NULL THEN 0 ELSE coalesce(g.standby_wait_bytes, -1) END), E'\n' ORDER BY g.worker)
           FROM _relay_standby_gate() g WHERE g.standby_held_batches IS NOT NULL),
        '# HELP outbox_standby_waiting_on 1 for the standby a worker''s batch waits on ("slot <name>" or "standby <application_name>"); no sample while none waits.',
        '# TYPE outbox_standby_waiting_on gauge',
        (SELECT string_agg(format('outbox_standby_waiting_on{%s,worker="%s",standby="%s"} 1', l.db, g.worker,
                                  replace(replace(g.standby_waiting_on, E'\\', E'\\\\'), '"', E'\\"')), E'\n' ORDER BY g.worker)
           FROM _relay_standby_gate() g WHERE g.standby_waiting_on IS NOT NULL),
        '# HELP outbox_standby_wait_seconds How long the worker''s current batch has waited for standbys to confirm its WAL; 0 when none waits.',
        '# TYPE outbox_standby_wait_seconds gauge',
        (SELECT string_agg(format('outbox_standby_wait_seconds{%s,worker="%s"} %s', l.db, g.worker,
                                  round(coalesce(g.standby_wait_seconds, 0)::numeric, 3)), E'\n' ORDER BY g.worker)
           FROM _relay_standby_gate() g WHERE g.standby_held_batches IS NOT NULL),
        '# HELP outbox_standby_held_batches_total Batches and tile chunks that waited for standbys to confirm their WAL, since server start.',
        '# TYPE outbox_standby_held_batches_total counter',
        (SELECT string_agg(format('outbox_standby_held_batches_total{%s,worker="%s"} %s', l.db, g.worker, g.standby_held_batches), E'\n' ORDER BY g.worker)
           FROM _relay_standby_gate() g WHERE g.standby_held_batches IS NOT NULL),
        '# HELP outbox_standby_unconfirmed_batches_total Batches and tile chunks published unconfirmed by a standby after feature_outbox.standby_wait_timeout, since server start.',
        '# TYPE outbox_standby_unconfirmed_batches_total counter',
        (SELECT string_agg(format('outbox_standby_unconfirmed_batches_total{%s,worker="%s"} %s', l.db, g.worker, g.standby_unconfirmed_batches), E'\n' ORDER BY g.worker)
           FROM _relay_standby_gate() g WHERE g.standby_held_batches IS NOT NULL),
        -- Capture of direct writes (0.5.0, sql/capture.sql): no sample while no layer is captured.
        -- Lag in bytes is WAL written since the slot's confirmed position; in seconds, since the
        -- worker last had read every committed change. Retained WAL grows while it is behind or
        -- stopped, up to max_slot_wal_keep_size.
        -- HELP and TYPE always, as for the sinks' series; a sample only while a layer is captured.
        (SELECT string_agg(concat_ws(E'\n', format('# HELP %s %s', g.name, g.help), format('# TYPE %s %s', g.name, g.kind),
                                     CASE WHEN c.state <> 'off' AND NOT pg_is_in_recovery()
                                          THEN format('%s{%s} %s', g.name, l.db, g.value) END),
                           E'\n' ORDER BY g.ord)
           FROM capture c,
                LATERAL (VALUES
                 (1, 'outbox_capture_lag_bytes', 'WAL written since the capture slot''s confirmed position; -1 without a slot.', 'gauge',
                  coalesce(c.lag_bytes, -1)::numeric),
                 (2, 'outbox_capture_lag_seconds', 'Seconds since the capture worker last had read every committed change.', 'gauge',
                  round(coalesce(c.lag_seconds, 0)::numeric, 3)),
                 (3, 'outbox_capture_retained_wal_bytes', 'WAL the capture slot keeps on disk.', 'gauge',
                  coalesce(c.retained_wal_bytes, 0)::numeric),
                 (4, 'outbox_capture_running', '1 while the capture worker runs with its slot.', 'gauge',
                  (c.pid IS NOT NULL AND c.state NOT IN ('no slot', 'slot invalidated', 'retrying'))::integer),
                 (5, 'outbox_capture_events_total', 'Events the capture worker wrote since server start.', 'counter',
                  coalesce(c.events, 0)),
                 (6, 'outbox_capture_refused_rows_total', 'Captured rows whose event the edit path refused (a WARNING each), since server start.', 'counter',
                  coalesce(c.refused, 0))) AS g(ord, name, help, kind, value)),
        -- Expire outputs (0.4.0, sql/tiles.sql): one sample per output (and zoom); none without outputs.
        '# HELP outbox_expire_tiles_total Tiles an expire output delivered, by zoom (each batch''s tiles merged first).',
        '# TYPE outbox_expire_tiles_total counter',
        (SELECT string_agg(format('outbox_expire_tiles_total{%s,output="%s",zoom="%s"} %s', l.db, e.output, z.i - 1, z.n), E'\n'
                           ORDER BY e.output, z.i)
           FROM expire_backlog e, unnest(e.tiles_by_zoom) WITH ORDINALITY z(n, i) WHERE z.i - 1 BETWEEN e.minzoom AND e.maxzoom),
        '# HELP outbox_expire_lists_sent_total Tile lists an expire output sent (NATS messages, HTTP requests).',
        '# TYPE outbox_expire_lists_sent_total counter',
        (SELECT string_agg(format('outbox_expire_lists_sent_total{%s,output="%s"} %s', l.db, e.output, coalesce(e.lists_sent, 0)), E'\n' ORDER BY e.output)
           FROM expire_backlog e),
        '# HELP outbox_expire_waiting_edits Edits whose tiles an expire output has yet to deliver.',
        '# TYPE outbox_expire_waiting_edits gauge',
        (SELECT string_agg(format('outbox_expire_waiting_edits{%s,output="%s"} %s', l.db, e.output, e.waiting_edits), E'\n' ORDER BY e.output)
           FROM expire_backlog e),
        '# HELP outbox_expire_oldest_waiting_age_seconds Age of the oldest edit whose tiles an expire output has yet to deliver; 0 when none.',
        '# TYPE outbox_expire_oldest_waiting_age_seconds gauge',
        (SELECT string_agg(format('outbox_expire_oldest_waiting_age_seconds{%s,output="%s"} %s', l.db, e.output,
                                  coalesce(round(extract(epoch FROM e.oldest_waiting_age), 3), 0)), E'\n' ORDER BY e.output)
           FROM expire_backlog e),
        '# HELP outbox_expire_fallbacks_total Shapes expired by a limit or fallback: over max_tiles_geometry (boundary), zooms dropped past it (dropped_zooms), an old shape never kept (box).',
        '# TYPE outbox_expire_fallbacks_total counter',
        (SELECT string_agg(format('outbox_expire_fallbacks_total{%s,output="%s",kind="%s"} %s', l.db, e.output, k.kind, k.n), E'\n'
                           ORDER BY e.output, k.kind)
           FROM expire_backlog e, LATERAL (VALUES ('boundary', coalesce(e.boundary_fallbacks, 0)), ('box', coalesce(e.box_fallbacks, 0)),
                                                  ('dropped_zooms', coalesce(e.dropped_zooms, 0))) k(kind, n))
    ) || E'\n'
      FROM backlog b, _relay_status() s,
           LATERAL (SELECT format('database="%s"',
                                  replace(replace(replace(current_database(), E'\\', E'\\\\'), '"', E'\\"'), E'\n', E'\\n'))) AS l(db)
$$;
COMMENT ON FUNCTION metrics() IS 'Prometheus exposition text: outbox_rows_relayed_total{event_type}, outbox_unpublished_rows, ages, outbox_relay_held, outbox_server_in_recovery, outbox_relay_workers_configured, per worker outbox_sink_up, outbox_sink_errors_total, outbox_sink_last_success_timestamp_seconds, outbox_standby_wait_bytes, outbox_standby_waiting_on, outbox_standby_wait_seconds, outbox_standby_held_batches_total, outbox_standby_unconfirmed_batches_total, outbox_capture_* while a layer is captured, and per expire output outbox_expire_*.';

-- Monitoring roles read the backlog and the workers: members of pg_monitor, PostgreSQL's own role
-- for monitoring. Nothing in them is secret (errors never carry credentials).
-- The backlog per layer, with the backlog view's columns. Registered layers always have a row; a
-- layer unregistered since has one while rows of it wait. last_published_at walks the published
-- rows by time until it meets the layer's newest one.
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
       reg.held_reason,
       -- The whole database held as a copy of another (the backlog view's column).
       b.relay_held_reason,
       b.relay_workers_configured,
       -- A captured layer's slot lag (the capture view's): NULL while the layer is not captured.
       CASE WHEN reg.captured_at IS NOT NULL THEN c.lag_bytes END AS capture_lag_bytes,
       CASE WHEN reg.captured_at IS NOT NULL THEN c.lag_seconds END AS capture_lag_seconds
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
 CROSS JOIN backlog b
 CROSS JOIN capture c;
COMMENT ON VIEW backlog_by_layer IS 'The backlog view''s columns, one row per layer.';

GRANT SELECT ON backlog, workers, backlog_by_layer, capture TO pg_monitor;

-- Every database the relay serves on this server, from shared memory (issue: many databases). Like
-- the workers view it is for monitoring roles only.
CREATE OR REPLACE VIEW relay_databases AS
SELECT database, state, relay_workers, workers_running, worker_states, unpublished, unpublished_at,
       last_error, last_error_at
  FROM _relay_databases();
COMMENT ON VIEW relay_databases IS 'Each database the relay serves on this server: its workers, state, last error and unpublished rows.';
REVOKE ALL ON FUNCTION _relay_databases() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION _relay_databases() TO pg_monitor;
GRANT SELECT ON relay_databases TO pg_monitor;

-- The backlog by area: unpublished, unparked rows per layer and H3 parent of their routing key at
-- `resolution`. Its cost follows the unpublished rows (the partial index, from the low-water mark
-- up: below it every row is published or parked), never the published history.
CREATE OR REPLACE FUNCTION backlog_by_cell(resolution integer DEFAULT 5)
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

-- Requeues parked rows for a fresh round of feature_outbox.max_attempts (attempts keeps the history).
-- Returns how many.
CREATE OR REPLACE FUNCTION retry_parked() RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    n bigint;
BEGIN
    UPDATE outbox SET parked_at = NULL, next_attempt_at = NULL, row_failures = 0
     WHERE parked_at IS NOT NULL AND published_at IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    -- Edits whose tiles a destination refused (tile_queue, sql/tiles.sql): queued again as well.
    WITH t AS (UPDATE tile_queue SET parked_at = NULL, attempts = 0 WHERE parked_at IS NOT NULL RETURNING 1)
    SELECT n + count(*) INTO n FROM t;
    IF n > 0 THEN
        PERFORM _relay_low_water_reset();  -- the rows are below the claim's low-water mark
        PERFORM _wake_relay_at_commit();
    END IF;
    RETURN n;
END
$$;
COMMENT ON FUNCTION retry_parked() IS 'Requeues parked outbox rows, and edits whose tiles a destination refused, for another max_attempts round; returns how many of both. EXECUTE is not granted to PUBLIC.';

-- Publishes again the rows published since `since` (of one layer, or all): for a sink that lost
-- messages it had acknowledged (a JetStream cluster that lost its stream's tail, a restored backup
-- of a webhook receiver). Same event_ids: consumers deduplicate. Only rows retention has not
-- deleted yet can be replayed (feature_outbox.retention). Returns how many.
CREATE OR REPLACE FUNCTION replay_published(since timestamptz, layer text DEFAULT NULL) RETURNS bigint
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
