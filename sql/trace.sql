-- Every outbox row records the writer's W3C trace context in effect (README, "CloudEvents and
-- tracing"): the columns' defaults read feature_outbox.traceparent and .tracestate, so each edit
-- path (edit_feature, record_edit, resync, backfill) carries it without naming the columns.
ALTER TABLE outbox ALTER COLUMN traceparent SET DEFAULT _traceparent(),
                   ALTER COLUMN tracestate SET DEFAULT _tracestate();
