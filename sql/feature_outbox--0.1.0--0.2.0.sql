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

-- created on a retired id says that ids are not reused, instead of "send a moved event".
CREATE OR REPLACE FUNCTION _edit(p_feature_id bigint, p_geom geometry, p_event_type text) RETURNS integer
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
          FROM outbox o
         WHERE o.published_at IS NULL) u
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
