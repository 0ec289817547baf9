-- Tile expiry: every edit of a layer attached to an expire output expires the Web Mercator XYZ tiles
-- it changed, delivered at least once to the output's destinations (osm2pgsql's expire table, a
-- NATS subject, an HTTP URL). The words are osm2pgsql's (manual, "Expire"): an output has a zoom
-- range and destinations; a layer is attached to it with a mode, a buffer and diff_expire.
--
-- The edit keeps shapes, never tiles: a layer with an output keeps each feature's last shape
-- (tile_shapes, EPSG:4326 WKB) and queues each edit's old and new shape once per output
-- (tile_queue). The relay's workers turn queued edits into tiles outside the edit (src/tiles/,
-- src/relay/expire.rs), merge them per batch, deliver them, and only then delete the queued rows.
-- Layers without an output write nothing of this.

CREATE TABLE IF NOT EXISTS expire_outputs (
    name               text    PRIMARY KEY CHECK (name ~ '^[a-z0-9_-]{1,64}$'),
    minzoom            integer NOT NULL,
    maxzoom            integer NOT NULL,
    -- osm2pgsql's expire table, schema-qualified and quoted as format('%I.%I') writes it.
    expire_table       text,
    subject            text,    -- a NATS subject for the tile lists (the relay's NATS endpoint)
    url                text,    -- an HTTP endpoint each tile list is POSTed to (text/plain)
    -- An HTTP tile cache to purge the expired tiles from: a URL template with {z}, {x} and {y},
    -- and how (xkey: Varnish's xkey vmod, many tiles per request; purge: one PURGE per tile URL).
    cache_url          text,
    cache_method       text     CHECK (cache_method IN ('xkey', 'purge')),
    -- Tiles over all zooms one shape may expire before it falls back to its boundary.
    max_tiles_geometry bigint  NOT NULL DEFAULT 100000 CHECK (max_tiles_geometry >= 1),
    defined_at         timestamptz NOT NULL DEFAULT now(),
    CHECK (0 <= minzoom AND minzoom <= maxzoom AND maxzoom <= 20),
    CHECK ((cache_url IS NULL) = (cache_method IS NULL)),
    CHECK (expire_table IS NOT NULL OR subject IS NOT NULL OR url IS NOT NULL OR cache_url IS NOT NULL)
);
COMMENT ON TABLE expire_outputs IS 'Expire outputs (osm2pgsql''s term): a zoom range and where the expired tiles go.';
SELECT pg_catalog.pg_extension_config_dump('expire_outputs', '');

CREATE TABLE IF NOT EXISTS expire_rules (
    layer           text    NOT NULL REFERENCES layer_registry (layer) ON DELETE CASCADE,
    output          text    NOT NULL REFERENCES expire_outputs (name) ON DELETE CASCADE,
    mode            text    NOT NULL DEFAULT 'full-area' CHECK (mode IN ('full-area', 'boundary-only', 'hybrid')),
    buffer          float8  NOT NULL DEFAULT 0.1 CHECK (buffer >= 0 AND buffer <= 1),
    full_area_limit float8  CHECK ((mode = 'hybrid') = (full_area_limit IS NOT NULL)),
    diff            boolean NOT NULL DEFAULT true,
    PRIMARY KEY (layer, output)
);
COMMENT ON TABLE expire_rules IS 'Which layers expire tiles into which output, and how (osm2pgsql''s mode, buffer, full_area_limit, diff_expire).';
SELECT pg_catalog.pg_extension_config_dump('expire_rules', '');
-- Each backend keeps the set of layers with a rule (_layer_expires, src/tiles/rule_cache.rs), which
-- every edit asks for; any write to the table, cascades included, tells every backend to read it again.
CREATE OR REPLACE FUNCTION _expire_rules_touched() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM _expire_rules_changed();
    RETURN NULL;
END
$$;
CREATE OR REPLACE TRIGGER expire_rules_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON expire_rules
    FOR EACH STATEMENT EXECUTE FUNCTION _expire_rules_touched();
-- Also under session_replication_role = replica (logical replication's apply, restore tools).
ALTER TABLE expire_rules ENABLE ALWAYS TRIGGER expire_rules_changed;

-- The last shape of each feature of a layer with an output, so that the next edit (record_edit's
-- too, whose row is already written) knows its old side.
CREATE TABLE IF NOT EXISTS tile_shapes (
    layer             text   NOT NULL REFERENCES layer_registry (layer) ON DELETE CASCADE,
    feature_id        bigint NOT NULL,
    shape             bytea  NOT NULL,  -- WKB, EPSG:4326 degrees, as the edit stored it
    properties_digest uuid,             -- the edit's, to tell a move that changed attributes too
    PRIMARY KEY (layer, feature_id)
);
SELECT pg_catalog.pg_extension_config_dump('tile_shapes', '');
-- WKB does not compress (doubles); TOAST would try pglz on every shape over 2 kB first.
ALTER TABLE tile_shapes ALTER COLUMN shape SET STORAGE EXTERNAL;
-- Room on each page for the next version of its rows: an edit's swap of the kept shape then stays
-- on the page (a HOT update, no index entry).
ALTER TABLE tile_shapes SET (fillfactor = 80);

-- Edits whose tiles an output has yet to receive; deleted once its destinations took them.
CREATE TABLE IF NOT EXISTS tile_queue (
    output             text      NOT NULL,
    outbox_id          bigint    NOT NULL,
    layer              text      NOT NULL,
    -- The outbox row's: the relay worker that owns the feature's events owns its tiles too, so
    -- the commit that wakes it for the event wakes it for the tiles.
    feature_id         bigint    NOT NULL,
    event_type         text      NOT NULL,
    old_shape          bytea,    -- NULL for created and snapshot, and where it was never kept
    new_shape          bytea,    -- NULL for retired
    previous_bbox      float8[], -- the outbox row's: the fallback for an old shape never kept
    properties_changed boolean   NOT NULL,
    -- The layer's rule when the edit was made (expire_rules), so that a rule changed or detached
    -- later does not change which tiles a waiting edit expires.
    mode               text      NOT NULL,
    buffer             float8    NOT NULL,
    full_area_limit    float8,
    diff               boolean   NOT NULL,
    queued_at          timestamptz NOT NULL DEFAULT now(),
    -- A destination that refused this edit's tiles (a cache's 4xx): failures so far, the last
    -- one's reason, and when feature_outbox.max_attempts of them parked the edit (retry_parked()).
    attempts           integer   NOT NULL DEFAULT 0,
    last_error         text,
    parked_at          timestamptz,
    PRIMARY KEY (output, outbox_id)
);
SELECT pg_catalog.pg_extension_config_dump('tile_queue', '');
ALTER TABLE tile_queue ALTER COLUMN old_shape SET STORAGE EXTERNAL, ALTER COLUMN new_shape SET STORAGE EXTERNAL;

-- Per output, what the relay delivered and how it went; written by the relay only.
CREATE TABLE IF NOT EXISTS expire_progress (
    output             text     PRIMARY KEY REFERENCES expire_outputs (name) ON DELETE CASCADE,
    tiles_by_zoom      bigint[] NOT NULL DEFAULT array_fill(0::bigint, ARRAY[21]),  -- [1] is zoom 0
    edits              bigint   NOT NULL DEFAULT 0,
    lists_sent         bigint   NOT NULL DEFAULT 0,
    purge_requests     bigint   NOT NULL DEFAULT 0,  -- requests the cache acknowledged
    boundary_fallbacks bigint   NOT NULL DEFAULT 0,  -- shapes over max_tiles_geometry
    dropped_zooms      bigint   NOT NULL DEFAULT 0,  -- shapes whose boundary was over it too
    box_fallbacks      bigint   NOT NULL DEFAULT 0,  -- old sides never kept: their box instead
    last_sent_at       timestamptz,
    last_error         text,
    last_error_at      timestamptz
);

-- Queues an edit's shapes for each output its layer is attached to, and keeps the feature's new
-- shape. Called after outbox row p_outbox_id was written, for layers with an output only: by _edit
-- with the row's layer, feature, event type and properties digest; by backfill and resync with
-- those NULL (read from the row). p_new is the stored geometry as EPSG:4326 WKB (NULL when the
-- edit carried none).
CREATE OR REPLACE FUNCTION _tile_keep(p_outbox_id bigint, p_new bytea, p_layer text DEFAULT NULL, p_feature_id bigint DEFAULT NULL,
                                      p_event_type text DEFAULT NULL, p_digest uuid DEFAULT NULL) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    -- Two statements on the common path (the kept shape swapped and read back in one, then the
    -- queue): every statement costs an edit of such a layer an executor start and end, the bulk
    -- of what tiles add to it (issue 39's edit path target).
    v_kept bytea;
    v_kept_digest uuid;
    v_previous_bbox float8[];
BEGIN
    IF p_layer IS NULL THEN
        SELECT b.layer, b.feature_id, b.event_type, b.properties_digest INTO p_layer, p_feature_id, p_event_type, p_digest
          FROM outbox b WHERE b.id = p_outbox_id;
    END IF;
    IF p_event_type = 'retired' THEN
        DELETE FROM tile_shapes s WHERE s.layer = p_layer AND s.feature_id = p_feature_id
        RETURNING s.shape, s.properties_digest INTO v_kept, v_kept_digest;
    ELSE
        -- The join reads the row as the statement found it: RETURNING k.* is the shape before.
        UPDATE tile_shapes s SET shape = coalesce(p_new, k.shape), properties_digest = p_digest
          FROM tile_shapes k
         WHERE s.layer = p_layer AND s.feature_id = p_feature_id AND k.layer = p_layer AND k.feature_id = p_feature_id
        RETURNING k.shape, k.properties_digest INTO v_kept, v_kept_digest;
        IF NOT FOUND AND p_new IS NOT NULL THEN
            INSERT INTO tile_shapes AS s (layer, feature_id, shape, properties_digest) VALUES (p_layer, p_feature_id, p_new, p_digest)
            ON CONFLICT (layer, feature_id) DO UPDATE SET shape = EXCLUDED.shape, properties_digest = EXCLUDED.properties_digest;
        END IF;
    END IF;
    IF v_kept IS NULL AND (p_new IS NULL OR p_event_type = 'moved') THEN
        -- An old side never kept: the box the outbox row recorded stands in for it, and where there
        -- is none either (a snapshot of a feature never kept), the feature's current box.
        SELECT b.previous_bbox INTO v_previous_bbox FROM outbox b WHERE b.id = p_outbox_id;
        IF p_new IS NULL AND v_previous_bbox IS NULL THEN
            SELECT f.bbox INTO v_previous_bbox FROM feature_state f WHERE f.layer = p_layer AND f.feature_id = p_feature_id;
        END IF;
    END IF;
    INSERT INTO tile_queue (output, outbox_id, layer, feature_id, event_type, old_shape, new_shape, previous_bbox,
                            properties_changed, mode, buffer, full_area_limit, diff)
    SELECT r.output, p_outbox_id, p_layer, p_feature_id, p_event_type,
           CASE WHEN p_event_type IN ('created', 'snapshot') THEN NULL
                WHEN p_event_type = 'retired' THEN coalesce(v_kept, p_new) ELSE v_kept END,
           CASE WHEN p_event_type = 'retired' THEN NULL ELSE coalesce(p_new, v_kept) END,
           v_previous_bbox, v_kept_digest IS DISTINCT FROM p_digest,
           r.mode, r.buffer, r.full_area_limit, r.diff
      FROM expire_rules r WHERE r.layer = p_layer;
END
$$;

-- Keeps the current shape of each of a layer's live features that has had an event (as
-- EPSG:4326 WKB, with the properties digest of its last event), read from its table with the
-- caller's rights: run by expire_layer when the layer gets its first output. Returns the count.
CREATE OR REPLACE FUNCTION _tile_seed(p_layer text) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    lay layer_registry;
    keyed boolean;  -- the layer's key is uuid or text: its numbers are in feature_keys
    n bigint;
BEGIN
    SELECT * INTO lay FROM layer_registry r WHERE r.layer = p_layer;
    keyed := _key_cast(lay.id_type) <> 'bigint';
    IF p_layer = 'features' THEN
        INSERT INTO tile_shapes (layer, feature_id, shape, properties_digest)
        SELECT p_layer, f.id, ST_AsBinary(f.geom), s.properties_digest
          FROM features f JOIN feature_state s ON s.layer = p_layer AND s.feature_id = f.id
         WHERE f.retired_at IS NULL;
    ELSE
        EXECUTE format('INSERT INTO tile_shapes (layer, feature_id, shape, properties_digest)
                        SELECT $1, s.feature_id, ST_AsBinary(ST_Transform(t.%1$I, 4326)), s.properties_digest
                          FROM %2$s t %3$s
                          JOIN feature_state s ON s.layer = $1 AND s.feature_id = %4$s
                         WHERE t.%1$I IS NOT NULL AND NOT ST_IsEmpty(t.%1$I)%5$s',
                       lay.geometry_column, lay.tbl,
                       CASE WHEN keyed THEN format('JOIN feature_keys k ON k.layer = $1 AND k.feature_key = t.%I::text', lay.id_column)
                            ELSE '' END,
                       CASE WHEN keyed THEN 'k.feature_id' ELSE format('t.%I::bigint', lay.id_column) END,
                       CASE WHEN lay.retired_column IS NULL THEN '' ELSE format(' AND t.%I IS NULL', lay.retired_column) END)
          USING p_layer;
    END IF;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- An argument that must not be NULL, passed through: 22004 naming it (the tile functions' Rust
-- side would raise XX000 with its position).
CREATE OR REPLACE FUNCTION _not_null(v anyelement, what text) RETURNS anyelement
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF v IS NULL THEN
        RAISE EXCEPTION '% must not be NULL', what USING ERRCODE = '22004';
    END IF;
    RETURN v;
END
$$;

-- osm2pgsql's expire table: columns zoom, x, y, first, last and PRIMARY KEY (zoom, x, y), created
-- when missing; an existing table must have those columns and that key (42P16 otherwise).
CREATE OR REPLACE FUNCTION _expire_table(p_table text) RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    parts text[];
    rel regclass;
    missing text;
BEGIN
    BEGIN
        parts := parse_ident(p_table);
    EXCEPTION WHEN invalid_parameter_value THEN
        parts := NULL;
    END;
    IF parts IS NULL OR cardinality(parts) <> 2 THEN
        RAISE EXCEPTION 'expire table % is not a schema-qualified table name', quote_literal(p_table) USING ERRCODE = '22023',
            HINT = 'Name it with its schema, e.g. ''public.expire_tiles''.';
    END IF;
    IF to_regnamespace(quote_ident(parts[1])) IS NULL THEN
        RAISE EXCEPTION 'schema % does not exist', quote_ident(parts[1]) USING ERRCODE = '3F000';
    END IF;
    IF to_regclass(format('%I.%I', parts[1], parts[2])) IS NULL THEN
        EXECUTE format('CREATE TABLE %I.%I (zoom int4 NOT NULL, x int4 NOT NULL, y int4 NOT NULL,'
                       ' first timestamp with time zone DEFAULT CURRENT_TIMESTAMP(0),'
                       ' last timestamp with time zone DEFAULT CURRENT_TIMESTAMP(0), PRIMARY KEY (zoom, x, y))', parts[1], parts[2]);
    END IF;
    rel := format('%I.%I', parts[1], parts[2])::regclass;
    -- What the relay's upsert needs, checked now: a table it can never write would hold back its
    -- output for ever. The columns with osm2pgsql's types, no other column it cannot fill, and a
    -- unique key on (zoom, x, y) that ON CONFLICT can use (not partial, not deferrable).
    SELECT string_agg(format('%s %s', c, t), ', ') INTO missing
      FROM unnest(ARRAY['zoom', 'x', 'y', 'first', 'last'], ARRAY['integer', 'integer', 'integer', 'timestamptz', 'timestamptz']) u(c, t)
     WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = rel AND a.attname = c AND NOT a.attisdropped
                          AND a.atttypid = t::regtype);
    IF missing IS NULL THEN
        SELECT format('Its column %I is NOT NULL without a default, and the relay writes only zoom, x and y.', a.attname) INTO missing
          FROM pg_attribute a
         WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attnotnull AND NOT a.atthasdef
           AND a.attidentity = '' AND a.attgenerated = '' AND a.attname NOT IN ('zoom', 'x', 'y')
         LIMIT 1;
    ELSE
        missing := format('It lacks the columns %s.', missing);
    END IF;
    IF missing IS NULL AND NOT EXISTS (
           SELECT 1 FROM pg_index i WHERE i.indrelid = rel AND i.indisunique AND i.indimmediate AND i.indpred IS NULL
              AND i.indexprs IS NULL AND i.indnkeyatts = 3
              AND (SELECT array_agg(a.attname::text ORDER BY k.n) FROM unnest(i.indkey) WITH ORDINALITY k(attnum, n)
                     JOIN pg_attribute a ON a.attrelid = rel AND a.attnum = k.attnum) = ARRAY['zoom', 'x', 'y']) THEN
        missing := 'It has no unique key on (zoom, x, y) that ON CONFLICT can use (one that is neither partial nor deferrable).';
    END IF;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'table % is not an expire table', rel USING ERRCODE = '42P16', DETAIL = missing,
            HINT = 'osm2pgsql''s expire table has columns zoom, x, y (int4), first and last (timestamptz) and PRIMARY KEY (zoom, x, y); name a new table and it is created so.';
    END IF;
    -- The relay writes the table as its owner, in a restricted context: the caller must be allowed
    -- to write it, or an output would write where its definer cannot.
    IF NOT has_table_privilege(rel, 'INSERT') OR NOT has_table_privilege(rel, 'UPDATE') THEN
        RAISE EXCEPTION 'permission denied: expire table % needs INSERT and UPDATE for %', rel, current_user USING ERRCODE = '42501',
            HINT = 'The relay writes the table with its owner''s rights; the role defining the output must be allowed to write it too.';
    END IF;
    RETURN format('%I.%I', parts[1], parts[2]);
END
$$;

CREATE OR REPLACE FUNCTION define_expire_output(name text, maxzoom integer, minzoom integer DEFAULT 0, "table" text DEFAULT NULL,
                                                subject text DEFAULT NULL, url text DEFAULT NULL,
                                                max_tiles_geometry bigint DEFAULT 100000, cache_url text DEFAULT NULL,
                                                cache_method text DEFAULT 'xkey') RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    prefix text := current_setting('feature_outbox.nats_subject_prefix');
BEGIN
    IF name IS NULL OR name !~ '^[a-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'expire output name % is not valid', coalesce(quote_literal(name), 'NULL') USING ERRCODE = '22023',
            HINT = 'Use 1 to 64 characters of a-z, 0-9, _ and -.';
    END IF;
    PERFORM _not_null(maxzoom, 'maxzoom'), _not_null(minzoom, 'minzoom'), _not_null(max_tiles_geometry, 'max_tiles_geometry');
    -- Zooms, and the tile limit, as the relay will read them (22023 with the reason).
    PERFORM _expire_rule_check(minzoom, maxzoom, 0.1, 'full-area', NULL, max_tiles_geometry);
    IF "table" IS NULL AND subject IS NULL AND url IS NULL AND cache_url IS NULL THEN
        RAISE EXCEPTION 'expire output % has no destination', name USING ERRCODE = '22023',
            HINT = 'Give a table (osm2pgsql''s expire table), a NATS subject, a URL, a cache_url, or any of them.';
    END IF;
    IF subject IS NOT NULL AND (subject !~ '^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$' OR length(subject) > 255) THEN
        RAISE EXCEPTION 'subject % is not a NATS subject for publishing', quote_literal(subject) USING ERRCODE = '22023',
            HINT = 'Tokens of letters, digits, _ and - separated by dots, without wildcards, e.g. ''tiles.parcels''.';
    END IF;
    IF subject = prefix OR starts_with(subject, prefix || '.') THEN
        RAISE EXCEPTION 'subject % lies under the events'' subjects (%.>)', quote_literal(subject), prefix USING ERRCODE = '22023',
            HINT = 'Tile lists go to a JetStream stream of their own; pick a subject outside feature_outbox.nats_subject_prefix.';
    END IF;
    IF subject IS NOT NULL AND EXISTS (SELECT 1 FROM expire_outputs o WHERE o.subject = define_expire_output.subject
                                                                      AND o.name <> define_expire_output.name) THEN
        RAISE EXCEPTION 'subject % is the subject of expire output %', quote_literal(subject),
            (SELECT o.name FROM expire_outputs o WHERE o.subject = define_expire_output.subject) USING ERRCODE = '23505',
            HINT = 'Each output''s tile lists need a subject of their own: a tile pipeline reads one output''s lists.';
    END IF;
    -- Only the characters a URI may hold (RFC 3986, section 2): the HTTP client refuses the rest at
    -- each delivery, which would hold the output back for ever.
    IF url IS NOT NULL AND (url !~* '^https?://[^/\s]+' OR url !~ '^[A-Za-z0-9._~:/?#@!$&''()*+,;=%\[\]-]+$') THEN
        RAISE EXCEPTION 'url % is not an http:// or https:// URL', quote_literal(url) USING ERRCODE = '22023',
            HINT = 'A URL holds only the characters RFC 3986 allows: percent-encode spaces and the like.';
    END IF;
    IF cache_url IS NULL AND cache_method IS DISTINCT FROM 'xkey' THEN
        RAISE EXCEPTION 'cache_method % without a cache_url', coalesce(quote_literal(cache_method), 'NULL') USING ERRCODE = '22023',
            HINT = 'cache_method says how the cache at cache_url is purged; give the cache_url too.';
    END IF;
    IF cache_url IS NOT NULL THEN
        PERFORM _not_null(cache_method, 'cache_method');
        IF cache_method NOT IN ('xkey', 'purge') THEN
            RAISE EXCEPTION 'cache_method % is not xkey or purge', quote_literal(cache_method) USING ERRCODE = '22023',
                HINT = 'xkey purges many tiles per request (Varnish''s xkey vmod, the VCL on the Tile caches page); purge sends one PURGE per tile URL.';
        END IF;
        -- A URL template: an http(s) URL of at most 2,000 characters holding {z}, {x} and {y} once
        -- each, all three in its path (a cache tags a tile by its path: the VCL's xkey), no
        -- fragment, otherwise only what RFC 3986 allows.
        IF cache_url !~* '^https?://[^/\s{}]+/' OR length(cache_url) > 2000 OR strpos(cache_url, '#') > 0
           OR replace(replace(replace(cache_url, '{z}', '0'), '{x}', '0'), '{y}', '0')
              !~ '^[A-Za-z0-9._~:/?@!$&''()*+,;=%\[\]-]+$'
           OR (SELECT count(*) FROM regexp_matches(cache_url, '\{[zxy]\}', 'g')) <> 3
           OR (SELECT count(DISTINCT m[1]) FROM regexp_matches(substring(cache_url FROM '^https?://[^/]+(/[^?]*)'), '\{([zxy])\}', 'g') m) <> 3 THEN
            RAISE EXCEPTION 'cache_url % is not a tile URL template', quote_literal(left(regexp_replace(cache_url, '[[:cntrl:]]', '?', 'g'), 200))
                USING ERRCODE = '22023',
                HINT = 'An http:// or https:// URL of at most 2,000 characters with {z}, {x} and {y} once each in its path and no fragment, e.g. ''http://127.0.0.1:6081/parcels/{z}/{x}/{y}''.';
        END IF;
    END IF;
    INSERT INTO expire_outputs AS o (name, minzoom, maxzoom, expire_table, subject, url, max_tiles_geometry, cache_url, cache_method)
    VALUES (define_expire_output.name, minzoom, maxzoom, CASE WHEN "table" IS NOT NULL THEN _expire_table("table") END,
            subject, url, max_tiles_geometry, cache_url, CASE WHEN cache_url IS NOT NULL THEN cache_method END)
    ON CONFLICT ON CONSTRAINT expire_outputs_pkey DO UPDATE
       SET minzoom = EXCLUDED.minzoom, maxzoom = EXCLUDED.maxzoom, expire_table = EXCLUDED.expire_table,
           subject = EXCLUDED.subject, url = EXCLUDED.url, max_tiles_geometry = EXCLUDED.max_tiles_geometry,
           cache_url = EXCLUDED.cache_url, cache_method = EXCLUDED.cache_method;
    INSERT INTO expire_progress (output) VALUES (define_expire_output.name) ON CONFLICT DO NOTHING;
    IF _wake_relay_at_commit() IS NULL THEN END IF;
END
$$;
COMMENT ON FUNCTION define_expire_output(text, integer, integer, text, text, text, bigint, text, text) IS
    'Defines (or redefines, keeping its waiting tiles) an expire output: zooms minzoom..maxzoom (0-20) and any of osm2pgsql''s expire table, a NATS subject, an HTTP URL and an HTTP tile cache to purge.';

CREATE OR REPLACE FUNCTION drop_expire_output(name text) RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    waiting bigint;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM expire_outputs o WHERE o.name = drop_expire_output.name) THEN
        RAISE EXCEPTION 'expire output % does not exist', coalesce(quote_literal(name), 'NULL') USING ERRCODE = '42704',
            HINT = format('Outputs: %s.', coalesce((SELECT string_agg(o.name, ', ' ORDER BY o.name) FROM expire_outputs o), 'none'));
    END IF;
    DELETE FROM tile_queue q WHERE q.output = drop_expire_output.name;
    GET DIAGNOSTICS waiting = ROW_COUNT;
    DELETE FROM expire_outputs o WHERE o.name = drop_expire_output.name;  -- its rules and progress go with it
    DELETE FROM tile_shapes s WHERE NOT EXISTS (SELECT 1 FROM expire_rules r WHERE r.layer = s.layer);
    RETURN waiting;
END
$$;
COMMENT ON FUNCTION drop_expire_output(text) IS
    'Drops an expire output with its layers'' rules; returns how many edits'' tiles it had yet to deliver (dropped with it). Its expire table is left as it is.';

CREATE OR REPLACE FUNCTION expire_layer(layer text, output text, mode text DEFAULT 'full-area', buffer float8 DEFAULT 0.1,
                                        full_area_limit float8 DEFAULT NULL, diff boolean DEFAULT true) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM layer_registry r WHERE r.layer = expire_layer.layer) THEN
        RAISE EXCEPTION 'layer % is not registered', coalesce(quote_literal(layer), 'NULL') USING ERRCODE = '42704',
            HINT = format('Registered layers: %s.', (SELECT string_agg(r.layer, ', ' ORDER BY r.layer) FROM layer_registry r));
    END IF;
    IF NOT EXISTS (SELECT 1 FROM expire_outputs o WHERE o.name = expire_layer.output) THEN
        RAISE EXCEPTION 'expire output % does not exist', coalesce(quote_literal(output), 'NULL') USING ERRCODE = '42704',
            HINT = 'Define it first with define_expire_output().';
    END IF;
    PERFORM _expire_rule_check(0, 0, coalesce(buffer, -1), coalesce(mode, ''), full_area_limit, 1);
    -- The layer's first output: shapes kept by an earlier attachment are stale; each feature's
    -- current shape is kept instead, so that its first move from now on expires the difference.
    IF NOT EXISTS (SELECT 1 FROM expire_rules r WHERE r.layer = expire_layer.layer) THEN
        DELETE FROM tile_shapes s WHERE s.layer = expire_layer.layer;
        PERFORM _tile_seed(expire_layer.layer);
    END IF;
    INSERT INTO expire_rules AS r (layer, output, mode, buffer, full_area_limit, diff)
    VALUES (layer, output, mode, buffer, full_area_limit, coalesce(diff, true))
    ON CONFLICT ON CONSTRAINT expire_rules_pkey DO UPDATE
       SET mode = EXCLUDED.mode, buffer = EXCLUDED.buffer, full_area_limit = EXCLUDED.full_area_limit, diff = EXCLUDED.diff;
