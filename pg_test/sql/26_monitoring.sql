-- What monitoring reads: metrics() is Prometheus text (HELP and TYPE for each series, a database
-- label on every sample, a final newline); backlog_by_layer has one row per layer with the backlog's
-- columns; backlog_by_cell counts waiting rows per H3 parent cell and refuses a resolution finer
-- than the keys' own (22023). They are pg_monitor's: an ordinary role is refused (42501), while
-- the layers view is every role's. Values that depend on time or on the relay's workers are masked.
CREATE TABLE public.sites (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('sites', 'public.sites');
SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%s,45]}', i), 'created') FROM generate_series(1, 3) i \g /dev/null
SELECT feature_outbox.edit_feature('sites', i, '{"type":"Point","coordinates":[13.4,52.5]}', 'created') FROM generate_series(1, 2) i \g /dev/null
UPDATE feature_outbox.outbox SET parked_at = now(), row_failures = 10 WHERE layer = 'features' AND feature_id = 3;
UPDATE feature_outbox.outbox SET row_failures = 1 WHERE layer = 'features' AND feature_id = 2;

-- metrics(): the samples, with the values that vary masked.
SELECT right(feature_outbox.metrics(), 1) = E'\n' AS ends_with_newline;
SELECT CASE WHEN l ~ '^outbox_(oldest_unpublished_age_seconds|relay_workers_running|vacuum_held_for_seconds|oldest_parked_age_seconds|sink_up|sink_errors_total|sink_last_success_timestamp_seconds)\{'
            THEN regexp_replace(l, ' \S+$', ' <varies>') ELSE l END AS metrics
  FROM regexp_split_to_table(rtrim(feature_outbox.metrics(), E'\n'), E'\n') WITH ORDINALITY AS m(l, n)
 WHERE l NOT LIKE '# HELP %' ORDER BY n;
SELECT count(*) AS help_lines, count(DISTINCT split_part(l, ' ', 3)) AS series
  FROM regexp_split_to_table(feature_outbox.metrics(), E'\n') l WHERE l LIKE '# HELP %';
SELECT count(*) FILTER (WHERE l NOT LIKE '%{database="' || current_database() || '"%') AS samples_without_the_database_label
  FROM regexp_split_to_table(rtrim(feature_outbox.metrics(), E'\n'), E'\n') l WHERE l NOT LIKE '#%';

-- backlog and backlog_by_layer: the same columns, one row in all and one per layer.
SELECT unpublished_rows, failing_rows, parked_rows, oldest_parked_age >= interval '0' AS parked_age FROM feature_outbox.backlog;
SELECT layer, unpublished_rows, failing_rows, parked_rows, oldest_unpublished_age >= interval '0' AS age,
       drifted_rows, held_since, held_reason
  FROM feature_outbox.backlog_by_layer ORDER BY layer;
-- Every backlog column, in the backlog's order (0.5.0's relay_workers_configured comes last in both).
SELECT (SELECT array_agg(column_name::text ORDER BY ordinal_position) FROM information_schema.columns
         WHERE table_schema = 'feature_outbox' AND table_name = 'backlog')
       = (SELECT array_agg(column_name::text ORDER BY ordinal_position) FROM information_schema.columns
           WHERE table_schema = 'feature_outbox' AND table_name = 'backlog_by_layer'
             AND column_name NOT IN ('layer', 'drifted_rows', 'drift_checked_at', 'held_since', 'held_reason',
                                     'capture_lag_bytes', 'capture_lag_seconds'))
       AS by_layer_has_the_backlog_columns;

-- backlog_by_cell: per layer and parent cell; resolutions finer than the keys' (8) or out of range refused.
SELECT layer, cell, unpublished_rows FROM feature_outbox.backlog_by_cell(3) ORDER BY layer, cell;
SELECT sum(unpublished_rows) AS unparked_unpublished FROM feature_outbox.backlog_by_cell();
SELECT regexp_replace(try($$SELECT * FROM feature_outbox.backlog_by_cell(9)$$), 'routing key [0-9a-f]+''s', 'routing key <key>''s') AS try;
SELECT try($$SELECT * FROM feature_outbox.backlog_by_cell(16)$$);
SELECT try($$SELECT * FROM feature_outbox.backlog_by_cell(-1)$$);
SELECT try($$SELECT * FROM feature_outbox.backlog_by_cell(NULL)$$);

-- Who may read what.
CREATE ROLE regress_mon_plain;
CREATE ROLE regress_mon_monitor IN ROLE pg_monitor;
SELECT r AS role, o AS object,
       CASE WHEN o LIKE '%()' OR o LIKE '%)' THEN has_function_privilege(r, o, 'EXECUTE') ELSE has_table_privilege(r, o, 'SELECT') END AS allowed
  FROM unnest(ARRAY['regress_mon_plain', 'regress_mon_monitor']) r,
       unnest(ARRAY['feature_outbox.layers', 'feature_outbox.backlog', 'feature_outbox.backlog_by_layer', 'feature_outbox.workers',
                    'feature_outbox.relay_databases', 'feature_outbox.outbox', 'feature_outbox.metrics()',
                    'feature_outbox.backlog_by_cell(integer)']) o
 ORDER BY 1, 2;
SET ROLE regress_mon_plain;
SELECT count(*) AS layers_visible FROM feature_outbox.layers;
SELECT try($$SELECT * FROM feature_outbox.backlog$$);
SELECT try($$SELECT * FROM feature_outbox.backlog_by_layer$$);
SELECT try($$SELECT * FROM feature_outbox.workers$$);
SELECT try($$SELECT * FROM feature_outbox.relay_databases$$);
SELECT try($$SELECT feature_outbox.metrics()$$);
SELECT try($$SELECT * FROM feature_outbox.backlog_by_cell()$$);
SET ROLE regress_mon_monitor;
SELECT unpublished_rows FROM feature_outbox.backlog;
SELECT count(*) AS layers FROM feature_outbox.backlog_by_layer;
SELECT count(*) AS cells FROM feature_outbox.backlog_by_cell();
SELECT feature_outbox.metrics() LIKE '%outbox_unpublished_rows{database="' || current_database() || '"} 5%' AS metrics_readable;
SELECT try($$SELECT * FROM feature_outbox.outbox$$);
RESET ROLE;
DROP ROLE regress_mon_plain, regress_mon_monitor;
