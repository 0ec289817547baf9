-- feature_outbox 0.4.0 -> 0.5.0: migration only. scripts/upgrade_script.py puts this first in the
-- generated upgrade script, then every function, view and body file of 0.5.0 as CREATE OR REPLACE,
-- then sql/finalize.sql. What belongs here: table and column changes, data fixes, drops of whatever
-- a re-run body cannot replace (a changed signature or return type, a view's changed columns, and
-- what depends on them), and column defaults put back after such a drop. Never a function body.

-- 0.5.0's other changes (metrics() on a standby, its new series, the functions
-- _relay_workers_configured() and _relay_standby_gate(), the column relay_workers_configured
-- appended to backlog and backlog_by_layer, the standby gate's columns appended to workers) are
-- bodies, new functions and views that CREATE OR REPLACE VIEW extends at their end, all of which
-- the generated part carries.

-- Where each event comes from (sql/origin.sql), appended last as sql/schema.sql has it. The rows
-- already there get 'application' (nothing recorded which of them resync wrote), as a constant, so
-- the table is not rewritten. Its default, _event_origin(), does not exist yet here: sql/origin.sql,
-- in the generated part below, declares it, then sets it. event_type's CHECK goes: one CHECK of
-- both columns takes its place (sql/outbox_check.sql, in the generated part, reads each row once).
ALTER TABLE outbox ADD COLUMN origin text NOT NULL DEFAULT 'application';
ALTER TABLE outbox DROP CONSTRAINT outbox_event_type_check;

-- Capture of direct writes (sql/capture.sql): since when a layer is captured.
ALTER TABLE layer_registry ADD COLUMN captured_at timestamptz;
