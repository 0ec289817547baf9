-- capture_layer and uncapture_layer on a server without wal_level = logical (the regression
-- cluster's): every refusal says why with its SQLSTATE, and nothing is half-created (no
-- publication, no slot, no layer marked). The capture itself is tested end to end, with real
-- writers, in test_capture.py.
CREATE TABLE public.cap_parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL,
                                 version integer NOT NULL DEFAULT 0, name text);
SELECT feature_outbox.register_layer('cap_parcels', 'public.cap_parcels', properties => '{name}');
-- CALL on its own (not through try(): its exception block is a subtransaction, in which the
-- procedures refuse to start, as they could not COMMIT there); each SQLSTATE echoed after.
CALL feature_outbox.capture_layer('nope');
\echo :LAST_ERROR_SQLSTATE
CALL feature_outbox.capture_layer(NULL);
\echo :LAST_ERROR_SQLSTATE
CALL feature_outbox.capture_layer('features');
\echo :LAST_ERROR_SQLSTATE
SELECT current_setting('wal_level') AS wal_level;
CALL feature_outbox.capture_layer('cap_parcels');
\echo :LAST_ERROR_SQLSTATE
CALL feature_outbox.uncapture_layer('cap_parcels');
\echo :LAST_ERROR_SQLSTATE
-- In a transaction block: refused before anything is done.
BEGIN;
CALL feature_outbox.capture_layer('cap_parcels');
ROLLBACK;
\echo :LAST_ERROR_SQLSTATE
-- Nothing was made.
SELECT count(*) AS publications FROM pg_publication WHERE pubname LIKE 'feature_outbox_capture%';
SELECT count(*) AS slots FROM pg_replication_slots WHERE slot_name LIKE 'feature_outbox_capture_%';
SELECT layer, captured_at FROM feature_outbox.layers WHERE layer = 'cap_parcels';
SELECT state, layers, pid, lag_bytes, lag_seconds, events FROM feature_outbox.capture;
SELECT layer, capture_lag_bytes, capture_lag_seconds FROM feature_outbox.backlog_by_layer WHERE layer = 'cap_parcels';
-- Not PUBLIC's: a plain role may not start capture (42501), nor a procedure in a subtransaction (25001).
CREATE ROLE cap_plain LOGIN;
SET ROLE cap_plain;
CALL feature_outbox.capture_layer('cap_parcels');
\echo :LAST_ERROR_SQLSTATE
RESET ROLE;
DROP ROLE cap_plain;
SELECT try($$CALL feature_outbox.capture_layer('cap_parcels')$$);
SELECT feature_outbox.unregister_layer('cap_parcels');
DROP TABLE public.cap_parcels;
