-- feature_outbox 0.1.0 -> 0.2.0, run by ALTER EXTENSION feature_outbox UPDATE.
--
-- 0.2.0 is the open release: every change to the SQL surface made for it goes here, in the same
-- commit as the change to sql/*.sql or src/. pg_test/test_upgrade.py compares a database upgraded
-- by this script with a fresh CREATE EXTENSION and prints every difference.
-- Rules (README, "Upgrading"):
--   - the outbox holds the only copy of undelivered events: never drop or rewrite it;
--   - fill per-feature data lazily or in bounded steps, never with one long lock on a large table;
--   - new columns go at the end of their table, in sql/schema.sql too, so both orders agree;
--   - keep the two blocks below last.

\echo Use "ALTER EXTENSION feature_outbox UPDATE" to load this file. \quit

-- As sql/finalize.sql does at CREATE EXTENSION: pin search_path on every SQL and plpgsql function,
-- including those this script adds. PostGIS's schema is known only at run time.
DO $pin$
DECLARE
    postgis_schema text := (SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace
                             WHERE e.extname = 'postgis');
    fn regprocedure;
BEGIN
    FOR fn IN SELECT p.oid::regprocedure FROM pg_proc p
               WHERE p.pronamespace = 'feature_outbox'::regnamespace
                 AND p.prolang IN (SELECT oid FROM pg_language WHERE lanname IN ('sql', 'plpgsql'))
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, %I, feature_outbox, pg_temp', fn, postgis_schema);
    END LOOP;
END
$pin$;

-- Relay workers wait while the schema is older than their library; they resume when this commits.
SELECT _wake_relay_at_commit();
