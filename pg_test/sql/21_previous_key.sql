-- previous_routing_key is the cell of the geometry before the edit, read from the feature's state
-- (not recomputed): through created, moved, a change of feature_outbox.h3_resolution and a retired
-- without a geometry, each outbox row's key is routing_key() of its own shape at the resolution it
-- was written at, and its previous key that of the shape before. A feature without state (as after
-- an upgrade from 0.1.0) gets it from its stored geometry at its next edit.
CREATE FUNCTION square(lon float8, lat float8) RETURNS geometry LANGUAGE sql AS $$
    SELECT ST_MakeEnvelope(lon, lat, lon + 0.01, lat + 0.01, 4326)
$$;
CREATE FUNCTION key_at(g geometry, resolution int) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('feature_outbox.h3_resolution', resolution::text, true);
    RETURN feature_outbox.routing_key(g);
END $$;

SELECT feature_outbox.edit_feature(7, square(13.40, 52.52), 'created');
SELECT feature_outbox.edit_feature(7, square(13.50, 52.52), 'moved');
SET feature_outbox.h3_resolution = 10;  -- the state's key was taken at 8
SELECT feature_outbox.edit_feature(7, square(13.60, 52.60), 'moved');
RESET feature_outbox.h3_resolution;     -- and back, without a geometry
SELECT feature_outbox.edit_feature(7, NULL::geometry, 'retired');
SELECT o.feature_version, o.event_type, length(o.routing_key) AS key_length, substr(o.routing_key, 1, 2) AS resolution_prefix,
       o.routing_key = key_at(s.shape, s.res) AS key_of_its_shape,
       o.previous_routing_key IS NOT DISTINCT FROM key_at(p.shape, s.res) AS previous_of_the_shape_before
  FROM feature_outbox.outbox o
  JOIN (VALUES (1, square(13.40, 52.52), 8), (2, square(13.50, 52.52), 8), (3, square(13.60, 52.60), 10), (4, square(13.60, 52.60), 8))
       s(v, shape, res) ON s.v = o.feature_version
  LEFT JOIN (VALUES (2, square(13.40, 52.52)), (3, square(13.50, 52.52)), (4, square(13.60, 52.60))) p(v, shape) ON p.v = o.feature_version
 WHERE o.feature_id = 7 ORDER BY o.id;
SHOW feature_outbox.h3_resolution;
-- The retired event kept the last shape's state (taken at 10).
SELECT routing_key = key_at(square(13.60, 52.60), 10) AS state_key, h3_resolution, previous_routing_key = routing_key AS previous_is_same
  FROM feature_outbox.feature_state WHERE layer = 'features' AND feature_id = 7;
RESET feature_outbox.h3_resolution;

-- A feature whose state is gone gets it from its stored geometry before the edit.
SELECT feature_outbox.edit_feature(8, square(2.35, 48.85), 'created');
DELETE FROM feature_outbox.feature_state WHERE feature_id = 8;
SELECT feature_outbox.edit_feature(8, square(2.45, 48.85), 'moved');
SELECT feature_version, routing_key = key_at(CASE feature_version WHEN 1 THEN square(2.35, 48.85) ELSE square(2.45, 48.85) END, 8) AS key_of_its_shape,
       previous_routing_key IS NOT DISTINCT FROM CASE feature_version WHEN 2 THEN key_at(square(2.35, 48.85), 8) END AS previous_from_the_stored_geometry
  FROM feature_outbox.outbox WHERE feature_id = 8 ORDER BY id;
SELECT count(*) AS state_rows FROM feature_outbox.feature_state WHERE feature_id = 8;
RESET feature_outbox.h3_resolution;

-- The resolution setting is checked when set.
SELECT try('SET feature_outbox.h3_resolution = 16');
SELECT try('SET feature_outbox.h3_resolution = -1');
