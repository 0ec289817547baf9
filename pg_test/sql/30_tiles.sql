-- Expire outputs and layer rules (osm2pgsql's words): what define_expire_output, expire_layer and
-- their undoing accept and refuse (22023 for zooms, modes, buffers, names and destinations; 42704
-- for an unknown layer or output; 42P16 for a table that is not an expire table), that a refusal
-- writes nothing, that osm2pgsql's expire table is created with its exact columns and key, what an
-- edit queues (shapes, never tiles) only for layers with an output, and the tile math on its own.
SET feature_outbox.nats_subject_prefix = 'features';
CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL, version integer NOT NULL DEFAULT 0,
                             name text);
SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name}');
CREATE TABLE public.roads (id bigint PRIMARY KEY, geom geometry(LineString, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('roads', 'public.roads');

-- Refusals, each writing nothing.
SELECT try($$SELECT feature_outbox.define_expire_output('Tiles', 14, "table" => 'public.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 21, "table" => 'public.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, minzoom => 15, "table" => 'public.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', -1, "table" => 'public.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', NULL, "table" => 'public.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14)$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'nosuch.expire_tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, subject => 'tiles.>')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, subject => 'features.tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, url => 'ftp://example.org/tiles')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.expire_tiles', max_tiles_geometry => 0)$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.expire_tiles', max_tiles_geometry => 1000001)$$);
-- A URL with a character no URI holds would fail every delivery: refused now.
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, url => 'http://127.0.0.1:9/a b')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, url => E'http://127.0.0.1:9/x\nInjected: 1')$$);
-- A cache's URL is a tile URL template: {z}, {x} and {y} once each, http(s), a known method.
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/parcels/{z}/{x}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p/{z}/{x}/{y}/{y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'ftp://127.0.0.1/p/{z}/{x}/{y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p {z}/{x}/{y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p/{z}/{x}/{y}', cache_method => 'ban')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p/{z}/{x}/{y}', cache_method => NULL)$$);
-- {z}, {x} and {y} in the path: not the query, the host or a fragment (the cache keys tiles by path).
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p?z={z}&x={x}&y={y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://{z}.example.org/{x}/{y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/p/{z}/{x}/{y}#f')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, cache_url => 'http://127.0.0.1:6081/' || repeat('a', 2000) || '/{z}/{x}/{y}')$$);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.expire_tiles', cache_method => 'purge')$$);
-- An existing table without osm2pgsql's key is not an expire table, nor one whose key or columns
-- the relay's upsert cannot use.
CREATE TABLE public.not_expire (zoom int, x int, y int, first timestamptz, last timestamptz);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.not_expire')$$);
CREATE TABLE public.partial_key (zoom int, x int, y int, first timestamptz, last timestamptz);
CREATE UNIQUE INDEX ON public.partial_key (zoom, x, y) WHERE zoom > 100;
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.partial_key')$$);
CREATE TABLE public.deferred_key (zoom int, x int, y int, first timestamptz, last timestamptz,
                                  UNIQUE (zoom, x, y) DEFERRABLE);
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.deferred_key')$$);
CREATE TABLE public.int_times (zoom int, x int, y int, first int, last int, PRIMARY KEY (zoom, x, y));
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.int_times')$$);
CREATE TABLE public.extra_column (zoom int, x int, y int, first timestamptz, last timestamptz, source text NOT NULL,
                                  PRIMARY KEY (zoom, x, y));
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.extra_column')$$);
-- A role that may define outputs but not write the table is refused: the relay would write it.
CREATE ROLE regress_tile_operator;
GRANT USAGE ON SCHEMA feature_outbox TO regress_tile_operator;
GRANT EXECUTE ON FUNCTION feature_outbox.define_expire_output(text, integer, integer, text, text, text, bigint, text, text),
                           feature_outbox._expire_table(text), feature_outbox._expire_rule_check(integer, integer, float8, text, float8, bigint)
   TO regress_tile_operator;
GRANT SELECT, INSERT, UPDATE ON feature_outbox.expire_outputs, feature_outbox.expire_progress TO regress_tile_operator;
CREATE TABLE public.locked_tiles (zoom int, x int, y int, first timestamptz, last timestamptz, PRIMARY KEY (zoom, x, y));
SET ROLE regress_tile_operator;
SELECT try($$SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.locked_tiles')$$);
RESET ROLE;
DROP OWNED BY regress_tile_operator;
DROP ROLE regress_tile_operator;
SELECT count(*) AS outputs FROM feature_outbox.expire_outputs;
SELECT to_regclass('public.expire_tiles') AS no_table_made;

-- An output with every destination; osm2pgsql's expire table, created by the call.
SELECT feature_outbox.define_expire_output('tiles', 14, "table" => 'public.expire_tiles', subject => 'tiles.parcels',
                                           url => 'http://127.0.0.1:9/tiles');
SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull, pg_get_expr(d.adbin, d.adrelid) AS default
  FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE a.attrelid = 'public.expire_tiles'::regclass AND a.attnum > 0 ORDER BY a.attnum;
SELECT pg_get_indexdef(i.indexrelid) AS key FROM pg_index i WHERE i.indrelid = 'public.expire_tiles'::regclass AND i.indisprimary;
SELECT name, minzoom, maxzoom, expire_table, subject, url, max_tiles_geometry FROM feature_outbox.expire_outputs;
-- A second output cannot share the subject; a URL's credentials never show in expire_backlog.
SELECT try($$SELECT feature_outbox.define_expire_output('other', 14, subject => 'tiles.parcels')$$);
SELECT feature_outbox.define_expire_output('secret', 10, url => 'https://tiles:s3cret@cache.example.org/purge',
                                           cache_url => 'https://tiles:s3cret@cache.example.org/p/{z}/{x}/{y}.pbf');
SELECT output, url, cache_url, cache_method, parked_edits, purge_requests FROM feature_outbox.expire_backlog WHERE output = 'secret';
SELECT feature_outbox.drop_expire_output('secret');
-- Defined again: its settings change, in place.
SELECT feature_outbox.define_expire_output('tiles', 12, minzoom => 2, "table" => 'public.expire_tiles');
SELECT name, minzoom, maxzoom, expire_table, subject, url FROM feature_outbox.expire_outputs;

-- Rules: a layer attached to an output, in osm2pgsql's modes.
SELECT try($$SELECT feature_outbox.expire_layer('nosuch', 'tiles')$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'nosuch')$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', mode => 'full_area')$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', mode => 'hybrid')$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', full_area_limit => 20000)$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', buffer => -0.1)$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', buffer => 'NaN')$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', buffer => 2)$$);
SELECT try($$SELECT feature_outbox.expire_layer('parcels', 'tiles', mode => 'hybrid', full_area_limit => -1)$$);
SELECT count(*) AS rules FROM feature_outbox.expire_rules;
SELECT feature_outbox.expire_layer('parcels', 'tiles', mode => 'hybrid', full_area_limit => 20000, buffer => 0.125);
SELECT feature_outbox.expire_layer('parcels', 'tiles');  -- again: the rule changes in place
SELECT layer, output, mode, buffer, full_area_limit, diff FROM feature_outbox.expire_rules;