END
$$;
COMMENT ON FUNCTION expire_layer(text, text, text, float8, float8, boolean) IS
    'Attaches a layer to an expire output: each later edit expires its tiles there (mode full-area, boundary-only or hybrid; buffer a fraction of a tile; diff: moves expire the symmetric difference).';

CREATE OR REPLACE FUNCTION unexpire_layer(layer text, output text) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    DELETE FROM expire_rules r WHERE r.layer = unexpire_layer.layer AND r.output = unexpire_layer.output;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'layer % is not attached to expire output %', coalesce(quote_literal(layer), 'NULL'),
            coalesce(quote_literal(output), 'NULL') USING ERRCODE = '42704';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM expire_rules r WHERE r.layer = unexpire_layer.layer) THEN
        DELETE FROM tile_shapes s WHERE s.layer = unexpire_layer.layer;
    END IF;
END
$$;
COMMENT ON FUNCTION unexpire_layer(text, text) IS
    'Detaches a layer from an expire output; edits queued before still deliver their tiles, under the rule they were queued with.';

-- The tile math on its own, for a look at what an output would expire (osm2pgsql-expire's job).
CREATE OR REPLACE FUNCTION tiles_touched(shape geometry, maxzoom integer, minzoom integer DEFAULT 0, buffer float8 DEFAULT 0.1,
                                         mode text DEFAULT 'full-area', full_area_limit float8 DEFAULT NULL,
                                         max_tiles_geometry bigint DEFAULT 100000)
RETURNS TABLE (zoom integer, x integer, y integer)
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT * FROM _tiles_touched(ST_AsBinary(_tiles_lonlat(shape)), _not_null(maxzoom, 'maxzoom'), _not_null(minzoom, 'minzoom'),
                                 _not_null(buffer, 'buffer'), _not_null(mode, 'mode'), full_area_limit,
                                 _not_null(max_tiles_geometry, 'max_tiles_geometry'))
$$;
COMMENT ON FUNCTION tiles_touched(geometry, integer, integer, float8, text, float8, bigint) IS
    'The XYZ tiles (Web Mercator, y from the north) a shape touches at zooms minzoom..maxzoom, each tile grown by buffer x its width.';

CREATE OR REPLACE FUNCTION tiles_changed(old geometry, new geometry, maxzoom integer, minzoom integer DEFAULT 0,
                                         buffer float8 DEFAULT 0.1, mode text DEFAULT 'full-area',
                                         full_area_limit float8 DEFAULT NULL, diff boolean DEFAULT true,
                                         max_tiles_geometry bigint DEFAULT 100000)
RETURNS TABLE (zoom integer, x integer, y integer)
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT * FROM _tiles_changed(ST_AsBinary(_tiles_lonlat(old)), ST_AsBinary(_tiles_lonlat(new)), _not_null(maxzoom, 'maxzoom'),
                                 _not_null(minzoom, 'minzoom'), _not_null(buffer, 'buffer'), _not_null(mode, 'mode'),
                                 full_area_limit, _not_null(diff, 'diff'), _not_null(max_tiles_geometry, 'max_tiles_geometry'))
$$;
COMMENT ON FUNCTION tiles_changed(geometry, geometry, integer, integer, float8, text, float8, boolean, bigint) IS
    'The XYZ tiles a move from old to new expires: with diff, those their symmetric difference touches; without, those either touches.';

-- A shape in EPSG:4326, 2-D; SRID 0 is refused as the edit path refuses it.
CREATE OR REPLACE FUNCTION _tiles_lonlat(g geometry) RETURNS geometry
LANGUAGE plpgsql STABLE PARALLEL SAFE
AS $$
BEGIN
    IF g IS NULL THEN
        RAISE EXCEPTION 'shape must not be NULL' USING ERRCODE = '22004';
    ELSIF ST_SRID(g) = 0 THEN
        RAISE EXCEPTION 'geometry has SRID 0 (unknown coordinate system)' USING ERRCODE = '22023',
            HINT = 'Give it one, e.g. ST_SetSRID(geom, 4326) for longitude/latitude in degrees.';
    END IF;
    RETURN ST_Force2D(CASE WHEN ST_SRID(g) = 4326 THEN g ELSE ST_Transform(g, 4326) END);
END
$$;

-- What each output has delivered and what waits for it.
CREATE OR REPLACE VIEW expire_backlog AS
SELECT o.name AS output, o.minzoom, o.maxzoom, o.expire_table, o.subject,
       regexp_replace(o.url, '://[^/]*@', '://********@') AS url,  -- credentials masked, as the settings are
       regexp_replace(o.cache_url, '://[^/]*@', '://********@') AS cache_url, o.cache_method,
       (SELECT count(*) FROM tile_queue q WHERE q.output = o.name AND q.parked_at IS NULL) AS waiting_edits,
       (SELECT now() - min(q.queued_at) FROM tile_queue q WHERE q.output = o.name AND q.parked_at IS NULL) AS oldest_waiting_age,
       (SELECT count(*) FROM tile_queue q WHERE q.output = o.name AND q.parked_at IS NOT NULL) AS parked_edits,
       p.edits, (SELECT sum(t) FROM unnest(p.tiles_by_zoom) t)::bigint AS tiles_expired, p.tiles_by_zoom, p.lists_sent,
       p.purge_requests,
       p.boundary_fallbacks, p.dropped_zooms, p.box_fallbacks, p.last_sent_at, p.last_error, p.last_error_at
  FROM expire_outputs o LEFT JOIN expire_progress p ON p.output = o.name;
COMMENT ON VIEW expire_backlog IS
    'Per expire output: edits whose tiles wait, the oldest''s age, edits parked (a destination refused them), tiles expired by zoom (tiles_by_zoom[1] is zoom 0), lists sent, purge requests acknowledged, limits hit, the last error.';
