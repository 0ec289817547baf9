-- release_layer(layer, tbl) gives a held layer back to the relay once its table matches the
-- registration again: the same table with the column put back, or a table restored in its place
-- under a new OID. Before that it refuses, changing nothing: 42P01 while the table is missing (the
-- hint shows the two-argument form), 42804 while a registered column is gone or of another type
-- (the detail lists them). It is for the table's owner or a superuser (42501), not PUBLIC's.
-- It returns the layer's waiting rows, and clears held_since/held_reason in backlog_by_layer.
CREATE TABLE public.doomed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text);
SELECT feature_outbox.register_layer('doomed', 'public.doomed', properties => '{note}');
CREATE TABLE public.renamed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text);
SELECT feature_outbox.register_layer('renamed', 'public.renamed', properties => '{note}');
SELECT feature_outbox.edit_feature(l, i, '{"type":"Point","coordinates":[-73.98,40.75]}', 'created')
  FROM unnest(ARRAY['doomed', 'renamed']) l, generate_series(1, 2) i \g /dev/null
-- Past the DDL guard (a superuser's repair, or single-user mode), and held as the relay holds them.
SET feature_outbox.ddl_guard = off;
DROP TABLE public.doomed;
ALTER TABLE public.renamed RENAME COLUMN note TO remark;
RESET feature_outbox.ddl_guard;
UPDATE feature_outbox.layer_registry SET held_since = now(), held_reason = 'held by this test' WHERE layer IN ('doomed', 'renamed');
CREATE FUNCTION held() RETURNS TABLE (layer text, unpublished_rows bigint, held boolean, table_name text)
LANGUAGE sql AS $$
    SELECT b.layer, b.unpublished_rows, b.held_since IS NOT NULL,
           CASE WHEN l.table_name::text ~ '^[0-9]+$' THEN '<dropped>' ELSE l.table_name::text END
      FROM feature_outbox.backlog_by_layer b JOIN feature_outbox.layers l USING (layer)
     WHERE b.layer <> 'features' ORDER BY b.layer
$$;
SELECT * FROM held();

-- unregister_layer refuses while their rows wait: the events are the only copy.
SELECT try($$SELECT feature_outbox.unregister_layer('doomed')$$);
-- Too early: the table is missing, the column is renamed.
SELECT regexp_replace(try($$SELECT feature_outbox.release_layer('doomed')$$), 'OID \d+', 'OID <oid>') AS try;
SELECT try_detail($$SELECT feature_outbox.release_layer('renamed')$$);
-- Not a user layer, not a layer.
SELECT try($$SELECT feature_outbox.release_layer('features')$$);
SELECT try($$SELECT feature_outbox.release_layer('nosuch')$$);
SELECT * FROM held();

-- A table restored with a registered column of another type is not the layer's table either.
CREATE TABLE public.doomed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note varchar(10));
SELECT try_detail($$SELECT feature_outbox.release_layer('doomed', 'public.doomed')$$);
DROP TABLE public.doomed;

-- Not PUBLIC's; granted, still only for the table's owner.
CREATE ROLE regress_release_stranger;
SET ROLE regress_release_stranger;
SELECT try($$SELECT feature_outbox.release_layer('renamed')$$);
RESET ROLE;
GRANT EXECUTE ON FUNCTION feature_outbox.release_layer(text, regclass) TO regress_release_stranger;
ALTER TABLE public.renamed RENAME COLUMN remark TO note;
SET ROLE regress_release_stranger;
SELECT try($$SELECT feature_outbox.release_layer('renamed')$$);
RESET ROLE;
SELECT * FROM held();

-- The recovery: put the column back (done above), or restore the table, then release.
SELECT feature_outbox.release_layer('renamed');
CREATE TABLE public.doomed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text);
INSERT INTO public.doomed VALUES (1, ST_SetSRID(ST_MakePoint(-73.98, 40.75), 4326), 1, 'restored');
SELECT feature_outbox.release_layer('doomed', 'public.doomed');
SELECT * FROM held();
-- Released, the layer takes edits again; a second release changes nothing.
SELECT feature_outbox.edit_feature('doomed', 1, NULL::text, 'updated', '{"note": "edited"}');
SELECT feature_outbox.release_layer('renamed');

DROP OWNED BY regress_release_stranger;
DROP ROLE regress_release_stranger;