-- What an edit keeps: shapes, queued once per output, only for a layer with an output.
SELECT feature_outbox.edit_feature('parcels', 1, ST_GeomFromText('POLYGON((13.40 52.50, 13.41 52.50, 13.41 52.51, 13.40 52.51, 13.40 52.50))', 4326), 'created');
SELECT feature_outbox.edit_feature('parcels', 1, ST_GeomFromText('POLYGON((13.40 52.50, 13.41 52.50, 13.412 52.512, 13.40 52.51, 13.40 52.50))', 4326), 'moved');
SELECT feature_outbox.edit_feature('parcels', 1, NULL::geometry, 'updated', '{"name": "Lot 1"}');
SELECT feature_outbox.edit_feature('parcels', 1, NULL::geometry, 'retired');
SELECT feature_outbox.edit_feature('roads', 1, ST_GeomFromText('LINESTRING(13.40 52.50, 13.45 52.52)', 4326), 'created');
SELECT q.output, b.feature_id, q.event_type, ST_AsText(ST_GeomFromWKB(q.old_shape)) AS old, ST_AsText(ST_GeomFromWKB(q.new_shape)) AS new,
       q.properties_changed
  FROM feature_outbox.tile_queue q JOIN feature_outbox.outbox b ON b.id = q.outbox_id ORDER BY q.outbox_id;
SELECT layer, feature_id FROM feature_outbox.tile_shapes;  -- the retired feature's shape is gone
SELECT count(*) AS roads_queued FROM feature_outbox.tile_queue WHERE layer = 'roads';

-- Undoing: a detached layer keeps what it queued; an unknown pair is refused.
SELECT try($$SELECT feature_outbox.unexpire_layer('roads', 'tiles')$$);
SELECT feature_outbox.unexpire_layer('parcels', 'tiles');
SELECT count(*) AS rules, (SELECT count(*) FROM feature_outbox.tile_queue) AS still_queued FROM feature_outbox.expire_rules;
-- Each waiting edit keeps the rule it was queued under.
SELECT DISTINCT mode, buffer, full_area_limit, diff FROM feature_outbox.tile_queue;
SELECT try($$SELECT feature_outbox.drop_expire_output('nosuch')$$);
SELECT feature_outbox.drop_expire_output('tiles') AS dropped_waiting_edits;
SELECT (SELECT count(*) FROM feature_outbox.expire_outputs) AS outputs, (SELECT count(*) FROM feature_outbox.tile_queue) AS queued,
       to_regclass('public.expire_tiles') IS NOT NULL AS table_left_as_it_is;

