-- feature_outbox.traceparent and tracestate carry the writer's W3C trace context into the outbox
-- rows of the edits that follow. A malformed value is refused when set (22023, with a detail saying
-- what is wrong), by SET LOCAL and set_config alike, and the refusal rolls back the edit of its
-- transaction: nothing written. A configuration file cannot hold one (ALTER SYSTEM: 55P02).
CREATE FUNCTION traced_edit(setting text, value text, how text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    PERFORM feature_outbox.edit_feature(99001, '{"type":"Point","coordinates":[1,1]}', 'created');
    IF how = 'set local' THEN
        EXECUTE format('SET LOCAL feature_outbox.%I = %L', setting, value);
    ELSE
        PERFORM set_config('feature_outbox.' || setting, value, true);
    END IF;
    RETURN 'ok';
END $$;
CREATE FUNCTION refused(setting text, value text, how text) RETURNS text LANGUAGE sql AS $$
    SELECT regexp_replace(try_detail(format('SELECT traced_edit(%L, %L, %L)', setting, value, how)),
                          '^22023: invalid value for parameter "feature_outbox.' || setting || '": ".*"\n  DETAIL: ', '22023 ')
$$;

SELECT v AS traceparent, refused('traceparent', v, 'set local') AS set_local, refused('traceparent', v, 'set_config') = refused('traceparent', v, 'set local') AS set_config_same
  FROM unnest(ARRAY['00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01',
                    '00-00000000000000000000000000000000-00f067aa0ba902b7-01',
                    '00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01',
                    'ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01',
                    '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra',
                    '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7',
                    '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1',
                    '4bf92f3577b34da6a3ce929d0e0e4736']) v;
SELECT left(v, 40) AS tracestate, refused('tracestate', v, 'set local') AS set_local, refused('tracestate', v, 'set_config') = refused('tracestate', v, 'set local') AS set_config_same
  FROM unnest(ARRAY['congo', 'Congo=x', 'congo=', 'congo=a,congo=b',
                    (SELECT string_agg('k' || i || '=v', ',') FROM generate_series(0, 32) i)]) v;
SELECT written();

-- Well-formed values are taken, and recorded on the edit's row; the empty string means none.
BEGIN;
SET LOCAL feature_outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SET LOCAL feature_outbox.tracestate = 'rojo=00f067aa0ba902b7, congo=t61rcWkgMzE';
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[1,1]}', 'created');
COMMIT;
SET feature_outbox.traceparent = '';
SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1,1]}', 'created');
-- A tracestate alone is not recorded.
SET feature_outbox.tracestate = 'rojo=00f067aa0ba902b7';
SELECT feature_outbox.edit_feature(3, '{"type":"Point","coordinates":[1,1]}', 'created');
RESET feature_outbox.tracestate;
SELECT feature_id, traceparent, tracestate FROM feature_outbox.outbox ORDER BY id;
\set VERBOSITY sqlstate
ALTER SYSTEM SET feature_outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
\set VERBOSITY default
ALTER SYSTEM SET feature_outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SELECT written();
