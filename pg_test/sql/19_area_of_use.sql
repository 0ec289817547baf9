-- A geometry given in another SRID must lie inside that CRS's area of use (as PROJ records it),
-- widened by feature_outbox.area_of_use_margin degrees (default 1), or PROJ would place it silently
-- somewhere else: 22023 naming the CRS and where the shape is, and nothing written. Real data just
-- outside a UTM zone passes with the margin; a CRS without an authority entry skips the test.
CREATE FUNCTION refused(ewkt text, crs text) RETURNS text LANGUAGE sql AS $$
    SELECT try_says(format('SELECT feature_outbox.edit_feature(2, %L::geometry, %L)', ewkt, 'created'),
                    'outside the area of use of ' || crs, 'longitude')
$$;
-- UTM zone 33N (12°E to 18°E, north of the equator) given a point 2,000 km south of the equator.
SELECT refused('SRID=32633;POINT(500000 -2000000)', 'EPSG:32633');
-- Web Mercator beyond its world (85.06°S to 85.06°N): y = 30,000 km is about 89.9°N.
SELECT refused('SRID=3857;POINT(0 30000000)', 'EPSG:3857');
-- Antarctic Polar Stereographic (south of 60°S) far out: PROJ would land it at 80°N.
SELECT refused('SRID=3031;POINT(100000000 100000000)', 'EPSG:3031');
-- A polygon: one vertex outside is enough.
SELECT refused('SRID=32633;POLYGON((500000 5000000, 510000 5000000, 510000 -300000, 500000 5000000))', 'EPSG:32633');
-- The GeoJSON form, with a legacy crs member, checks the same.
SELECT try_says($$SELECT feature_outbox.edit_feature(5, '{"type":"Point","coordinates":[500000,-2000000],"crs":{"type":"name","properties":{"name":"EPSG:32633"}}}', 'created')$$,
                'outside the area of use of EPSG:32633');
SELECT written();

-- 11.6°E, 52°N: 0.4° west of UTM zone 33N. Stored with the default margin; refused without one.
SELECT ST_AsEWKT(ST_Transform(ST_SetSRID(ST_MakePoint(11.6, 52), 4326), 32633)) AS just_outside \gset
SHOW feature_outbox.area_of_use_margin;
SELECT feature_outbox.edit_feature(3, :'just_outside'::geometry, 'created');
SET feature_outbox.area_of_use_margin = 0;
SELECT try_says(format('SELECT feature_outbox.edit_feature(4, %L::geometry, %L)', :'just_outside', 'created'),
                'outside the area of use of EPSG:32633');
RESET feature_outbox.area_of_use_margin;
SELECT try('SET feature_outbox.area_of_use_margin = -1');
SELECT written();

-- A CRS without an authority entry: outside zone 33's area, yet a sound transform, so stored (the
-- round trip back to the source SRID being the only check).
INSERT INTO spatial_ref_sys (srid, auth_name, auth_srid, proj4text)
VALUES (990001, NULL, NULL, '+proj=utm +zone=33 +datum=WGS84 +units=m +no_defs');
SELECT feature_outbox.edit_feature(6, 'SRID=990001;POINT(-200000 5700000)'::geometry, 'created');
SELECT ST_X(geom) < 12 AS west_of_the_zone, ST_SRID(geom) FROM feature_outbox.features WHERE id = 6;
SELECT written();
