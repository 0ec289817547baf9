-- Tables of feature_outbox. The control file pins the schema (schema = feature_outbox), so every
-- object lands there and nothing collides with a user's own `features` table.

CREATE TABLE features (
    id          bigint PRIMARY KEY,
    geom        geometry(Geometry, 4326) NOT NULL,
    version     integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    retired_at  timestamptz                      -- NULL while live
);
COMMENT ON TABLE features IS 'Feature geometries written by edit_feature; version counts every edit.';

CREATE TABLE outbox (
    id                   bigserial   PRIMARY KEY,
    -- The idempotency key: unique per event, stable across every retry; sent as Nats-Msg-Id / webhook-id.
    event_id             uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    feature_id           bigint      NOT NULL,
    feature_version      integer     NOT NULL,   -- the version this event describes
    -- created, moved, retired, updated or snapshot: outbox_values_check (sql/outbox_check.sql).
    event_type           text        NOT NULL,
    routing_key          text        NOT NULL,   -- H3 cell of the geometry written by this edit
    previous_routing_key text,                   -- H3 cell of the geometry before it; NULL for created
    schema_version       integer     NOT NULL DEFAULT 3,
    created_at           timestamptz NOT NULL DEFAULT now(),
    published_at         timestamptz,            -- set by the relay after the sink acknowledged
    -- Relay bookkeeping for failed deliveries (see README, "Failures").
    attempts             integer     NOT NULL DEFAULT 0,     -- every failed try, sink-level or row-level
    row_failures         integer     NOT NULL DEFAULT 0,     -- row-level failures; parks at max_attempts
    last_error           text,
    last_attempt_at      timestamptz,
    next_attempt_at      timestamptz,
    parked_at            timestamptz,
    -- The layer (layer_registry) whose table holds the feature; 'features' is the built-in table.
    layer                text        NOT NULL,
    -- Bounding box of the geometry before this edit, {west, south, east, north} in EPSG:4326 degrees
    -- (RFC 7946 §5), from the per-feature state at write time; NULL for created and snapshot.
    previous_bbox        float8[],
    -- Digests of the row as this edit wrote it (16 bytes as uuid): md5 of its geometry's EWKB, and of
    -- its registered properties' stored values (_properties_digest, src/edit/digest.rs). drift() compares a row with its last event's.
    -- NULL for events written before 0.3.0.
    geometry_digest      uuid,
    properties_digest    uuid,
    -- The feature's key as the application stores it, for a layer keyed by uuid or text (0.3.0);
    -- feature_id is then the extension's own number for it (feature_state.feature_key). NULL for
    -- integer keys, which feature_id is.
    feature_key          text,
    -- The writer's W3C trace context (0.3.0): feature_outbox.traceparent and .tracestate in effect at
    -- write time, sent with the event; their defaults (sql/trace.sql) read them. NULL without one.
    traceparent          text,
    tracestate           text,
    -- Where the event comes from (0.5.0): 'application' (the extension's functions), 'captured' (the
    -- capture worker, for a write made outside them) or 'resync'. Its default, _event_origin(), is
    -- set by sql/origin.sql, which declares it; its values are checked with event_type's
    -- (outbox_values_check). Last: an update appends it (sql/updates/).
    origin               text        NOT NULL
    -- Deliberately no geometry column: the relay reads the layer's table, so an edit writes its shape once.
);
COMMENT ON TABLE outbox IS 'One thin row per edit, written in the edit''s transaction and relayed at least once.';

-- The relay only ever scans unpublished rows, so index exactly those.
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
-- Parked rows below the claim's low-water mark, which the backlog counts without walking the rest.
CREATE INDEX outbox_parked ON outbox (id) WHERE parked_at IS NOT NULL AND published_at IS NULL;
-- Rows waiting for their per-row retry time: the claim holds back the later rows of their features
-- (per-feature order). Only failing rows are in it, so edits never write to it.
CREATE INDEX outbox_waiting ON outbox (feature_id) WHERE published_at IS NULL AND next_attempt_at IS NOT NULL;
-- Retention deletes and last_published_at read published rows by time, without scanning history.
CREATE INDEX outbox_published_at ON outbox (published_at) WHERE published_at IS NOT NULL;

-- pg_dump keeps the rows (and the sequence position) of extension tables only when registered.
SELECT pg_catalog.pg_extension_config_dump('features', '');
SELECT pg_catalog.pg_extension_config_dump('outbox', '');
SELECT pg_catalog.pg_extension_config_dump('outbox_id_seq', '');

