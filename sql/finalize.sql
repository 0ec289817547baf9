-- Runs last: privileges, pinned search_path, and a word on which database the relay serves.

-- Privileges: PUBLIC may use the schema and write nothing; pg_monitor reads the views (monitoring.sql).
-- Applications get EXECUTE on edit_feature explicitly (README), so they cannot bypass the outbox
-- (guide, gotcha 5).
REVOKE ALL ON FUNCTION edit_feature(bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(bigint, geometry, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, bigint, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, bigint, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, text, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, text, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, uuid, text, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION edit_feature(text, uuid, geometry, text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION record_edit(text, uuid, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _edit_key(text, text, geometry, text, bytea, jsonb, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION _record_edit_key(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _feature_number(layer_registry, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _edit(text, bigint, geometry, text, bytea, jsonb, boolean, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _record_edit(text, bigint, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _register_layer(text, regclass, name, name, name, name[], name) FROM PUBLIC;
REVOKE ALL ON FUNCTION _unregister_layer(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _layer_write_row(text, text, oid, text, text, text, text, text, text, anyelement, text, text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_row(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_row(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION retry_parked() FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_rows(text, bigint[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _as_caller_rows(text, text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION __backfill_chunk(text, geometry, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION __backfill_state(text, bigint, geometry, integer) FROM PUBLIC;
-- Snapshots reach every subscriber: backfill is the operator's (GRANT EXECUTE to a role that may).
-- _backfill_chunk stays callable, since backfill runs as its caller; it checks EXECUTE on backfill.
REVOKE ALL ON PROCEDURE backfill(text, geometry, bigint) FROM PUBLIC;
-- drift() and resync() are the operator's too; their chunks check EXECUTE on them, as backfill's do.
REVOKE ALL ON FUNCTION drift(text) FROM PUBLIC;
REVOKE ALL ON PROCEDURE resync(text, integer, bigint, bigint) FROM PUBLIC;
-- Capture makes a replication slot and publications: the extension owner's (sql/capture.sql).
REVOKE ALL ON PROCEDURE capture_layer(text) FROM PUBLIC;
REVOKE ALL ON PROCEDURE uncapture_layer(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_publish(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_create_slot() FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_mark(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_unpublish(text, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION _uncapture(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_rows(text, text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION __capture_rows(text, text[], text[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_truncated(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_wake() FROM PUBLIC;
REVOKE ALL ON FUNCTION _capture_raise(text, text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION __repair_row(layer_registry, text, bigint, boolean, text, uuid, uuid, boolean, integer, text, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION __repair_event(layer_registry, feature_state, text, text, boolean, text, uuid, uuid, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION __lock_rows(layer_registry, text[], boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_rows(layer_registry, integer, text, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_layer(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION __drift_chunk(text, integer, text, integer, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION __resync_chunk(text, integer, text, integer, integer, bigint) FROM PUBLIC;
-- Registering a layer is the table owner's decision, and metrics() reads the relay's health: grant
-- them to the roles that need them. routing_key() stays public: it computes, it reads nothing.
REVOKE ALL ON FUNCTION register_layer(text, regclass, name, name, name, name[], name) FROM PUBLIC;
REVOKE ALL ON FUNCTION unregister_layer(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION release_layer(text, regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION _release_layer(text, regclass) FROM PUBLIC;
REVOKE ALL ON FUNCTION metrics() FROM PUBLIC;
-- Whether a copy speaks as the original is the operator's decision (sql/identity.sql).
REVOKE ALL ON FUNCTION resolve_copy(text, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION _identity_check() FROM PUBLIC;
REVOKE ALL ON FUNCTION _identity_here() FROM PUBLIC;
REVOKE ALL ON FUNCTION define_expire_output(text, integer, integer, text, text, text, bigint, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION drop_expire_output(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION expire_layer(text, text, text, float8, float8, boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION unexpire_layer(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _tile_keep(bigint, bytea, text, bigint, text, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION _tile_seed(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _expire_table(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _layer_expires(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION _expire_rules_changed() FROM PUBLIC;
REVOKE ALL ON FUNCTION _expire_rules_touched() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION metrics() TO pg_monitor;
GRANT SELECT ON expire_backlog TO pg_monitor;
REVOKE ALL ON TABLE features, outbox, feature_state, feature_keys, layer_registry, database_identity FROM PUBLIC;
REVOKE ALL ON TABLE expire_outputs, expire_rules, tile_shapes, tile_queue, expire_progress, expire_backlog FROM PUBLIC;
-- Anyone may list the layers; register_layer checks that the caller owns the table.
GRANT SELECT ON layers TO PUBLIC;
GRANT USAGE ON SCHEMA feature_outbox TO PUBLIC;

-- Pin search_path on every SQL and plpgsql function: pg_catalog first, then the schema PostGIS
-- lives in (any schema), then ours. Done here because PostGIS's schema is known only now.
-- Procedures are left out: one with a SET clause cannot COMMIT (backfill qualifies every name).
DO $pin$
DECLARE
    postgis_schema text := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                             WHERE e.extname = 'postgis');
    fn regprocedure;
BEGIN
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc p
               WHERE p.pronamespace = 'feature_outbox'::regnamespace AND p.prokind = 'f'
                 AND p.prolang IN (SELECT oid FROM pg_language WHERE lanname IN ('sql', 'plpgsql'))
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, feature_outbox, pg_temp', fn, postgis_schema);
    END LOOP;
END
$pin$;

DO $notice$
BEGIN
    -- CREATE EXTENSION runs its script at client_min_messages = warning; lift that for this notice.
    -- The change ends with the script.
    PERFORM set_config('client_min_messages', 'notice', true);
    -- From the library's own state: the feature_outbox.* settings read the same as placeholders
    -- whether or not the library was preloaded.
    IF NOT _relay_preloaded() THEN
        RAISE NOTICE 'feature_outbox is not in shared_preload_libraries, so no relay worker publishes this outbox'
            USING HINT = 'Add feature_outbox to shared_preload_libraries in postgresql.conf and restart the server.';
    ELSIF trim(current_setting('feature_outbox.database')) <> '*'
          AND NOT current_database() = ANY (SELECT trim(n) FROM unnest(string_to_array(current_setting('feature_outbox.database'), ',')) n) THEN
        RAISE NOTICE 'no feature_outbox relay serves database "%": the relay workers publish %',
            current_database(), current_setting('feature_outbox.database')
            USING HINT = 'Add this database to feature_outbox.database, or set it to ''*'' (every database with the extension), and restart the server.';
    END IF;
END
$notice$;

-- Relay workers waiting for this extension look again when this CREATE EXTENSION commits.
SELECT _wake_relay_at_commit();
