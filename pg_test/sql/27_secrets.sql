-- Secrets stay secret. pg_db_role_setting is readable by every role, so an endpoint with
-- credentials, or http_secret, is refused per database or role (22023, saying why); files are the
-- per-database way. A database's owner who is no superuser cannot change its sink settings (42501).
-- An ordinary role cannot SHOW the secret settings (42501) nor read them in pg_settings, and a
-- pg_read_all_settings member sees ******** in their place.
SELECT try_detail(format('ALTER DATABASE %I SET feature_outbox.http_secret = %L', current_database(), 's3cret'));
SELECT try_detail(format('ALTER DATABASE %I SET feature_outbox.endpoint = %L', current_database(), 'nats://user:pass@127.0.0.1:4222'));
SELECT try_detail(format('ALTER DATABASE %I SET feature_outbox.endpoint = %L', current_database(), 'https://user:pass@example.org/hook'));
SELECT try_detail(format('ALTER ROLE %I SET feature_outbox.http_secret = %L', current_user, 's3cret'));
SELECT try_detail(format('ALTER ROLE %I IN DATABASE %I SET feature_outbox.endpoint = %L', current_user, current_database(), 'nats://tok@127.0.0.1:4222'));
SELECT count(*) AS settings_with_secrets FROM pg_db_role_setting WHERE array_to_string(setconfig, ',') ~ 's3cret|pass@|tok@';
-- Files are the per-database way, and a credential-free endpoint is fine.
SELECT try(format('ALTER DATABASE %I SET feature_outbox.http_secret_file = %L', current_database(), '/etc/feature_outbox/d.secret'));
SELECT try(format('ALTER DATABASE %I SET feature_outbox.endpoint = %L', current_database(), 'nats://127.0.0.1:1'));
SELECT unnest(setconfig) AS per_database FROM pg_db_role_setting WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) ORDER BY 1;
SELECT try(format('ALTER DATABASE %I RESET ALL', current_database()));

-- The owner of a database is not a superuser: the sink settings are not theirs to change.
CREATE ROLE regress_secrets_tenant;
CREATE ROLE regress_secrets_plain;
CREATE ROLE regress_secrets_reader IN ROLE pg_read_all_settings;
SELECT try(format('ALTER DATABASE %I OWNER TO regress_secrets_tenant', current_database()));
SET ROLE regress_secrets_tenant;
SELECT try(format('ALTER DATABASE %I SET feature_outbox.endpoint = %L', current_database(), 'nats://127.0.0.1:1'));
SELECT try(format('ALTER DATABASE %I SET feature_outbox.http_secret_file = %L', current_database(), '/tmp/x'));
SELECT try('SET feature_outbox.endpoint = ''http://attacker''');
\set VERBOSITY sqlstate
ALTER SYSTEM SET feature_outbox.endpoint = 'http://attacker';
\set VERBOSITY default
RESET ROLE;
SELECT try(format('ALTER DATABASE %I OWNER TO %I', current_database(), current_user));

-- A secret in this session (as the superuser set it), seen by others.
SET feature_outbox.http_secret = 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw';
SET feature_outbox.endpoint = 'nats://relay:s3cret@127.0.0.1:4222';
SHOW feature_outbox.http_secret;
SET ROLE regress_secrets_plain;
-- (The wording of PostgreSQL's refusal differs between majors: its SQLSTATE only.)
SELECT s AS setting, left(try(format('SHOW %s', s)), 5) AS show
  FROM unnest(ARRAY['feature_outbox.http_secret', 'feature_outbox.endpoint', 'feature_outbox.http_secret_file',
                    'feature_outbox.nats_credentials_file', 'feature_outbox.nats_nkey_file']) s;
SELECT count(*) FILTER (WHERE setting ~ 'whsec_|MfKQ9r8|s3cret') AS secrets_in_pg_settings FROM pg_settings WHERE name LIKE 'feature_outbox.%';
SET ROLE regress_secrets_reader;
SHOW feature_outbox.http_secret;
SHOW feature_outbox.endpoint;
SELECT name, setting FROM pg_settings WHERE name IN ('feature_outbox.http_secret', 'feature_outbox.endpoint') ORDER BY name;
RESET ROLE;
SHOW feature_outbox.endpoint;
RESET feature_outbox.http_secret;
RESET feature_outbox.endpoint;
DROP ROLE regress_secrets_tenant, regress_secrets_plain, regress_secrets_reader;
