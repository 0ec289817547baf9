-- feature_outbox 0.3.0 -> 0.4.0: migration only. scripts/upgrade_script.py puts this first in the
-- generated upgrade script, then every function, view and body file of 0.4.0 as CREATE OR REPLACE,
-- then sql/finalize.sql. What belongs here: table and column changes, data fixes, drops of whatever
-- a re-run body cannot replace (a changed signature or return type, a view's changed columns, and
-- what depends on them), and column defaults put back after such a drop. Never a function body.

-- The edit path's Rust helpers return named fields instead of positional arrays: the types as
-- sql/schema.sql declares them, and the helpers dropped, since their return types change (the
-- generated part declares them again).
CREATE TYPE geometry_facts AS (
    antimeridian  boolean,
    polar         integer,
    bbox          float8[],
    h3_resolution integer
);
CREATE TYPE layer_write AS (
    version           integer,
    row_version       text,
    geometry_digest   uuid,
    properties_digest uuid
);
DROP FUNCTION _inspect_geometry(bytea, boolean, integer, text);
DROP FUNCTION _layer_write_row(text, text, oid, text, text, text, text, text, text, anyelement, text, text[], text[]);

-- Sink health (issue 38): _relay_workers() returns three more columns (sink_up, sink_errors,
-- sink_last_success_at), which CREATE OR REPLACE cannot do; the workers view reads it. Both are
-- created again further down, with their grants.
DROP VIEW workers;
DROP FUNCTION _relay_workers();
