-- Where each outbox row's event comes from (outbox.origin; the book, "Events"): 'application'
-- (edit_feature, record_edit, backfill), 'captured' (the capture worker, for a write made outside
-- them) or 'resync'. The column's default reads the backend's current origin, which only the
-- library sets (src/event_origin.rs): a plain C call, no SPI, and nothing a SQL caller can change,
-- unlike a setting.
CREATE OR REPLACE FUNCTION _event_origin() RETURNS text
LANGUAGE c STABLE PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'feature_outbox_event_origin';
COMMENT ON FUNCTION _event_origin() IS
    'The default of outbox.origin: where the events this backend writes now come from (application, captured or resync).';
-- Set here, after the function exists, for a fresh install and an update alike (sql/schema.sql
-- creates the column without a default; sql/updates/0.4.0--0.5.0.sql adds it with 'application'
-- for the rows already there).
ALTER TABLE outbox ALTER COLUMN origin SET DEFAULT _event_origin();
