-- A polygon around a pole in a polar CRS (EPSG:3031, EPSG:3413) comes out of a plain ST_Transform
-- as a ring of zero area that does not cover the pole. edit_feature stores it as a valid polar cap
-- in 4326 that covers the pole, routes it on the point on surface in the source CRS, and records
-- a box of all longitudes down (or up) to the pole. A shape that cannot be rebuilt (the pole in a
-- hole) is refused with 22023 saying why, and nothing is written.
CREATE FUNCTION polar_square(srid int) RETURNS geometry LANGUAGE sql AS $$
    -- 2,000 km across, centred on the pole, in metres of the polar stereographic CRS.
    SELECT ST_GeomFromText('POLYGON((-1000000 -1000000, 1000000 -1000000, 1000000 1000000, -1000000 1000000, -1000000 -1000000))', srid)
$$;
CREATE FUNCTION pole(srid int) RETURNS geometry LANGUAGE sql AS $$
    SELECT ST_SetSRID(ST_MakePoint(0, CASE srid WHEN 3031 THEN -90 ELSE 90 END), 4326)
$$;

-- What a plain ST_Transform makes of them.
SELECT srid, ST_Area(t) < 1e-6 AS naive_area_zero, ST_Covers(t, pole(srid)) AS naive_covers_pole
  FROM (VALUES (3031), (3413)) v(srid), ST_Transform(polar_square(srid), 4326) t;

SELECT feature_outbox.edit_feature(90000 + srid, polar_square(srid), 'created') FROM (VALUES (3031), (3413)) v(srid);
-- Stored valid, covering the pole, in 4326; its corners are 1,414 km from the pole: about 77°.
SELECT id, ST_IsValid(geom) AS valid, ST_Covers(geom, pole(id::int - 90000)) AS covers_pole, ST_Area(geom) > 100 AS has_area,
       ST_SRID(geom), round(least(abs(ST_YMin(geom)), abs(ST_YMax(geom)))) AS outer_latitude,
       greatest(abs(ST_YMin(geom)), abs(ST_YMax(geom))) AS pole_latitude
  FROM feature_outbox.features ORDER BY id;
-- Routed on the point on surface in the source CRS (the pole itself), not on the 4326 ring.
SELECT o.feature_id,
       o.routing_key = feature_outbox._h3_cell(ST_X(p), ST_Y(p), 8) AS routed_on_the_source_point,
       o.routing_key <> feature_outbox.routing_key(ST_Transform(polar_square(o.feature_id::int - 90000), 4326)) AS not_the_naive_key
  FROM feature_outbox.outbox o, ST_Transform(ST_PointOnSurface(polar_square(o.feature_id::int - 90000)), 4326) p
 ORDER BY o.feature_id;
-- The state's box: all longitudes, down (or up) to the pole.
SELECT feature_id, bbox[1] AS west, bbox[3] AS east, CASE WHEN feature_id = 93031 THEN bbox[2] ELSE bbox[4] END AS pole_edge
  FROM feature_outbox.feature_state ORDER BY feature_id;

-- The pole in a hole cannot be stored as a valid cap.
SELECT written();
SELECT try($$SELECT feature_outbox.edit_feature(1, 'SRID=3031;POLYGON((-2000000 -2000000, 2000000 -2000000, 2000000 2000000, -2000000 2000000, -2000000 -2000000), (-500000 -500000, -500000 500000, 500000 500000, 500000 -500000, -500000 -500000))'::geometry, 'created')$$);
SELECT written();
