-- feature_outbox 0.4.0 -> 0.5.0: migration only. scripts/upgrade_script.py puts this first in the
-- generated upgrade script, then every function, view and body file of 0.5.0 as CREATE OR REPLACE,
-- then sql/finalize.sql. What belongs here: table and column changes, data fixes, drops of whatever
-- a re-run body cannot replace (a changed signature or return type, a view's changed columns, and
-- what depends on them), and column defaults put back after such a drop. Never a function body.

-- Nothing yet: 0.5.0's changes so far (metrics() on a standby, its new series, the functions
-- _relay_workers_configured() and _relay_standby_gate(), the column relay_workers_configured
-- appended to backlog and backlog_by_layer, the standby gate's columns appended to workers) are
-- bodies, new functions and views that CREATE OR REPLACE VIEW extends at their end, all of which
-- the generated part carries.

-- Capture of direct writes (sql/capture.sql): since when a layer is captured.
ALTER TABLE layer_registry ADD COLUMN captured_at timestamptz;
