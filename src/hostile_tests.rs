//! Hostile input for the pure write-path modules (issue 13): GeoJSON text, WKB, the one pass over a
//! geometry and the routing point. Property: whatever the input, the code returns, never panics,
//! and every error is class 22 (InputError can carry nothing else). Inputs: random and truncated
//! documents, huge and tiny coordinates, NaN, deep nesting, and one 1,000,000-vertex ring.

use proptest::prelude::*;

use crate::edit::inspect::{self, Rules};
use crate::geojson;
use crate::input_error::Code;
use crate::routing;

fn class_22(code: Code) -> bool {
    matches!(code, Code::InvalidText | Code::InvalidParameter | Code::OutOfRange)
}

/// A number as GeoJSON may carry it, or may not: ordinary, huge, tiny, negative zero, or a NaN /
/// Infinity token that JSON does not allow.
fn number() -> BoxedStrategy<String> {
    prop_oneof![
        (-200.0f64..200.0).prop_map(|v| format!("{v}")),
        any::<f64>().prop_map(|v| format!("{v:e}")),
        Just("1e308".to_string()),
        Just("-1e309".to_string()),
        Just("5e-324".to_string()),
        Just("-0".to_string()),
        Just("NaN".to_string()),
        Just("Infinity".to_string()),
        Just("1".repeat(400)),
    ]
    .boxed()
}

fn position() -> BoxedStrategy<String> {
    prop::collection::vec(number(), 0..5).prop_map(|v| format!("[{}]", v.join(","))).boxed()
}

/// A GeoJSON-shaped document: the right keys, wrong contents as often as right ones.
fn document() -> impl Strategy<Value = String> {
    let ring = prop::collection::vec(position(), 0..8).prop_map(|v| format!("[{}]", v.join(","))).boxed();
    let rings = prop::collection::vec(ring.clone(), 0..3).prop_map(|v| format!("[{}]", v.join(","))).boxed();
    let kind = prop_oneof![
        Just("Point"), Just("LineString"), Just("Polygon"), Just("MultiPoint"), Just("MultiLineString"),
        Just("MultiPolygon"), Just("GeometryCollection"), Just("Feature"), Just("Circle"), Just("")
    ];
    let coordinates = prop_oneof![position(), ring, rings.clone(), prop::collection::vec(rings, 0..3).prop_map(|v| format!("[{}]", v.join(",")))];
    (kind, coordinates, any::<bool>()).prop_map(|(k, c, crs)| {
        let crs = if crs { r#","crs":{"type":"name","properties":{"name":"EPSG:3857"}}"# } else { "" };
        format!(r#"{{"type":"{k}","coordinates":{c}{crs}}}"#)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_text_is_parsed_or_refused_with_a_class_22_error(text in ".{0,200}") {
        if let Err(e) = geojson::to_ewkb(&text) {
            prop_assert!(class_22(e.code));
        }
    }

    #[test]
    fn geojson_shaped_documents_and_their_truncations_never_panic(doc in document(), cut in 0usize..400) {
        for text in [doc.as_str(), &doc[..doc.len().min(cut)]] {
            match geojson::to_ewkb(text) {
                // What the parser accepts, the one pass reads without panicking.
                Ok(wkb) => { let _ = inspect::inspect(&wkb, &Rules { lonlat: true, ..Rules::default() }); }
                Err(e) => prop_assert!(class_22(e.code)),
            }
        }
    }

    #[test]
    fn random_and_truncated_wkb_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..300), doc in document()) {
        for wkb in [bytes.clone(), geojson::to_ewkb(&doc).unwrap_or_default()] {
            for end in [wkb.len(), wkb.len() / 2, wkb.len().saturating_sub(1)] {
                let part = &wkb[..end];
                if let Err(e) = inspect::inspect(part, &Rules { lonlat: true, find_poles: true, ..Rules::default() }) {
                    prop_assert!(class_22(e.code));
                }
                if let Err(e) = routing::cell_for_point_wkb(part, 8) {
                    prop_assert!(class_22(e.code));
                }
                let _ = inspect::bbox(part);
                let _ = geojson::text_from_wkb(part);
            }
        }
    }
}

#[test]
fn deep_nesting_is_refused_not_a_stack_overflow() {
    for depth in [200, 100_000] {
        let doc = format!(r#"{{"type":"Polygon","coordinates":{}{}}}"#, "[".repeat(depth), "]".repeat(depth));
        assert!(class_22(geojson::to_ewkb(&doc).unwrap_err().code), "depth {depth}");
        let collection = format!(
            "{}{}",
            r#"{"type":"GeometryCollection","geometries":["#.repeat(depth.min(2000)),
            "]}".repeat(depth.min(2000))
        );
        assert!(geojson::to_ewkb(&collection).is_err(), "collection depth {depth}");
    }
}

#[test]
fn a_million_vertex_ring_is_read_whole() {
    let n = 1_000_000;
    let mut coords: Vec<String> = (0..n)
        .map(|i| {
            let a = (i as f64) / (n as f64) * std::f64::consts::TAU;
            format!("[{:.9},{:.9}]", 10.0 + a.cos(), 50.0 + a.sin())
        })
        .collect();
    coords.push(coords[0].clone());
    let doc = format!(r#"{{"type":"Polygon","coordinates":[[{}]]}}"#, coords.join(","));
    let wkb = geojson::to_ewkb(&doc).unwrap();
    let facts = inspect::inspect(&wkb, &Rules { lonlat: true, ..Rules::default() }).unwrap();
    assert!((facts.bbox[0] - 9.0).abs() < 1e-6 && (facts.bbox[3] - 51.0).abs() < 1e-6);
    assert_eq!(geojson::text_from_wkb(&wkb).unwrap().len() > 20 * n, true);
}
