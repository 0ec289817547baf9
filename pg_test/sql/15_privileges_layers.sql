-- Privileges of layers, in both directions. edit_feature(layer, ...) and record_edit write the
-- table with the caller's own rights (current_user: the login role, SET ROLE's role, or the owner of
-- a SECURITY DEFINER function), so its triggers and defaults run as the caller; EXECUTE alone is not
-- enough (42501). Only the owner of a table registers it. The outbox, feature_state, the registry
-- and the internal functions are reachable only through the functions, and no operator function
-- (drift, resync, backfill, retry_parked, register_layer...) is PUBLIC's. Each refusal writes nothing.
CREATE ROLE regress_layer_owner;
CREATE ROLE regress_layer_app;
CREATE ROLE regress_layer_reader;
CREATE ROLE regress_layer_stranger;
GRANT CREATE ON SCHEMA public TO regress_layer_owner;
GRANT EXECUTE ON FUNCTION feature_outbox.register_layer(text, regclass, name, name, name, name[], name),
                          feature_outbox.unregister_layer(text) TO regress_layer_owner, regress_layer_stranger;
GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(text, bigint, text, text, jsonb),
                          feature_outbox.record_edit(text, bigint, text) TO regress_layer_app, regress_layer_reader;

SET ROLE regress_layer_owner;
CREATE TABLE public.shops (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0,
                           name text, written_by name DEFAULT current_user);
RESET ROLE;
CREATE FUNCTION counts() RETURNS text LANGUAGE sql AS $$
    SELECT format('%s registry=%s shops=%s', written(), (SELECT count(*) FROM feature_outbox.layer_registry),
                  (SELECT count(*) FROM public.shops))
$$;
SELECT counts();
-- A table of someone else.
SET ROLE regress_layer_stranger;
SELECT try($$SELECT feature_outbox.register_layer('shops', 'public.shops')$$);
SELECT try($$SELECT feature_outbox.unregister_layer('features')$$);
RESET ROLE;
SELECT counts();
SET ROLE regress_layer_owner;
SELECT feature_outbox.register_layer('shops', 'public.shops', properties => '{name}');
GRANT SELECT, INSERT, UPDATE ON public.shops TO regress_layer_app;
GRANT SELECT ON public.shops TO regress_layer_reader;
CREATE FUNCTION public.shops_audit() RETURNS trigger LANGUAGE plpgsql AS
    $$ BEGIN NEW.written_by := current_user; RETURN NEW; END $$;
CREATE TRIGGER shops_audit BEFORE INSERT OR UPDATE ON public.shops FOR EACH ROW EXECUTE FUNCTION public.shops_audit();
RESET ROLE;

-- The application role: its trigger and default ran as the caller, never as the extension's owner.
SET ROLE regress_layer_app;
SELECT feature_outbox.edit_feature('shops', 1, '{"type":"Point","coordinates":[-73.98,40.75]}', 'created', '{"name": "Deli"}');
BEGIN;
UPDATE public.shops SET name = 'Deli 2' WHERE id = 1;
SELECT feature_outbox.record_edit('shops', 1, 'updated');
COMMIT;
SELECT id, version, name, written_by FROM public.shops;
RESET ROLE;
SELECT counts();

-- The outbox, the state, the registry and the internal functions are not the application's.
SET ROLE regress_layer_app;
SELECT try($$INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key, layer) VALUES (1, 9, 'moved', 'x', 'shops')$$);
SELECT try($$UPDATE feature_outbox.outbox SET published_at = now()$$);
SELECT try($$DELETE FROM feature_outbox.outbox$$);
SELECT try($$UPDATE feature_outbox.feature_state SET routing_key = 'x'$$);
SELECT try($$INSERT INTO feature_outbox.layer_registry (layer, tbl, id_column, geometry_column, version_column, srid, geometry_type) VALUES ('x', 'public.shops', 'id', 'geom', 'version', 4326, 'Point')$$);
SELECT try($$DELETE FROM feature_outbox.feature_keys$$);
SELECT try($$SELECT feature_outbox._record_edit('shops', 1, 'updated')$$);
SELECT try($$SELECT feature_outbox._register_layer('x', 'public.shops', 'id', 'geom', 'version', '{}', NULL)$$);
SELECT try($$SELECT feature_outbox._unregister_layer('shops')$$);
SELECT try($$SELECT feature_outbox._release_layer('shops', NULL)$$);
SELECT try($$SELECT feature_outbox._edit('shops', 1, NULL, 'updated', NULL, NULL, false)$$);
SELECT try($$SELECT feature_outbox._layer_write_row('shops', 'moved', 'public.shops'::regclass, 'id', 'geom', 'version', NULL, '1', 'bigint', NULL::geometry, NULL, NULL, NULL)$$);
SELECT try($$SELECT feature_outbox._as_caller_row('SELECT 1', 1::bigint)$$);
SELECT try($$SELECT feature_outbox._as_caller_rows('SELECT 1', ARRAY['1'])$$);
SELECT try($$SELECT feature_outbox.edit_feature(77, '{"type":"Point","coordinates":[0,0]}', 'created')$$);
-- record_edit for a row the caller did not write cannot invent an event.
SELECT try($$SELECT feature_outbox.record_edit('shops', 1, 'moved')$$);
-- The application may read the layers view, but cannot register or unregister.
SELECT layer FROM feature_outbox.layers ORDER BY layer;
SELECT try($$SELECT feature_outbox.register_layer('mine', 'public.shops')$$);
SELECT try($$SELECT feature_outbox.unregister_layer('shops')$$);
RESET ROLE;
SELECT counts();

