-- The backlog view: one row, age never negative, cost independent of retained published history.
SELECT unpublished_rows, oldest_unpublished_at, oldest_unpublished_age, last_published_at FROM feature_outbox.backlog;

SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%s,45]}', i % 170), 'created')
  FROM generate_series(1, 3) i \g /dev/null
SELECT unpublished_rows, oldest_unpublished_age >= interval '0' AS age_not_negative,
       oldest_unpublished_at <= now() AS at_not_in_future, last_published_at FROM feature_outbox.backlog;
-- Nothing parked: no parked age (a zero would read as "parked just now"). One parked row: its age.
SELECT parked_rows, oldest_parked_age FROM feature_outbox.backlog;
UPDATE feature_outbox.outbox SET parked_at = now() - interval '5 minutes', row_failures = 10 WHERE feature_id = 3;
SELECT parked_rows, oldest_parked_age >= interval '5 minutes' AS parked_age_counts,
       unpublished_rows, oldest_unpublished_age < interval '5 minutes' AS parked_row_not_in_unpublished_age
  FROM feature_outbox.backlog;
UPDATE feature_outbox.outbox SET parked_at = NULL, row_failures = 0 WHERE feature_id = 3;

-- 100k published rows of history, then the plan: the partial index, no sequential scan of the outbox.
INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key, published_at, created_at, layer)
SELECT i, 1, 'created', '8800000000fffff', now() - interval '1 hour', now() - interval '2 hours', 'features'
  FROM generate_series(100, 100099) i;
ANALYZE feature_outbox.outbox;
SELECT unpublished_rows, last_published_at = (SELECT max(published_at) FROM feature_outbox.outbox) AS last_published FROM feature_outbox.backlog;
CREATE FUNCTION plan_of(q text) RETURNS SETOF text LANGUAGE plpgsql AS $$
DECLARE l text;
BEGIN
    FOR l IN EXECUTE 'EXPLAIN ' || q LOOP RETURN NEXT l; END LOOP;
END $$;
SELECT count(*) FILTER (WHERE l LIKE '%Seq Scan on outbox%') AS seq_scans_of_outbox,
       count(*) FILTER (WHERE l LIKE '%outbox_unpublished%') > 0 AS uses_partial_index
  FROM plan_of('SELECT * FROM feature_outbox.backlog') l;

-- backlog_by_cell: the rows per H3 parent of their routing key, from the same partial index.
SELECT layer, cell, unpublished_rows FROM feature_outbox.backlog_by_cell(5);
SELECT layer, cell, unpublished_rows FROM feature_outbox.backlog_by_cell(0);
-- EXPLAIN cannot see into a function, so count what a call reads: the unpublished rows' index and
-- heap pages (its plan is cached after the call above), where a scan of the 100k published rows
-- reads over a thousand.
CREATE FUNCTION buffers_of(q text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE p json;
BEGIN
    EXECUTE 'EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ' || q INTO p;
    RETURN (p->0->'Plan'->>'Shared Hit Blocks')::bigint + (p->0->'Plan'->>'Shared Read Blocks')::bigint;
END $$;
-- The measure sees into a function: one that scans the history reads it all.
CREATE FUNCTION history_rows() RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN RETURN (SELECT count(*) FROM feature_outbox.outbox); END $$;
SELECT history_rows();
SELECT buffers_of('SELECT * FROM feature_outbox.backlog_by_cell(5)') < 20 AS by_cell_reads_only_unpublished,
       buffers_of('SELECT * FROM history_rows()') > 1000 AS a_function_scanning_the_history_reads_more;
