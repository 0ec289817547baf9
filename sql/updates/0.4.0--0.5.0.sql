-- feature_outbox 0.4.0 -> 0.5.0: migration only. scripts/upgrade_script.py puts this first in the
-- generated upgrade script, then every function, view and body file of 0.5.0 as CREATE OR REPLACE,
-- then sql/finalize.sql. What belongs here: table and column changes, data fixes, drops of whatever
-- a re-run body cannot replace (a changed signature or return type, a view's changed columns, and
-- what depends on them), and column defaults put back after such a drop. Never a function body.

-- Nothing yet: 0.5.0's changes so far (metrics() on a standby, its two new series, the function
-- _relay_workers_configured(), the column relay_workers_configured appended to backlog and
-- backlog_by_layer) are bodies, a new function and views that CREATE OR REPLACE VIEW extends at
-- their end, all of which the generated part carries.