-- The tile math on its own: a point at zoom 2, a polygon's count, and the same refusals.
SELECT * FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), 2, 2, buffer => 0);
SELECT zoom, count(*) FROM feature_outbox.tiles_touched(ST_GeomFromText('POLYGON((13 52, 14.2 52.1, 13.9 52.9, 13.1 52.7, 13 52))', 4326), 12, 10)
 GROUP BY zoom ORDER BY zoom;
SELECT * FROM feature_outbox.tiles_touched(ST_Transform(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), 3857), 2, 2, buffer => 0) AS in_3857;
-- A line across the antimeridian touches the edge columns, never the world between.
SELECT DISTINCT x FROM feature_outbox.tiles_touched(ST_GeomFromText('LINESTRING(179 -1, -179 1)', 4326), 3, 3) ORDER BY x;
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(ST_MakePoint(13.4, 52.5), 5)$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), 21)$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), 5, mode => 'hybrid')$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(NULL, 5)$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), NULL)$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_changed(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), ST_SetSRID(ST_MakePoint(13.5, 52.5), 4326), 5, diff => NULL)$$);
SELECT try($$SELECT * FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(13.4, 52.5), 4326), 5, max_tiles_geometry => 4000000000)$$);
-- A move of one corner: the difference's tiles, far fewer than either shape's.
SELECT (SELECT count(*) FROM feature_outbox.tiles_changed(a, b, 16, 16)) AS diff_tiles,
       (SELECT count(*) FROM feature_outbox.tiles_changed(a, b, 16, 16, diff => false)) AS both_shapes
  FROM (SELECT ST_GeomFromText('POLYGON((13.40 52.50, 13.41 52.50, 13.41 52.51, 13.40 52.51, 13.40 52.50))', 4326) a,
               ST_GeomFromText('POLYGON((13.40 52.50, 13.41 52.50, 13.41 52.51, 13.4001 52.5101, 13.40 52.51, 13.40 52.50))', 4326) b) s;

-- Who may: the rules are the owner's; the backlog is pg_monitor's.
CREATE ROLE regress_tiles_plain;
SET ROLE regress_tiles_plain;
SELECT try($$SELECT feature_outbox.define_expire_output('mine', 14, "table" => 'public.mine')$$);
SELECT try($$SELECT * FROM feature_outbox.expire_backlog$$);
SELECT count(*) AS tiles_touched_is_everyones FROM feature_outbox.tiles_touched(ST_SetSRID(ST_MakePoint(0, 0), 4326), 0);
RESET ROLE;
DROP ROLE regress_tiles_plain;

-- A layer's first output keeps the current shape of each feature with events, whatever its key and
-- SRID: as EPSG:4326, retired rows (retired column set) and rows without events left out.
CREATE TABLE public.plots (code text PRIMARY KEY, geom geometry(Polygon, 3857) NOT NULL, version integer NOT NULL DEFAULT 0,
                           gone_at timestamptz);
SELECT feature_outbox.register_layer('plots', 'public.plots', id_column => 'code', retired_column => 'gone_at');
SELECT feature_outbox.edit_feature('plots', 'a-1', ST_Transform(ST_MakeEnvelope(13.40, 52.50, 13.41, 52.51, 4326), 3857), 'created');
SELECT feature_outbox.edit_feature('plots', 'b-2', ST_Transform(ST_MakeEnvelope(13.42, 52.50, 13.43, 52.51, 4326), 3857), 'created');
SELECT feature_outbox.edit_feature('plots', 'b-2', NULL::geometry, 'retired');
INSERT INTO public.plots (code, geom) VALUES ('c-3', ST_Transform(ST_MakeEnvelope(13.44, 52.50, 13.45, 52.51, 4326), 3857));
SELECT feature_outbox.define_expire_output('plots', 14, "table" => 'public.plot_tiles');
SELECT feature_outbox.expire_layer('plots', 'plots');
SELECT k.feature_key, ST_AsText(ST_GeomFromWKB(s.shape), 4) AS kept
  FROM feature_outbox.tile_shapes s JOIN feature_outbox.feature_keys k ON k.layer = s.layer AND k.feature_id = s.feature_id
 WHERE s.layer = 'plots';
SELECT feature_outbox.drop_expire_output('plots');