-- Each feature's current state, kept by the edit path so that the next edit reads its previous
-- routing key instead of recomputing it, and the state before the last edit. Keyed by layer
-- ('features' is the built-in table), so the user's own tables, which cannot take extra columns,
-- use it unchanged. An edit updates its row first: the row lock orders the edits of one feature,
-- and SET previous_* = the old values hands the old state back through RETURNING.
CREATE TABLE feature_state (
    layer                   text     NOT NULL,
    feature_id              bigint   NOT NULL,
    routing_key             text     NOT NULL,  -- H3 cell of the current geometry's routing point
    h3_resolution           smallint NOT NULL,  -- the resolution routing_key was computed at
    routing_point           float8[] NOT NULL,  -- {longitude, latitude} in EPSG:4326 degrees
    -- Bounding box of the current geometry: {west, south, east, north} in EPSG:4326 degrees, as
    -- RFC 7946 §5.2 (west > east for a feature across the antimeridian).
    bbox                    float8[] NOT NULL,
    -- The same four before the last edit; NULL until the second edit.
    previous_routing_key    text,
    previous_h3_resolution  smallint,
    previous_routing_point  float8[],
    previous_bbox           float8[],
    -- The user-table row version (tableoid:ctid:xmin) the last event was recorded for, so that
    -- record_edit refuses a second event for an unchanged row. NULL for the built-in layer.
    row_version             text,
    -- The last event's digests (see outbox), version and type. NULL for a feature whose last event
    -- was written before 0.3.0 (drift() reports it 'unknown' until resync takes its digests, and
    -- last_event is then 'baseline').
    geometry_digest         uuid,
    properties_digest       uuid,
    version                 integer,
    last_event              text,
    -- A uuid or text key (canonical text form), for which feature_id is its number (feature_keys);
    -- NULL for integer keys.
    feature_key             text,
    PRIMARY KEY (layer, feature_id)
);
-- Numbers for uuid and text keys: per-feature order, partitioning and state run on bigints. Kept
-- apart from feature_state, whose updates (one per edit) would otherwise maintain one more index.
CREATE SEQUENCE feature_key_seq;
CREATE TABLE feature_keys (
    layer        text   NOT NULL,
    feature_key  text   NOT NULL,  -- canonical text of a uuid or text key
    feature_id   bigint NOT NULL,  -- its number, from feature_key_seq
    PRIMARY KEY (layer, feature_key),
    UNIQUE (layer, feature_id)
);
COMMENT ON TABLE feature_keys IS 'The number of each uuid or text key of a layer, drawn at its first event.';
SELECT pg_catalog.pg_extension_config_dump('feature_key_seq', '');
SELECT pg_catalog.pg_extension_config_dump('feature_keys', '');
COMMENT ON TABLE feature_state IS 'Per-feature routing state written by edit_feature: routing key, its H3 resolution, routing point and bounding box, now and before the last edit.';
SELECT pg_catalog.pg_extension_config_dump('feature_state', '');

-- The layers: tables whose rows edit_feature and record_edit write events for. The built-in table is
-- the layer 'features'; register_layer adds the user's own (sql/layers.sql).
CREATE TABLE layer_registry (
    layer            text     PRIMARY KEY CHECK (layer ~ '^[a-z0-9_-]{1,64}$'),  -- a NATS subject token
    tbl              regclass NOT NULL,
    id_column        name     NOT NULL,
    geometry_column  name     NOT NULL,
    version_column   name     NOT NULL,
    properties       name[]   NOT NULL DEFAULT '{}',
    retired_column   name,                -- NULL: retired deletes the row
    srid             integer  NOT NULL,   -- the geometry column's declared SRID
    geometry_type    text     NOT NULL,   -- the column's declared type (postgis_typmod_type), e.g. Polygon
    -- Outbox rows below this id were written for an earlier layer of the same name (unregistered since).
    since_id         bigint   NOT NULL DEFAULT 0,
    registered_at    timestamptz NOT NULL DEFAULT now(),
    -- format_type of each registered column (_layer_columns order) at registration; the DDL guard
    -- (sql/ddl_guard.sql) refuses an ALTER TABLE after which they differ. NULL for the built-in table.
    column_types     text[],
    -- drift()'s last count of rows that differ from their last event, and when it ran (resync's
    -- rows left over count too).
    drift_rows       bigint,
    drift_checked_at timestamptz,
    -- Set by the relay when the layer's table or a registered column is gone (dropped past the DDL
    -- guard): its rows wait, unpublished and unparked, until release_layer() clears these.
    held_since       timestamptz,
    held_reason      text,
    -- The id column's type: smallint, integer, bigint (the key is feature_id), uuid, text or
    -- character varying (0.3.0: feature_key).
    id_type          regtype  NOT NULL DEFAULT 'bigint',
    -- Since when writes made outside the functions become events (capture_layer, 0.5.0); NULL:
    -- not captured.
    captured_at      timestamptz
);
COMMENT ON TABLE layer_registry IS 'One row per layer: the table, its id, geometry, version and retired columns, and the properties each event carries.';
INSERT INTO layer_registry (layer, tbl, id_column, geometry_column, version_column, retired_column, srid, geometry_type)
VALUES ('features', 'features', 'id', 'geom', 'version', 'retired_at', 4326, 'Geometry');
-- CREATE EXTENSION writes the built-in row again at restore: dump the user's layers only.
SELECT pg_catalog.pg_extension_config_dump('layer_registry', 'WHERE layer <> ''features''');

-- What the Rust helpers of the edit path return, by name (0.4.0; before, positional arrays).
-- _inspect_geometry: the one pass over an edit's geometry (src/edit/mod.rs).
CREATE TYPE geometry_facts AS (
    antimeridian  boolean,   -- an edge spans more than 180° of longitude: the shape crosses the antimeridian
    polar         integer,   -- a ring winds around the South Pole (-1) or the North Pole (1); 0: neither
    bbox          float8[],  -- {west, south, east, north} in EPSG:4326 degrees, as feature_state.bbox
    h3_resolution integer    -- feature_outbox.h3_resolution when the pass ran
);
-- _layer_write_row: a user layer's row as an edit wrote it (src/edit/layers.rs).
CREATE TYPE layer_write AS (
    version           integer,  -- the row's new version (for a delete: the version it would have had)
    row_version       text,     -- tableoid:ctid:xmin of the row as written
    geometry_digest   uuid,     -- md5 of its geometry's EWKB
    properties_digest uuid      -- _properties_digest of its registered properties
);
