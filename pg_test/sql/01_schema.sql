-- The SQL surface: objects, columns, the partial index, privileges and pinned search_path.
SELECT extversion IS NOT NULL AS installed, n.nspname AS schema, e.extrelocatable
  FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'feature_outbox';

SELECT column_name, data_type, is_nullable, column_default
  FROM information_schema.columns
 WHERE table_schema = 'feature_outbox' AND table_name = 'outbox' ORDER BY ordinal_position;

-- The guide's cost decision, guarded: the outbox carries no geometry (a 16-byte digest of it only).
SELECT count(*) AS geometry_columns
  FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
 WHERE a.attrelid = 'feature_outbox.outbox'::regclass AND a.attnum > 0 AND NOT a.attisdropped
   AND (t.typname IN ('geometry', 'geography') OR (a.attname LIKE '%geom%' AND t.typname <> 'uuid'));

SELECT column_name, udt_name, is_nullable FROM information_schema.columns
 WHERE table_schema = 'feature_outbox' AND table_name = 'features' ORDER BY ordinal_position;
SELECT type, srid, coord_dimension FROM geometry_columns
 WHERE f_table_schema = 'feature_outbox' AND f_table_name = 'features';

SELECT indexdef FROM pg_indexes WHERE schemaname = 'feature_outbox' AND indexname = 'outbox_unpublished';
SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'outbox_values_check';
-- What it lets through: the event types and origins events carry, nothing else.
SELECT t, o, feature_outbox._outbox_values_valid(t, o)
  FROM unnest(ARRAY['created', 'moved', 'retired', 'updated', 'snapshot', 'deleted', 'Moved']) t,
       unnest(ARRAY['application', 'captured', 'resync', 'imported']) o
 WHERE t IN ('moved', 'deleted', 'Moved') OR o = 'imported' OR o = 'application' ORDER BY 3, 1, 2;

SELECT column_name FROM information_schema.columns
 WHERE table_schema = 'feature_outbox' AND table_name = 'backlog' ORDER BY ordinal_position;

-- edit_feature: no EXECUTE for PUBLIC; every form is a C entry point that runs as the owner
-- (src/edit/entry.rs), with no SET clause (33_hostile_search_path).
SELECT p.oid::regprocedure AS function, p.prosecdef AS security_definer,
       p.proconfig AS config, has_function_privilege('public', p.oid, 'EXECUTE') AS public_execute
  FROM pg_proc p WHERE p.proname = 'edit_feature' ORDER BY 1::text;

-- PUBLIC gets no write on the extension's tables.
SELECT t, has_table_privilege('public', t, 'INSERT') AS ins, has_table_privilege('public', t, 'UPDATE') AS upd,
       has_table_privilege('public', t, 'DELETE') AS del
  FROM unnest(ARRAY['feature_outbox.features', 'feature_outbox.outbox']) t;

-- No triggers anywhere in the extension.
SELECT count(*) AS triggers FROM pg_trigger
 WHERE tgrelid IN ('feature_outbox.features'::regclass, 'feature_outbox.outbox'::regclass);

-- pg_dump keeps the tables' rows and the outbox sequence.
SELECT unnest(extconfig)::regclass AS dumped FROM pg_extension WHERE extname = 'feature_outbox' ORDER BY 1::text;

-- The resolution GUC: default 8, rejected out of range when set.
SHOW feature_outbox.h3_resolution;
SELECT try('SET feature_outbox.h3_resolution = 16');
SELECT try('SET feature_outbox.h3_resolution = -1');
SHOW feature_outbox.invalid_geometry;
SELECT try('SET feature_outbox.invalid_geometry = fix');
