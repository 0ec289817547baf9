-- retry_parked() requeues every parked, unpublished row for a fresh round of max_attempts
-- (attempts keeps the history) and returns how many; replay_published(since, layer) requeues rows
-- published at or after since, with their event_ids, for a sink that lost them. Both are the
-- operator's: not PUBLIC's (42501), and a refusal requeues nothing.
CREATE TABLE public.sites (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('sites', 'public.sites');
SELECT feature_outbox.edit_feature(i, '{"type":"Point","coordinates":[1,1]}', 'created') FROM generate_series(1, 4) i \g /dev/null
SELECT feature_outbox.edit_feature('sites', i, '{"type":"Point","coordinates":[1,1]}', 'created') FROM generate_series(1, 3) i \g /dev/null
-- As the relay leaves them: two parked after failures, one published an hour ago, two a minute ago.
UPDATE feature_outbox.outbox SET parked_at = now(), attempts = 10, row_failures = 10, last_error = 'HTTP 400',
                                 next_attempt_at = NULL WHERE layer = 'features' AND feature_id IN (1, 2);
UPDATE feature_outbox.outbox SET published_at = now() - interval '1 hour' WHERE layer = 'features' AND feature_id = 3;
UPDATE feature_outbox.outbox SET published_at = now() - interval '1 minute' WHERE layer = 'sites' AND feature_id IN (1, 2);
CREATE FUNCTION outbox_state() RETURNS TABLE (layer text, feature_id bigint, published boolean, parked boolean, attempts int, row_failures int)
LANGUAGE sql AS $$
    SELECT layer, feature_id, published_at IS NOT NULL, parked_at IS NOT NULL, attempts, row_failures
      FROM feature_outbox.outbox ORDER BY layer, feature_id
$$;
SELECT * FROM outbox_state();
SELECT parked_rows, unpublished_rows FROM feature_outbox.backlog;

-- Not PUBLIC's: an ordinary role, and a monitoring role, are refused and requeue nothing.
CREATE ROLE regress_parked_plain;
CREATE ROLE regress_parked_monitor IN ROLE pg_monitor;
SET ROLE regress_parked_plain;
SELECT try($$SELECT feature_outbox.retry_parked()$$);
SELECT try($$SELECT feature_outbox.replay_published(now() - interval '1 day')$$);
SET ROLE regress_parked_monitor;
SELECT try($$SELECT feature_outbox.retry_parked()$$);
SELECT try($$SELECT feature_outbox.replay_published(now() - interval '1 day')$$);
RESET ROLE;
SELECT parked_rows, unpublished_rows FROM feature_outbox.backlog;

-- The operator requeues the parked, unpublished rows only; attempts keep the history.
SELECT feature_outbox.retry_parked();
SELECT * FROM outbox_state();
SELECT feature_outbox.retry_parked() AS again;

-- Replay: of one layer since a time, then of every layer.
SELECT try($$SELECT feature_outbox.replay_published(NULL)$$);
SELECT feature_outbox.replay_published(now() - interval '90 seconds', 'sites');
SELECT feature_outbox.replay_published(now() - interval '1 day', 'nosuch');
SELECT * FROM outbox_state();
SELECT feature_outbox.replay_published(now() - interval '1 day');
SELECT count(*) FILTER (WHERE published_at IS NOT NULL) AS still_published, count(DISTINCT event_id) AS event_ids_kept FROM feature_outbox.outbox;

-- Granted explicitly, a role may.
GRANT EXECUTE ON FUNCTION feature_outbox.retry_parked() TO regress_parked_plain;
UPDATE feature_outbox.outbox SET parked_at = now() WHERE layer = 'features' AND feature_id = 4;
SET ROLE regress_parked_plain;
SELECT feature_outbox.retry_parked();
RESET ROLE;
DROP OWNED BY regress_parked_plain, regress_parked_monitor;
DROP ROLE regress_parked_plain, regress_parked_monitor;
