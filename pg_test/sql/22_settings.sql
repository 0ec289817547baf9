-- Settings that end up in a NATS subject, or that only a reload may change, are checked when set:
-- a value that would break a subject (whitespace, a control character, *, >, an empty token) is
-- refused with 22023 and a detail saying why, before it can reach the relay; so are event types
-- that are no event type. A sighup setting cannot be SET in a session (55P02). Nothing changes.
SHOW feature_outbox.nats_subject_prefix;
SELECT to_json(v) AS prefix, try_detail(format('SET feature_outbox.nats_subject_prefix = %L', v)) AS refused
  FROM unnest(ARRAY['', 'a b', 'a..b', '.a', 'a.', 'a.*', 'a.>', E'a\r\nb', E'tab\there']) v;
-- The same in the configuration.
\set VERBOSITY sqlstate
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = '';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = 'a b';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = 'a..b';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = 'a.*';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = 'a.>';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = E'a\r\nb';
ALTER SYSTEM SET feature_outbox.nats_subject_prefix = E'tab\there';
ALTER SYSTEM SET feature_outbox.nats_object_bucket = 'a.b';
\set VERBOSITY default
SET feature_outbox.nats_subject_prefix = 'acme.gis';
SHOW feature_outbox.nats_subject_prefix;
RESET feature_outbox.nats_subject_prefix;
-- A bucket name NATS would refuse is refused when set, not at the first large event.
SELECT try_detail($$SET feature_outbox.nats_object_bucket = 'a.b'$$);
SHOW feature_outbox.nats_object_bucket;

-- Event types that would break a subject are no event types.
SELECT to_json(v) AS event_type, try(format('SELECT feature_outbox.edit_feature(5, %L, %L)', '{"type":"Point","coordinates":[1,2]}', v)) AS refused
  FROM unnest(ARRAY['moved ', 'mo ved', 'moved.x', '*', '>', E'moved\r\nPUB x 1', 'MOVED']) v;
SELECT left(try(format('SELECT feature_outbox.edit_feature(5, %L, %L)', '{"type":"Point","coordinates":[1,2]}', repeat('a', 1000000))), 30) AS a_megabyte_event_type;
SELECT written();

-- Subject resolutions: strictly ascending H3 resolutions, set in the configuration only.
SHOW feature_outbox.subject_resolutions;
\set VERBOSITY sqlstate
ALTER SYSTEM SET feature_outbox.subject_resolutions = '5,3';
\set VERBOSITY default
ALTER SYSTEM SET feature_outbox.subject_resolutions = '5,3';
ALTER SYSTEM SET feature_outbox.subject_resolutions = '3,3';
ALTER SYSTEM SET feature_outbox.subject_resolutions = '3,16';
ALTER SYSTEM SET feature_outbox.subject_resolutions = 'x';
ALTER SYSTEM SET feature_outbox.subject_resolutions = '-1';
SELECT try('SET feature_outbox.subject_resolutions = ''4''');
SHOW feature_outbox.subject_resolutions;
-- Other relay settings a session cannot change.
SELECT try('SET feature_outbox.batch_size = 1');
SELECT try('SET feature_outbox.subject_format = ''0.1''');
SELECT try('SET feature_outbox.relay_workers = 2');
-- Values out of their range, and policies that do not exist.
SELECT try('SET feature_outbox.invalid_geometry = fix');
SELECT try('SET feature_outbox.ddl_guard = maybe');
