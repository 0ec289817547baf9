//! GeoJSON geometry (RFC 7946) to EWKB, with the validation PostGIS's own parser lacks or reports as
//! XX000: Feature vs geometry, unknown types, missing or non-numeric coordinates, unclosed rings,
//! altitudes, and the legacy `crs` member. Pure Rust, no Postgres.

use geo::{Coord, Geometry, GeometryCollection, LineString, MultiLineString, MultiPoint, MultiPolygon, Point, Polygon};
use serde_json::{Map, Value};

use crate::input_error::{Code, InputError};

const TYPES: &str = "Point, MultiPoint, LineString, MultiLineString, Polygon, MultiPolygon, GeometryCollection";
const WGS84: i32 = 4326;

fn malformed(message: impl Into<String>) -> InputError {
    InputError::new(Code::InvalidText, message)
        .hint(r#"Pass a GeoJSON geometry object (RFC 7946), e.g. {"type":"Point","coordinates":[13.4,52.5]}."#)
}

/// Parses a GeoJSON geometry object into EWKB (little-endian) carrying its SRID.
///
/// The SRID is 4326 (WGS84 longitude/latitude, RFC 7946 §4) unless a legacy `crs` member names
/// another EPSG code (`EPSG:n`, `urn:ogc:def:crs:EPSG::n`); CRS84 names also mean 4326.
/// Errors: 22P02 for malformed GeoJSON, 22023 for an altitude, an empty geometry or an unknown `crs`.
pub fn to_ewkb(text: &str) -> Result<Vec<u8>, InputError> {
    let value: Value = serde_json::from_str(text).map_err(|e| malformed(format!("malformed GeoJSON: {e}")))?;
    let obj = value.as_object().ok_or_else(|| malformed("GeoJSON geometry must be a JSON object"))?;
    let srid = srid(obj)?;
    let geom = geometry(obj)?;
    let mut wkb = Vec::new();
    wkb::writer::write_geometry(&mut wkb, &geom, &Default::default())
        .map_err(|e| malformed(format!("cannot encode geometry: {e}")))?;
    Ok(with_srid(wkb, srid))
}

/// ISO WKB to EWKB: set the SRID flag on the top-level type and insert the SRID after it.
fn with_srid(wkb: Vec<u8>, srid: i32) -> Vec<u8> {
    debug_assert_eq!(wkb[0], 1, "writer uses little-endian");
    let ty = u32::from_le_bytes([wkb[1], wkb[2], wkb[3], wkb[4]]) | 0x2000_0000;
    let mut out = Vec::with_capacity(wkb.len() + 4);
    out.push(1);
    out.extend_from_slice(&ty.to_le_bytes());
    out.extend_from_slice(&srid.to_le_bytes());
    out.extend_from_slice(&wkb[5..]);
    out
}

fn srid(obj: &Map<String, Value>) -> Result<i32, InputError> {
    let Some(crs) = obj.get("crs") else { return Ok(WGS84) };
    if crs.is_null() {
        return Ok(WGS84);
    }
    let name = crs
        .pointer("/properties/name")
        .and_then(Value::as_str)
        .ok_or_else(|| malformed(r#"GeoJSON "crs" must be {"type":"name","properties":{"name":"EPSG:<code>"}}"#))?;
    let upper = name.to_ascii_uppercase();
    if upper.ends_with("CRS84") {
        return Ok(WGS84);
    }
    let code = upper
        .strip_prefix("EPSG:")
        .or_else(|| upper.strip_prefix("URN:OGC:DEF:CRS:EPSG::"))
        .or_else(|| upper.strip_prefix("URN:OGC:DEF:CRS:EPSG:").and_then(|r| r.rsplit(':').next()))
        .and_then(|c| c.parse::<i32>().ok())
        .filter(|c| *c > 0);
    code.ok_or_else(|| {
        InputError::new(Code::InvalidParameter, format!("unknown GeoJSON crs name \"{name}\""))
            .hint("Use \"EPSG:<code>\", \"urn:ogc:def:crs:EPSG::<code>\" or a CRS84 name, or omit crs for WGS84.")
    })
}

fn geometry(obj: &Map<String, Value>) -> Result<Geometry, InputError> {
    let ty = obj
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| malformed("GeoJSON object has no \"type\" string"))?;
    if ty == "GeometryCollection" {
        let members = obj
            .get("geometries")
            .and_then(Value::as_array)
            .ok_or_else(|| malformed("GeometryCollection has no \"geometries\" array"))?;
        if members.is_empty() {
            return Err(empty());
        }
        let parsed = members
            .iter()
            .map(|m| m.as_object().ok_or_else(|| malformed("GeometryCollection member must be an object")).and_then(geometry))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Geometry::GeometryCollection(GeometryCollection(parsed)));
    }
    if matches!(ty, "Feature" | "FeatureCollection") {
        return Err(InputError::new(Code::InvalidText, format!("expected a GeoJSON geometry, got a {ty}"))
            .hint("Pass the Feature's \"geometry\" member, not the Feature itself."));
    }
    if !matches!(ty, "Point" | "MultiPoint" | "LineString" | "MultiLineString" | "Polygon" | "MultiPolygon") {
        return Err(InputError::new(Code::InvalidText, format!("unknown GeoJSON type \"{ty}\""))
            .hint(format!("Valid geometry types: {TYPES}.")));
    }
    let coords = obj
        .get("coordinates")
        .ok_or_else(|| malformed(format!("{ty} has no \"coordinates\" member")))?;
    Ok(match ty {
        "Point" => Point(position(coords)?).into(),
        "MultiPoint" => MultiPoint(non_empty(coords)?.iter().map(|p| position(p).map(Point)).collect::<Result<_, _>>()?).into(),
        "LineString" => line(coords)?.into(),
        "MultiLineString" => MultiLineString(non_empty(coords)?.iter().map(line).collect::<Result<_, _>>()?).into(),
        "Polygon" => polygon(coords)?.into(),
        _ => MultiPolygon(non_empty(coords)?.iter().map(polygon).collect::<Result<_, _>>()?).into(),
    })
}

fn empty() -> InputError {
    InputError::new(Code::InvalidParameter, "geometry is empty")
        .hint("A feature needs a non-empty geometry. To remove a feature, send a retired event.")
}

fn array(v: &Value) -> Result<&Vec<Value>, InputError> {
    v.as_array().ok_or_else(|| malformed(format!("coordinates must be arrays, found {v}")))
}

fn non_empty(v: &Value) -> Result<&Vec<Value>, InputError> {
    let a = array(v)?;
    if a.is_empty() { Err(empty()) } else { Ok(a) }
}

fn position(v: &Value) -> Result<Coord, InputError> {
    let a = array(v)?;
    if a.is_empty() {
        return Err(empty());
    }
    if a.len() < 2 {
        return Err(malformed(format!("position {v} needs two numbers, longitude and latitude")));
    }
    let n = |i: usize| {
        a[i].as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| malformed(format!("position {v} has a non-numeric ordinate {}", a[i])))
    };
    let (x, y) = (n(0)?, n(1)?);
    if a.len() > 2 {
        return Err(InputError::new(Code::InvalidParameter, format!("position {v} has an altitude; features are 2-D"))
            .hint("Drop the third ordinate before the edit, as ST_Force2D does."));
    }
    Ok(Coord { x, y })
}

