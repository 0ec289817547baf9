//! GeoJSON geometries (RFC 7946), both ways, in pure Rust:
//! - in: text to EWKB, with the validation PostGIS's own parser lacks or reports as XX000 (Feature vs
//!   geometry, unknown types, missing or non-numeric coordinates, unclosed rings, altitudes, `crs`);
//! - out: WKB to the event's `geometry`, with every ordinate at full (round-trip) precision. Unlike
//!   PostGIS 3.3's ST_AsGeoJSON it encodes nested collections, and a geometry it cannot encode
//!   fails that one event instead of the relay's whole batch.

use geo::{Coord, Geometry, GeometryCollection, LineString, MultiLineString, MultiPoint, MultiPolygon, Point, Polygon};
use geo_traits::{
    CoordTrait, GeometryCollectionTrait, GeometryTrait, GeometryType, LineStringTrait, MultiLineStringTrait,
    MultiPointTrait, MultiPolygonTrait, PointTrait, PolygonTrait,
};
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
pub fn with_srid(wkb: Vec<u8>, srid: i32) -> Vec<u8> {
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
        .and_then(|c| c.parse::<i64>().ok())
        .filter(|c| *c > 0);
    if let Some(c) = code.filter(|c| *c > 998_999) {
        // PostGIS would silently clamp it into its reserved range and then name another SRID.
        return Err(InputError::new(Code::InvalidParameter, format!("unknown SRID {c}: PostGIS SRIDs are 1 to 998999"))
            .hint("Use an EPSG code listed in spatial_ref_sys."));
    }
    let code = code.map(|c| c as i32);
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
        return Err(InputError::new(Code::InvalidText, format!("unknown GeoJSON type {}", brief(&Value::from(ty))))
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

/// At most 60 characters of a JSON value, for error messages that must not echo a huge input.
fn brief(v: &Value) -> String {
    let text = v.to_string();
    match text.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

fn array(v: &Value) -> Result<&Vec<Value>, InputError> {
    v.as_array().ok_or_else(|| malformed(format!("coordinates must be arrays, found {}", brief(v))))
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
        return Err(malformed(format!("position {} needs two numbers, longitude and latitude", brief(v))));
    }
    let n = |i: usize| {
        a[i].as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| malformed(format!("position {} has a non-numeric ordinate {}", brief(v), brief(&a[i]))))
    };
    let (x, y) = (n(0)?, n(1)?);
    if a.len() > 2 {
        return Err(InputError::new(Code::InvalidParameter, format!("position {} has an altitude; features are 2-D", brief(v)))
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
    let pts = array(v)?.iter().map(position).collect::<Result<Vec<_>, _>>()?;
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

/// WKB (2-D, EPSG:4326) to the text of a GeoJSON geometry object. Errors name what cannot be
/// encoded: curves, triangles and other types GeoJSON lacks, empty points, non-finite ordinates,
/// malformed WKB. Written straight into a buffer, the JSON a serde Value would give (each
/// ordinate as serde_json prints it: the shortest decimal that reads back as the same double)
/// without building the tree first. The relay encodes every event's geometry with it.
pub fn text_from_wkb(wkb: &[u8]) -> Result<Vec<u8>, InputError> {
    crate::edit::inspect::guarded(|| {
        let g = wkb::reader::read_wkb(wkb)
            .map_err(|e| InputError::new(Code::InvalidParameter, format!("geometry cannot be encoded as GeoJSON: {e}")))?;
        let mut out = Vec::with_capacity(wkb.len() * 2);
        write_text(&g, &mut out)?;
        Ok(out)
    })
}

fn write_text(g: &impl GeometryTrait<T = f64>, out: &mut Vec<u8>) -> Result<(), InputError> {
    let unsupported = |what: &str| InputError::new(Code::InvalidParameter, format!("a {what} cannot be encoded as GeoJSON"));
    let head = |out: &mut Vec<u8>, kind: &str| {
        out.extend_from_slice(b"{\"type\":\"");
        out.extend_from_slice(kind.as_bytes());
        out.extend_from_slice(b"\",\"coordinates\":");
    };
    match g.as_type() {
        GeometryType::Point(p) => {
            head(out, "Point");
            text_pos(&p.coord().ok_or_else(|| unsupported("empty point"))?, out)?;
        }
        GeometryType::LineString(l) => {
            head(out, "LineString");
            text_positions(l, out)?;
        }
        GeometryType::Polygon(p) => {
            head(out, "Polygon");
            text_rings(p, out)?;
        }
        GeometryType::MultiPoint(m) => {
            head(out, "MultiPoint");
            list(out, m.points(), |p, out| text_pos(&p.coord().ok_or_else(|| unsupported("empty point"))?, out))?;
        }
        GeometryType::MultiLineString(m) => {
            head(out, "MultiLineString");
            list(out, m.line_strings(), |l, out| text_positions(&l, out))?;
        }
        GeometryType::MultiPolygon(m) => {
            head(out, "MultiPolygon");
            list(out, m.polygons(), |p, out| text_rings(&p, out))?;
        }
        GeometryType::GeometryCollection(gc) => {
            out.extend_from_slice(b"{\"type\":\"GeometryCollection\",\"geometries\":");
            list(out, gc.geometries(), |m, out| write_text(&m, out))?;
        }
        _ => return Err(unsupported("geometry of this type")),
    }
    out.push(b'}');
    Ok(())
}

/// `[a,b,...]`, each item written by `each`.
fn list<T>(out: &mut Vec<u8>, items: impl Iterator<Item = T>, mut each: impl FnMut(T, &mut Vec<u8>) -> Result<(), InputError>) -> Result<(), InputError> {
    out.push(b'[');
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(b',');
        }
        each(item, out)?;
    }
    out.push(b']');
    Ok(())
}

fn text_pos(c: &impl CoordTrait<T = f64>, out: &mut Vec<u8>) -> Result<(), InputError> {
    let (x, y) = (c.x(), c.y());
    if !x.is_finite() || !y.is_finite() {
        return Err(InputError::new(Code::InvalidParameter, format!("non-finite ordinate ({x}, {y}) cannot be encoded as GeoJSON")));
    }
    out.push(b'[');
    let _ = serde_json::to_writer(&mut *out, &x);
    out.push(b',');
    let _ = serde_json::to_writer(&mut *out, &y);
    out.push(b']');
    Ok(())
}

fn text_positions(l: &impl LineStringTrait<T = f64>, out: &mut Vec<u8>) -> Result<(), InputError> {
    list(out, l.coords(), |c, out| text_pos(&c, out))
}

fn text_rings(p: &impl PolygonTrait<T = f64>, out: &mut Vec<u8>) -> Result<(), InputError> {
    list(out, p.exterior().into_iter().chain(p.interiors()), |r, out| text_positions(&r, out))
}

/// The GeoJSON of WKB as a Value (tests compare with it).
#[cfg(test)]
pub fn from_wkb(wkb: &[u8]) -> Result<Value, InputError> {
    text_from_wkb(wkb).map(|t| serde_json::from_slice(&t).expect("text_from_wkb writes JSON"))
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
    fn geojson_round_trips_through_wkb_at_full_precision() {
        for text in [
            r#"{"type":"Point","coordinates":[13.400000000000002,-52.12345678901234]}"#,
            r#"{"type":"MultiPolygon","coordinates":[[[[0.0,0.0],[4.0,0.0],[4.0,4.0],[0.0,0.0]],[[1.0,1.0],[1.5,1.0],[1.0,1.5],[1.0,1.0]]]]}"#,
            r#"{"type":"GeometryCollection","geometries":[{"type":"GeometryCollection","geometries":[{"type":"Point","coordinates":[1.0,2.0]}]},{"type":"LineString","coordinates":[[0.0,0.0],[1.0,1.0]]}]}"#,
        ] {
            let back = from_wkb(&to_ewkb(text).unwrap()).unwrap();
            assert_eq!(back, serde_json::from_str::<Value>(text).unwrap(), "{text}");
        }
    }

    #[test]
    fn unencodable_wkb_is_an_error() {
        // CIRCULARSTRING(0 0, 1 1, 2 0): ISO WKB type 8, which GeoJSON lacks.
        let mut curve = vec![1u8];
        curve.extend_from_slice(&8u32.to_le_bytes());
        curve.extend_from_slice(&3u32.to_le_bytes());
        for v in [0.0f64, 0.0, 1.0, 1.0, 2.0, 0.0] {
            curve.extend_from_slice(&v.to_le_bytes());
        }
        assert!(from_wkb(&curve).is_err());
        let mut nan = vec![1u8];
        nan.extend_from_slice(&1u32.to_le_bytes());
        nan.extend_from_slice(&1.0f64.to_le_bytes());
        nan.extend_from_slice(&f64::INFINITY.to_le_bytes());
        assert!(from_wkb(&nan).unwrap_err().message.contains("non-finite"));
        assert!(from_wkb(&[1, 1, 0]).is_err());
    }

    #[test]
    fn multipolygon_with_hole_round_trips_through_the_wkb_reader() {
        let text = r#"{"type":"MultiPolygon","coordinates":[[[[0,0],[4,0],[4,4],[0,4],[0,0]],[[1,1],[1,2],[2,2],[1,1]]],[[[10,10],[11,10],[11,11],[10,10]]]]}"#;
        let ewkb = to_ewkb(text).unwrap();
        assert!(wkb::reader::read_wkb(&ewkb).is_ok());
        assert_eq!(crate::edit::inspect::check(&ewkb, true), Ok(()));
    }
}
