-- An application role granted EXECUTE on edit_feature (and SELECT on features), as the README
-- shows, can edit but cannot write the tables directly, so it cannot bypass the outbox (gotcha 5).
CREATE ROLE regress_app LOGIN;
GRANT USAGE ON SCHEMA feature_outbox TO regress_app;
GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(bigint, text, text),
                          feature_outbox.edit_feature(bigint, geometry, text) TO regress_app;
GRANT SELECT ON feature_outbox.features TO regress_app;

SET ROLE regress_app;
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[13.5,52.5]}', 'moved');
SELECT id, version FROM feature_outbox.features;
SELECT try($$INSERT INTO feature_outbox.features (id, geom, version) VALUES (2, 'SRID=4326;POINT(1 1)', 1)$$);
SELECT try($$UPDATE feature_outbox.features SET geom = 'SRID=4326;POINT(1 1)' WHERE id = 1$$);
SELECT try($$DELETE FROM feature_outbox.features WHERE id = 1$$);
SELECT try($$INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key) VALUES (1, 9, 'moved', 'x')$$);
SELECT try($$UPDATE feature_outbox.outbox SET published_at = now()$$);
SELECT try($$DELETE FROM feature_outbox.outbox$$);
-- The internal function that does the writing is not callable either.
SELECT try($$SELECT feature_outbox._edit('features', 3, 'SRID=4326;POINT(1 1)'::geometry, 'created', NULL, NULL, false)$$);
-- Nor can it pass its edits off as captured or resynced: outbox.origin's default reads a value only
-- the library sets. There is no setting to change it, the default is the table owner's, and only a
-- superuser may bind a function to the library's C symbol.
SELECT feature_outbox._event_origin();
SELECT try($$SET feature_outbox.origin = 'captured'$$);
SELECT try($$ALTER TABLE feature_outbox.outbox ALTER COLUMN origin SET DEFAULT 'captured'$$);
SELECT try($$CREATE FUNCTION pg_temp.origin() RETURNS text LANGUAGE c AS 'feature_outbox', 'feature_outbox_event_origin'$$);
RESET ROLE;
SELECT feature_id, feature_version, origin FROM feature_outbox.outbox ORDER BY id;

-- A role without the grant cannot edit at all.
CREATE ROLE regress_other LOGIN;
SET ROLE regress_other;
SELECT try($$SELECT feature_outbox.edit_feature(3, '{"type":"Point","coordinates":[1,2]}', 'created')$$);
RESET ROLE;

SELECT written();
DROP OWNED BY regress_app, regress_other;
DROP ROLE regress_app, regress_other;
