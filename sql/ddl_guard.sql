-- The DDL guard: event triggers that refuse DDL which would break a registered layer, so that no
-- edit commits and then fails in the relay, and no waiting row loses the table it is read from.
-- - sql_drop: DROP TABLE of a layer's table (DROP SCHEMA ... CASCADE and DROP OWNED included, since
--   every dropped object is listed), and DROP COLUMN of a registered column;
-- - ddl_command_end of ALTER TABLE: a registered column renamed or of another type than at
--   registration (layer_registry.column_types).
-- Anything else costs one lookup in layer_registry. A superuser turns the guard off for a session
-- with SET feature_outbox.ddl_guard = off (pg_restore --clean, repairs). Event triggers do not fire
-- in single-user mode.

CREATE OR REPLACE FUNCTION _guard_layer_drops() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    hit record;
BEGIN
    IF NOT _ddl_guard_on() THEN
        RETURN;
    END IF;
    SELECT r.layer, d.object_type, d.address_names, c.role INTO hit
      FROM pg_event_trigger_dropped_objects() d
      JOIN layer_registry r ON r.tbl::oid = d.objid AND r.layer <> 'features'
      LEFT JOIN LATERAL _layer_columns(r) c ON d.objsubid > 0 AND c.col = d.address_names[3]
     WHERE d.classid = 'pg_class'::regclass AND (d.objsubid = 0 AND d.object_type = 'table' OR c.col IS NOT NULL)
     ORDER BY d.objsubid
     LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF hit.role IS NULL THEN
        RAISE EXCEPTION 'cannot drop table %.%: it is the table of layer %', quote_ident(hit.address_names[1]),
            quote_ident(hit.address_names[2]), hit.layer USING ERRCODE = '2BP01',
            DETAIL = 'Its unpublished outbox rows are read from it, and edits of the layer write to it.',
            HINT = format('Let the relay publish its rows (feature_outbox.backlog_by_layer), then SELECT '
                          'feature_outbox.unregister_layer(%L) before dropping it. For pg_restore --clean or a repair, '
                          'a superuser may SET feature_outbox.ddl_guard = off for the session.', hit.layer);
    END IF;
    RAISE EXCEPTION 'cannot drop column % of %.%: it is the % column of layer %', quote_ident(hit.address_names[3]),
        quote_ident(hit.address_names[1]), quote_ident(hit.address_names[2]), hit.role, hit.layer USING ERRCODE = '2BP01',
        DETAIL = 'Edits would commit and then fail in the relay, which reads the column for every event.',
        HINT = format('Unregister the layer and register it again without the column (SELECT feature_outbox.unregister_layer(%L) '
                      'once its rows are published). A superuser may SET feature_outbox.ddl_guard = off for the session.', hit.layer);
END
$$;

CREATE OR REPLACE FUNCTION _guard_layer_columns() RETURNS event_trigger
LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
    r layer_registry;
    now_types text[];
    bad record;
BEGIN
    IF NOT _ddl_guard_on() THEN
        RETURN;
    END IF;
    FOR r IN SELECT DISTINCT ON (l.layer) l.* FROM pg_event_trigger_ddl_commands() c
               JOIN layer_registry l ON l.tbl::oid = c.objid AND l.layer <> 'features' AND l.column_types IS NOT NULL
              WHERE c.classid = 'pg_class'::regclass
    LOOP
        now_types := _layer_column_types(r);
        IF now_types IS DISTINCT FROM r.column_types THEN
            SELECT c.col, c.role, r.column_types[c.ord] AS was, now_types[c.ord] AS is INTO bad
              FROM _layer_columns(r) c WHERE r.column_types[c.ord] IS DISTINCT FROM now_types[c.ord] ORDER BY c.ord LIMIT 1;
            RAISE EXCEPTION '%', CASE WHEN bad.is = 'missing'
                    THEN format('cannot rename column %I of %s: it is the %s column of layer %s', bad.col, r.tbl, bad.role, r.layer)
                    ELSE format('cannot change the type of column %I of %s from %s to %s: it is the %s column of layer %s',
                                bad.col, r.tbl, bad.was, bad.is, bad.role, r.layer) END
                USING ERRCODE = '2BP01',
                DETAIL = 'The layer was registered with these columns; edits and the relay read them by name and type.',
                HINT = format('Unregister the layer (SELECT feature_outbox.unregister_layer(%L) once its rows are published), '
                              'change the table, and register it again. A superuser may SET feature_outbox.ddl_guard = off '
                              'for the session.', r.layer);
        END IF;
        IF r.captured_at IS NOT NULL AND NOT _capture_identity_published(r) THEN
            RAISE EXCEPTION 'cannot change the replica identity or primary key of %: layer % is captured', r.tbl, r.layer
                USING ERRCODE = '2BP01',
                DETAIL = 'Its publication lists the identity''s columns; PostgreSQL would refuse the table''s UPDATE and DELETE.',
                HINT = format('CALL feature_outbox.uncapture_layer(%L), change the table, then CALL feature_outbox.capture_layer(%L). '
                              'A superuser may SET feature_outbox.ddl_guard = off for the session.', r.layer, r.layer);
        END IF;
    END LOOP;
END
$$;

-- Dropped first: an update runs this file again, and an event trigger has no CREATE OR REPLACE.
DROP EVENT TRIGGER IF EXISTS feature_outbox_guard_drops;
CREATE EVENT TRIGGER feature_outbox_guard_drops ON sql_drop
    EXECUTE FUNCTION _guard_layer_drops();
DROP EVENT TRIGGER IF EXISTS feature_outbox_guard_columns;
CREATE EVENT TRIGGER feature_outbox_guard_columns ON ddl_command_end WHEN TAG IN ('ALTER TABLE')
    EXECUTE FUNCTION _guard_layer_columns();
