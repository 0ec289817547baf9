-- The database's identity (sql/identity.sql): the install records this database; _identity_check()
-- tells the relay whether the database serves as itself ('serving', with the identity its events
-- carry) or is a copy of another database ('copy', held, with the reason and the SQL that resolves
-- it). Each kind of copy is made here by changing the recorded row as the copy would find it; the
-- relay's side (held workers, restore, TEMPLATE, promotion) is pg_test/test_identity.py's.
CREATE FUNCTION here_row() RETURNS TABLE (rows bigint, this_oid boolean, this_name boolean, this_dir boolean, this_system boolean)
LANGUAGE sql AS $$
    SELECT count(*), bool_and(i.database_oid = d.oid), bool_and(i.database_name = d.datname),
           bool_and(i.data_directory = current_setting('data_directory')),
           bool_and(i.system_identifier = (SELECT system_identifier FROM pg_control_system()))
      FROM feature_outbox.database_identity i, pg_database d WHERE d.datname = current_database()
$$;
-- The check, with what varies between runs (oids, system identifiers, paths) masked.
CREATE FUNCTION checked() RETURNS TABLE (state text, same_identity boolean, reason text)
LANGUAGE sql AS $$
    SELECT c.state, c.identity = (SELECT min(identity::text)::uuid FROM feature_outbox.database_identity),
           regexp_replace(replace(replace(c.reason, current_setting('data_directory'), '<here>'), current_database(), '<db>'),
                          '[0-9]{2,}', 'N', 'g')
      FROM feature_outbox._identity_check() c
$$;
SELECT * FROM here_row();
SELECT * FROM checked();
-- The backlog says nothing is held (no worker holds this database).
SELECT relay_held_reason FROM feature_outbox.backlog;

-- resolve_copy refuses another answer (22023) and a database that is not a copy (55000).
SELECT try($$SELECT feature_outbox.resolve_copy('maybe')$$);
SELECT try($$SELECT feature_outbox.resolve_copy(NULL)$$);
SELECT try($$SELECT feature_outbox.resolve_copy('moved')$$);
SELECT try($$SELECT feature_outbox.resolve_copy('new')$$);

-- A restored copy: pg_restore brings the original's row beside the one CREATE EXTENSION recorded.
CREATE TABLE original AS SELECT * FROM feature_outbox.database_identity;
INSERT INTO feature_outbox.database_identity (identity, system_identifier, database_oid, database_name, data_directory, timeline)
VALUES ('00000000-0000-4000-8000-000000000001', 7000000000000000001, 4000000001, 'gis', '/srv/pg/data', 1);
SELECT * FROM checked();
-- 'moved' keeps the original's identity: the one row left is for this database.
SELECT feature_outbox.resolve_copy('moved');
SELECT * FROM here_row();
SELECT * FROM checked();

-- A copy of a copy holds two foreign rows: 'moved' must be told which one to keep.
INSERT INTO feature_outbox.database_identity (identity, system_identifier, database_oid, database_name, data_directory, timeline)
VALUES ('00000000-0000-4000-8000-000000000002', 7000000000000000002, 4000000002, 'gis_old', '/srv/pg/data', 1),
       ('00000000-0000-4000-8000-000000000003', 7000000000000000003, 4000000003, 'gis_older', '/srv/pg/data', 1);
SELECT try($$SELECT feature_outbox.resolve_copy('moved')$$);
SELECT try($$SELECT feature_outbox.resolve_copy('moved', '00000000-0000-4000-8000-00000000dead')$$);
SELECT feature_outbox.resolve_copy('moved', keep => '00000000-0000-4000-8000-000000000003');
SELECT identity FROM feature_outbox.database_identity;

-- CREATE DATABASE ... TEMPLATE: one row, recorded for another database oid of this server.
UPDATE feature_outbox.database_identity SET database_oid = 4000000004, database_name = 'gis',
       system_identifier = (SELECT system_identifier FROM pg_control_system());
SELECT * FROM checked();
-- 'new' draws a new identity.
SELECT feature_outbox.resolve_copy('new') <> '00000000-0000-4000-8000-000000000003' AS new_identity;
SELECT * FROM here_row();
SELECT * FROM checked();

-- The same from another server (a file copied elsewhere and attached under another oid).
UPDATE feature_outbox.database_identity SET database_oid = 4000000005, system_identifier = 7000000000000000005;
SELECT state, reason ~ 'from another server' FROM checked();
SELECT feature_outbox.resolve_copy('new') IS NOT NULL;

-- A file-level copy started as a new primary: same system and oid, another data directory, same
-- timeline.
UPDATE feature_outbox.database_identity SET data_directory = '/srv/elsewhere';
SELECT * FROM checked();
-- The same with a lower recorded timeline is a promoted standby: it serves on, the row updated.
UPDATE feature_outbox.database_identity SET timeline = 0;
CREATE TEMP TABLE before AS SELECT identity FROM feature_outbox.database_identity;
SELECT * FROM checked();
SELECT * FROM here_row();
SELECT i.identity = b.identity AS kept, i.timeline >= 1 AS timeline_now FROM feature_outbox.database_identity i, before b;

-- pg_upgrade: a new system identifier, the same database oid, one row: serves on, the row updated.
UPDATE feature_outbox.database_identity SET system_identifier = 7000000000000000006;
SELECT * FROM checked();
SELECT * FROM here_row();
-- A renamed database serves on too.
UPDATE feature_outbox.database_identity SET database_name = 'before_rename';
SELECT * FROM checked();
SELECT * FROM here_row();
SELECT i.identity = b.identity AS kept FROM feature_outbox.database_identity i, before b;

-- No row at all (deleted by hand): held; only 'new' resolves it.
DELETE FROM feature_outbox.database_identity;
SELECT * FROM checked();
SELECT try($$SELECT feature_outbox.resolve_copy('moved')$$);
SELECT feature_outbox.resolve_copy('new') IS NOT NULL;
SELECT * FROM here_row();

-- Privileges: resolve_copy is the operator's; the table and the check are not PUBLIC's.
CREATE ROLE identity_app;
SET ROLE identity_app;
SELECT try($$SELECT feature_outbox.resolve_copy('new')$$);
SELECT try($$SELECT * FROM feature_outbox.database_identity$$);
SELECT try($$SELECT * FROM feature_outbox._identity_check()$$);
RESET ROLE;
-- pg_dump keeps the rows (that is how a restore is told apart).
SELECT c.relname FROM pg_extension e, unnest(e.extconfig) t(oid) JOIN pg_class c ON c.oid = t.oid
 WHERE e.extname = 'feature_outbox' AND c.relname = 'database_identity';
DROP ROLE identity_app;
