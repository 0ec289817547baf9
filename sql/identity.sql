-- Database identity: which database this outbox speaks for. Every event carries the identity
-- (database_id), and a database whose outbox came from another one holds its rows until an
-- operator says what it is (resolve_copy). See the book's "Many databases" and "Upgrading" pages.
--
-- One row per source this outbox has spoken for: the install records this database's. pg_dump
-- keeps the rows (pg_extension_config_dump), so a restore brings the original's row beside the one
-- its own CREATE EXTENSION recorded: two rows mean a restored copy. A TEMPLATE or file-level copy
-- keeps the one row, recorded for another database oid or data directory.
CREATE TABLE IF NOT EXISTS database_identity (
    identity          uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    system_identifier bigint      NOT NULL,  -- pg_control_system(): new at every initdb (and pg_upgrade)
    database_oid      oid         NOT NULL,  -- kept by pg_upgrade (PostgreSQL 15+), new on restore or copy
    database_name     name        NOT NULL,
    data_directory    text        NOT NULL,
    timeline          integer     NOT NULL,  -- raised by every promotion of a standby
    recorded_at       timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE database_identity IS
    'The identity this database''s events carry, and where it was recorded; more than one row, or a row of another database, means a copy that waits for resolve_copy().';
SELECT pg_catalog.pg_extension_config_dump('database_identity', '');

-- Where this database runs now, in database_identity's terms. The timeline is the WAL insert
-- position's: a promotion raises it at once, before any checkpoint records it.
CREATE OR REPLACE FUNCTION _identity_here(OUT system_identifier bigint, OUT database_oid oid, OUT database_name name,
                                          OUT data_directory text, OUT timeline integer)
LANGUAGE sql VOLATILE
AS $$
    SELECT s.system_identifier, d.oid, d.datname, current_setting('data_directory'),
           ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer
      FROM pg_control_system() s, pg_database d
     WHERE d.datname = current_database()
$$;

-- The install records this database (an update, or a restore's CREATE EXTENSION into a database
-- that already has rows, finds them and adds none).
INSERT INTO database_identity (system_identifier, database_oid, database_name, data_directory, timeline)
SELECT h.system_identifier, h.database_oid, h.database_name, h.data_directory, h.timeline
  FROM _identity_here() h
 WHERE NOT EXISTS (SELECT 1 FROM database_identity);

-- What the relay makes of this database's identity, run by each worker at its start and, while
-- held, at every wake-up. state: 'serving' (identity is what events carry) or 'copy' (rows wait;
-- reason says why in one line and how to resolve it). The cases that go on by themselves update
-- the row: a promoted standby (higher timeline), pg_upgrade (new system identifier, same database
-- oid, one row), a renamed database.
CREATE OR REPLACE FUNCTION _identity_check(OUT state text, OUT identity uuid, OUT reason text)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    here record;
    n integer;
    r database_identity;
    resolve constant text := ' It relays nothing until SELECT feature_outbox.resolve_copy(''moved'') (it replaces the original: same identity)'
                             ' or resolve_copy(''new'') (a new source: new identity).';
BEGIN
    SELECT * INTO here FROM _identity_here();
    state := 'copy';
    SELECT count(*) INTO n FROM database_identity;
    IF n = 0 THEN
        reason :=
            format('database %s has no recorded identity (its database_identity row was deleted).', here.database_name) || resolve;
        RETURN;
    END IF;
    IF n > 1 THEN
        SELECT * INTO r FROM database_identity i
         WHERE (i.system_identifier, i.database_oid) <> (here.system_identifier, here.database_oid)
         ORDER BY i.recorded_at LIMIT 1;
        reason :=
            format('database %s is a restored copy of database %s (system %s, oid %s).',
                   here.database_name, r.database_name, r.system_identifier, r.database_oid) || resolve;
        RETURN;
    END IF;
    SELECT * INTO r FROM database_identity;
    IF r.database_oid <> here.database_oid THEN
        reason :=
            format('database %s is a copy of database %s (%s; recorded for oid %s, this is %s).',
                   here.database_name, r.database_name,
                   CASE WHEN r.system_identifier = here.system_identifier THEN 'CREATE DATABASE ... TEMPLATE'
                        ELSE 'from another server' END,
                   r.database_oid, here.database_oid) || resolve;
        RETURN;
    END IF;
    IF r.system_identifier = here.system_identifier AND r.data_directory <> here.data_directory
       AND here.timeline <= r.timeline THEN
        reason :=
            format('database %s runs in data directory %s but was recorded in %s on the same timeline: a file-level copy.',
                   here.database_name, here.data_directory, r.data_directory) || resolve;
        RETURN;
    END IF;
    -- The same database: in place, promoted from a standby, pg_upgraded, or renamed.
    IF (r.system_identifier, r.database_name, r.data_directory, r.timeline)
       IS DISTINCT FROM (here.system_identifier, here.database_name, here.data_directory, here.timeline) THEN
        UPDATE database_identity i
           SET system_identifier = here.system_identifier, database_name = here.database_name,
               data_directory = here.data_directory, timeline = here.timeline, recorded_at = now()
         WHERE i.identity = r.identity;
    END IF;
    state := 'serving';
    identity := r.identity;
END
$$;

-- The operator's answer for a held copy: 'moved' (this database replaces the original: its events
-- keep the original's identity, and the original must not relay again) or 'new' (a new source: a
-- new identity). `keep` picks the original's identity when a copy of a copy holds several. Raises
-- 22023 for another answer or a `keep` not recorded, 55000 when the database is not held as a copy
-- or 'moved' finds no single original identity (none recorded, or several and no `keep`).
CREATE OR REPLACE FUNCTION resolve_copy(decision text, keep uuid DEFAULT NULL) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    here record;
    kept uuid;
