-- The CHECK of an outbox row's event_type and origin: one C function (src/outbox_check.rs) in
-- place of two IN lists, which PostgreSQL reads, plans and prepares again for every statement
-- that writes the outbox (about 86,000 instructions an edit, against about 15,000). The same
-- values pass: event_type created, moved, retired, updated or snapshot; origin application,
-- captured or resync.
CREATE OR REPLACE FUNCTION _outbox_values_valid(event_type text, origin text) RETURNS boolean
LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
AS 'MODULE_PATHNAME', 'feature_outbox_outbox_values_valid';
COMMENT ON FUNCTION _outbox_values_valid(text, text) IS
    'The CHECK of outbox rows (outbox_values_check): event_type and origin are values an event may carry.';
-- Added here, once the function exists, for a fresh install and an update alike: sql/schema.sql
-- creates the columns without a CHECK, and sql/updates/0.4.0--0.5.0.sql drops 0.4.0's on
-- event_type. Adding it reads the rows already there once.
DO $check$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint c
                    WHERE c.conrelid = 'outbox'::regclass AND c.conname = 'outbox_values_check') THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_values_check CHECK (_outbox_values_valid(event_type, origin));
    END IF;
END
$check$;
