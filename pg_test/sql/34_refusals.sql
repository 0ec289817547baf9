-- What the C entry points refuse before any statement of theirs runs, and the built-in move's
-- arguments in a database that is not UTF8 (src/edit/entry.rs, src/edit/moved.rs).
SELECT feature_outbox.edit_feature(3401, 'SRID=4326;POINT(10 50)'::geometry, 'created');

-- A read-only transaction (every transaction of a hot standby is one): 25006 from every form,
-- and no transaction id taken for it.
BEGIN READ ONLY;
SELECT try($$SELECT feature_outbox.edit_feature(3401, 'SRID=4326;POINT(10.5 50)'::geometry, 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(3401, '{"type":"Point","coordinates":[10.5,50]}', 'moved')$$);
SELECT try($$SELECT feature_outbox.edit_feature(3402, 'SRID=4326;POINT(10.5 50)'::geometry, 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature('features', 3401, 'SRID=4326;POINT(10.5 50)'::geometry, 'moved')$$);
SELECT pg_current_xact_id_if_assigned() IS NULL AS no_transaction_id;
ROLLBACK;
SELECT id, version FROM feature_outbox.features ORDER BY id;

-- A LATIN1 database: an event_type outside ASCII is unknown (22023), as in a UTF8 one; an ASCII
-- GeoJSON move takes the Rust path.
CREATE DATABASE regress_latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0;
\c regress_latin1
SET client_min_messages = warning;
CREATE EXTENSION feature_outbox CASCADE;
RESET client_min_messages;
SET client_encoding = 'UTF8';
SELECT feature_outbox.edit_feature(1, 'SRID=4326;POINT(2 2)'::geometry, 'created');
DO $$
BEGIN
    PERFORM feature_outbox.edit_feature(1, 'SRID=4326;POINT(2.5 2)'::geometry, 'mövéd');
EXCEPTION WHEN OTHERS THEN
    RAISE NOTICE '%', SQLSTATE;  -- the message quotes the text, whose bytes depend on the client
END $$;
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[3,2]}', 'moved') AS version;
-- Non-ASCII GeoJSON goes to _edit, which reads it in the database's encoding: a foreign member
-- with an accent is no error, and a misspelt type is 22P02, as in a UTF8 database (was XX000).
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[4,2],"title":"Café Müller"}', 'moved') AS version;
DO $$
BEGIN
    PERFORM feature_outbox.edit_feature(1, '{"type":"Pöint","coordinates":[3,2]}', 'moved');
EXCEPTION WHEN OTHERS THEN
    RAISE NOTICE '%', SQLSTATE;
END $$;
-- A layer name outside ASCII is no registered layer, in every form.
DO $$
DECLARE
    sql text;
BEGIN
    FOREACH sql IN ARRAY ARRAY[
        $q$SELECT feature_outbox.edit_feature('stråße', 1, 'SRID=4326;POINT(1 1)'::geometry, 'moved')$q$,
        $q$SELECT feature_outbox.edit_feature('stråße', 1, '{"type":"Point","coordinates":[1,1]}', 'moved')$q$,
        $q$SELECT feature_outbox.record_edit('stråße', 1, 'moved')$q$,
        $q$SELECT feature_outbox.edit_feature('stråße', 'k1', 'SRID=4326;POINT(1 1)'::geometry, 'moved')$q$]
    LOOP
        BEGIN
            EXECUTE sql;
        EXCEPTION WHEN OTHERS THEN
            RAISE NOTICE '%', SQLSTATE;
        END;
    END LOOP;
END $$;
SELECT o.feature_id, o.feature_version, o.event_type, o.routing_key = feature_outbox.routing_key(p.g) AS routed
  FROM feature_outbox.outbox o
  JOIN (VALUES (1, 'SRID=4326;POINT(2 2)'::geometry), (2, 'SRID=4326;POINT(3 2)'), (3, 'SRID=4326;POINT(4 2)')) p(version, g)
    ON p.version = o.feature_version
 ORDER BY o.id;
SELECT id, version, ST_AsText(geom) FROM feature_outbox.features;
\c regress_34_refusals
DROP DATABASE regress_latin1;
