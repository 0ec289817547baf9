-- Bad input: a class-22 SQLSTATE, a message naming the problem, a hint where a fix exists, and
-- nothing written (no feature change, no outbox row, no version bump).
SELECT feature_outbox.edit_feature(1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created');
SELECT written();

-- NULL geometry, except for retired.
SELECT try($$SELECT feature_outbox.edit_feature(2, NULL::text, 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(1, NULL::geometry, 'moved')$$);
-- Empty geometries, including a collection whose surface member is empty.
SELECT try($$SELECT feature_outbox.edit_feature(2, 'POLYGON EMPTY'::geometry, 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('GEOMETRYCOLLECTION(POINT(1 1), POLYGON EMPTY)'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('MULTIPOLYGON(((0 0,1 0,1 1,0 0)), EMPTY)'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"MultiPolygon","coordinates":[]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"GeometryCollection","geometries":[{"type":"Point","coordinates":[1,1]},{"type":"Polygon","coordinates":[]}]}', 'created')$$);
-- SRID 0, unknown SRID, an SRID that cannot reach 4326.
SELECT try($$SELECT feature_outbox.edit_feature(2, 'POINT(1 2)'::geometry, 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('POINT(1 2)'::geometry, 999999), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1,2],"crs":{"type":"name","properties":{"name":"EPSG:999999"}}}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1,2],"crs":{"type":"name","properties":{"name":"my-crs"}}}', 'created')$$);
INSERT INTO spatial_ref_sys (srid, auth_name, auth_srid, srtext, proj4text)
VALUES (990001, 'test', 990001, '', '+proj=no_such_projection +datum=WGS84');
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('POINT(1 2)'::geometry, 990001), 'created')$$);
-- Far outside the projection's domain: PROJ would wrap it silently.
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePoint(4.0075e7, 0), 3857), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePoint(1e300, 1e300), 3857), 'created')$$);
-- Non-finite ordinates anywhere.
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePoint('NaN'::float8, 1), 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakeLine(ST_MakePoint(0, 0), ST_MakePoint(1, 'Infinity'::float8)), 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePoint('NaN'::float8, 1), 3857), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1e999,0]}', 'created')$$);
-- Out of the EPSG:4326 range, after the transform too.
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[52.5,200]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[181,45]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(1, ST_SetSRID(ST_MakePoint(45, -91), 4326), 'moved')$$);
-- Malformed GeoJSON.
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point",', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Circle","coordinates":[1,2]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Feature","properties":{},"geometry":{"type":"Point","coordinates":[1,2]}}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"FeatureCollection","features":[]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Polygon"}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":["13.4","52.5"]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[13.4,null]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1]]]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Polygon","coordinates":[[[0,0],[1,0],[0,0]]]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '[1,2]', 'created')$$);
-- Z and M ordinates, including a GeoJSON altitude.
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[13.4,52.5,34]}', 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePoint(13.4, 52.5, 34), 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID(ST_MakePointM(13.4, 52.5, 1), 4326), 'created')$$);
-- Curved types.
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('CIRCULARSTRING(0 0, 1 1, 2 0)'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('CURVEPOLYGON((0 0, 1 0, 1 1, 0 0))'::geometry, 4326), 'created')$$);
-- Inside collections too, at any depth.
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('GEOMETRYCOLLECTION(POINT(1 1), GEOMETRYCOLLECTION(CURVEPOLYGON((0 0, 1 0, 1 1, 0 0))))'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('GEOMETRYCOLLECTION(POINT(1 1), TRIANGLE((0 0, 1 0, 1 1, 0 0)))'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_GeomFromText('GEOMETRYCOLLECTION(POLYHEDRALSURFACE(((0 0,0 1,1 1,0 0))))', 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_GeomFromText('TIN(((0 0,0 1,1 1,0 0)))', 4326), 'created')$$);
-- Rings and lines that PostGIS stores from (E)WKB but no GeoJSON consumer can use.
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('0102000000010000000000000000000000000000000000F03F'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('0103000000010000000300000000000000000000000000000000000000000000000000F03F000000000000F03F00000000000000000000000000000000'::geometry, 4326), 'created')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, ST_SetSRID('0103000000010000000400000000000000000000000000000000000000000000000000F03F0000000000000000000000000000F03F000000000000F03F0000000000000000000000000000F03F'::geometry, 4326), 'created')$$);
-- Projected metres given as GeoJSON degrees (EPSG:3857 Berlin, no crs member): the hint names the
-- crs member and ST_SetSRID, not swapped axes.
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1491681.2,6893000.5]}', 'created')$$);
-- An unknown event_type lists the valid ones.
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1,2]}', 'deleted')$$);
SELECT try($$SELECT feature_outbox.edit_feature(2, '{"type":"Point","coordinates":[1,2]}', NULL)$$);

-- After all of the above, nothing was written.
SELECT written();
SELECT version, ST_AsText(geom) FROM feature_outbox.features;