-- EXECUTE alone is not enough: the write runs with the reader's own rights (SET ROLE counts too).
SET ROLE regress_layer_reader;
SELECT try($$SELECT feature_outbox.edit_feature('shops', 2, '{"type":"Point","coordinates":[-73.98,40.75]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('shops', 1, NULL::text, 'updated', '{"name": "x"}')$$);
SELECT try($$SELECT feature_outbox.edit_feature('shops', 1, NULL::text, 'retired')$$);
BEGIN;
SELECT try($$SELECT feature_outbox.record_edit('shops', 1, 'updated')$$);
ROLLBACK;
RESET ROLE;
SELECT counts();

-- retired deletes where the layer has no retired column: DELETE is the caller's to have.
SET ROLE regress_layer_app;
SELECT try($$SELECT feature_outbox.edit_feature('shops', 1, NULL::text, 'retired')$$);
RESET ROLE;
SELECT counts();

-- A SECURITY DEFINER wrapper of the table's owner writes with the owner's rights; its trigger sees
-- the owner, not the session's role, which has no rights on the table at all (42501 without it).
GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(text, bigint, text, text, jsonb) TO regress_layer_owner;
SET ROLE regress_layer_owner;
CREATE FUNCTION public.add_shop(i int) RETURNS int LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, public AS
    $$ SELECT feature_outbox.edit_feature('shops', i, '{"type":"Point","coordinates":[1,2]}', 'created') $$;
GRANT EXECUTE ON FUNCTION public.add_shop(int) TO regress_layer_stranger;
RESET ROLE;
GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(text, bigint, text, text, jsonb) TO regress_layer_stranger;
SET ROLE regress_layer_stranger;
SELECT public.add_shop(5);
SELECT try($$SELECT feature_outbox.edit_feature('shops', 6, '{"type":"Point","coordinates":[1,2]}', 'created')$$);
RESET ROLE;
-- A superuser's own edit runs the trigger as the superuser, as any write of theirs would.
SELECT feature_outbox.edit_feature('shops', 7, '{"type":"Point","coordinates":[1,2]}', 'created');
SELECT id, written_by = current_user AS by_the_superuser, written_by FROM public.shops WHERE id IN (5, 7) ORDER BY id;

-- Operator functions are granted explicitly, never to PUBLIC: drift, resync and their internal chunks.
SELECT f, has_function_privilege('regress_layer_stranger', f, 'EXECUTE') AS stranger_may
  FROM unnest(ARRAY['feature_outbox.drift(text)', 'feature_outbox.resync(text, integer, bigint, bigint)',
                    'feature_outbox.backfill(text, geometry, bigint)', 'feature_outbox.release_layer(text, regclass)',
                    'feature_outbox.retry_parked()', 'feature_outbox.replay_published(timestamptz, text)',
                    'feature_outbox.metrics()', 'feature_outbox.backlog_by_cell(integer)',
                    'feature_outbox.record_edit(text, bigint, text)', 'feature_outbox.routing_key(geometry)']) f;
SET ROLE regress_layer_stranger;
SELECT try($$SELECT * FROM feature_outbox.drift('shops')$$);
SELECT try($$CALL feature_outbox.resync('shops')$$);
SELECT try($$SELECT feature_outbox._drift_chunk('shops', 1, NULL, 10, 0)$$);
SELECT try($$SELECT feature_outbox._resync_chunk('shops', 1, NULL, 10, 100, 0)$$);
RESET ROLE;
-- Granted drift, a role reads the table with its own rights.
GRANT EXECUTE ON FUNCTION feature_outbox.drift(text) TO regress_layer_stranger;
SET ROLE regress_layer_stranger;
SELECT try($$SELECT * FROM feature_outbox.drift('shops')$$);
RESET ROLE;
SELECT counts();

DROP OWNED BY regress_layer_app, regress_layer_reader, regress_layer_stranger;
SET feature_outbox.ddl_guard = off;
DROP OWNED BY regress_layer_owner;
RESET feature_outbox.ddl_guard;
DROP ROLE regress_layer_owner, regress_layer_app, regress_layer_reader, regress_layer_stranger;