fn line(v: &Value) -> Result<LineString, InputError> {
    let pts = non_empty(v)?.iter().map(position).collect::<Result<Vec<_>, _>>()?;
    if pts.len() < 2 {
        return Err(malformed("a LineString needs at least 2 positions"));
    }
    Ok(LineString(pts))
}

fn ring(v: &Value) -> Result<LineString, InputError> {
    let pts = non_empty(v)?.iter().map(position).collect::<Result<Vec<_>, _>>()?;
    if pts.len() < 4 {
        return Err(malformed(format!("a polygon ring needs at least 4 positions, found {}", pts.len())));
    }
    if pts.first() != pts.last() {
        return Err(malformed("polygon ring is not closed: its first and last positions differ")
            .hint("Repeat the first position at the end of each ring (RFC 7946 §3.1.6)."));
    }
    Ok(LineString(pts))
}

fn polygon(v: &Value) -> Result<Polygon, InputError> {
    let mut rings = non_empty(v)?.iter().map(ring).collect::<Result<Vec<_>, _>>()?.into_iter();
    let exterior = rings.next().expect("non_empty checked");
    Ok(Polygon::new(exterior, rings.collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> InputError {
        to_ewkb(text).unwrap_err()
    }

    fn srid_of(ewkb: &[u8]) -> i32 {
        i32::from_le_bytes([ewkb[5], ewkb[6], ewkb[7], ewkb[8]])
    }

    #[test]
    fn point_becomes_ewkb_with_srid_4326() {
        let ewkb = to_ewkb(r#"{"type":"Point","coordinates":[13.4,52.5]}"#).unwrap();
        assert_eq!(ewkb[0], 1);
        assert_eq!(u32::from_le_bytes([ewkb[1], ewkb[2], ewkb[3], ewkb[4]]), 0x2000_0001);
        assert_eq!(srid_of(&ewkb), 4326);
        assert_eq!(f64::from_le_bytes(ewkb[9..17].try_into().unwrap()), 13.4);
    }

    #[test]
    fn crs_member_names_the_srid() {
        let epsg = r#"{"type":"Point","coordinates":[500000,5800000],"crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:EPSG::25833"}}}"#;
        assert_eq!(srid_of(&to_ewkb(epsg).unwrap()), 25833);
        let crs84 = r#"{"type":"Point","coordinates":[1,2],"crs":{"type":"name","properties":{"name":"urn:ogc:def:crs:OGC:1.3:CRS84"}}}"#;
        assert_eq!(srid_of(&to_ewkb(crs84).unwrap()), 4326);
        let bad = r#"{"type":"Point","coordinates":[1,2],"crs":{"type":"name","properties":{"name":"my-own-crs"}}}"#;
        assert_eq!(err(bad).code, Code::InvalidParameter);
    }

    #[test]
    fn malformed_inputs_are_22p02_with_a_reason() {
        for (text, needle) in [
            ("{not json", "malformed GeoJSON"),
            (r#"{"type":"Blob","coordinates":[1,2]}"#, "unknown GeoJSON type"),
            (r#"{"type":"Feature","geometry":{"type":"Point","coordinates":[1,2]}}"#, "got a Feature"),
            (r#"{"type":"Point"}"#, "no \"coordinates\""),
            (r#"{"type":"Point","coordinates":["13.4",52.5]}"#, "non-numeric"),
            (r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,1]]]}"#, "not closed"),
            (r#"{"type":"Polygon","coordinates":[[[0,0],[1,0],[0,0]]]}"#, "at least 4"),
            (r#"{"type":"LineString","coordinates":[[0,0]]}"#, "at least 2"),
            (r#"{"type":"Point","coordinates":[1e999,0]}"#, "malformed GeoJSON"),
        ] {
            let e = err(text);
            assert_eq!(e.code, Code::InvalidText, "{text}");
            assert!(e.message.contains(needle), "{text}: {}", e.message);
        }
        assert!(err(r#"{"type":"Blob","coordinates":[1,2]}"#).hint.unwrap().contains("MultiPolygon"));
    }

    #[test]
    fn altitude_and_empty_are_22023() {
        let z = err(r#"{"type":"Point","coordinates":[1,2,3]}"#);
        assert_eq!(z.code, Code::InvalidParameter);
        assert!(z.hint.unwrap().contains("ST_Force2D"));
        assert_eq!(err(r#"{"type":"MultiPolygon","coordinates":[]}"#).message, "geometry is empty");
        assert_eq!(err(r#"{"type":"GeometryCollection","geometries":[]}"#).message, "geometry is empty");
        let member = r#"{"type":"GeometryCollection","geometries":[{"type":"Point","coordinates":[1,2]},{"type":"Polygon","coordinates":[]}]}"#;
        assert_eq!(err(member).message, "geometry is empty");
    }

    #[test]
    fn coordinates_parse_to_the_nearest_double() {
        // Without serde_json's float_roundtrip, this county vertex came out 1 ULP off, enough to move
        // ST_PointOnSurface of 4 real counties into another H3 cell.
        let ewkb = to_ewkb(r#"{"type":"Point","coordinates":[-114.05190414404143,36.84327416903169]}"#).unwrap();
        assert_eq!(f64::from_le_bytes(ewkb[9..17].try_into().unwrap()), "-114.05190414404143".parse::<f64>().unwrap());
        assert_eq!(f64::from_le_bytes(ewkb[17..25].try_into().unwrap()), "36.84327416903169".parse::<f64>().unwrap());
    }

    #[test]
    fn multipolygon_with_hole_round_trips_through_the_wkb_reader() {
        let text = r#"{"type":"MultiPolygon","coordinates":[[[[0,0],[4,0],[4,4],[0,4],[0,0]],[[1,1],[1,2],[2,2],[1,1]]],[[[10,10],[11,10],[11,11],[10,10]]]]}"#;
        let ewkb = to_ewkb(text).unwrap();
        assert!(wkb::reader::read_wkb(&ewkb).is_ok());
        assert_eq!(crate::geometry::check(&ewkb, true), Ok(()));
    }
}