BEGIN
    SELECT * INTO here FROM _identity_here();
    IF decision IS NULL OR decision NOT IN ('moved', 'new') THEN
        RAISE EXCEPTION 'resolve_copy takes ''moved'' or ''new'', not %', coalesce(quote_literal(decision), 'NULL')
            USING ERRCODE = '22023',
                  HINT = '''moved'': this database replaces the original and keeps its identity; ''new'': a new source with a new identity.';
    END IF;
    IF (SELECT c.state FROM _identity_check() c) <> 'copy' THEN
        RAISE EXCEPTION 'database % is not held as a copy of another database', here.database_name
            USING ERRCODE = '55000';
    END IF;
    IF keep IS NOT NULL AND NOT EXISTS (SELECT 1 FROM database_identity i WHERE i.identity = keep) THEN
        RAISE EXCEPTION 'identity % is not recorded in database %', keep, here.database_name
            USING ERRCODE = '22023',
                  HINT = 'Pick one from SELECT * FROM feature_outbox.database_identity.';
    END IF;
    IF decision = 'moved' THEN
        SELECT i.identity INTO kept FROM database_identity i
         WHERE (keep IS NULL OR i.identity = keep)
           AND (i.system_identifier, i.database_oid) <> (here.system_identifier, here.database_oid)
         ORDER BY i.recorded_at;
        IF kept IS NULL OR (keep IS NULL AND (SELECT count(*) FROM database_identity i
                                               WHERE (i.system_identifier, i.database_oid)
                                                     <> (here.system_identifier, here.database_oid)) > 1) THEN
            RAISE EXCEPTION 'no single original identity to keep in database %', here.database_name
                USING ERRCODE = '55000',
                      HINT = 'Pass the identity to keep: resolve_copy(''moved'', keep => ''<uuid>''), from SELECT * FROM feature_outbox.database_identity.';
        END IF;
        DELETE FROM database_identity i WHERE i.identity <> kept;
    ELSE
        DELETE FROM database_identity;
        kept := gen_random_uuid();
        INSERT INTO database_identity (identity, system_identifier, database_oid, database_name, data_directory, timeline)
        VALUES (kept, here.system_identifier, here.database_oid, here.database_name, here.data_directory, here.timeline);
    END IF;
    UPDATE database_identity i
       SET system_identifier = here.system_identifier, database_oid = here.database_oid, database_name = here.database_name,
           data_directory = here.data_directory, timeline = here.timeline, recorded_at = now()
     WHERE i.identity = kept;
    -- The held workers look again when this commits.
    PERFORM _wake_relay_at_commit();
    RETURN kept;
END
$$;
COMMENT ON FUNCTION resolve_copy(text, uuid) IS
    'Resolves a database held as a copy: ''moved'' keeps the original''s identity, ''new'' draws a new one. Returns the identity its events carry from now on.';
