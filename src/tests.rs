//! In-server tests (`cargo pgrx test`). Each body runs in a transaction that is rolled back.
//! The bulk of the SQL behaviour is covered by pg_test/sql regression files.

#[pgrx::pg_schema]
mod tests {
    use pgrx::prelude::*;

    const SQUARE: &str = r#"{"type":"Polygon","coordinates":[[[13.40,52.52],[13.40,52.53],[13.41,52.53],[13.41,52.52],[13.40,52.52]]]}"#;

    fn one<T: IntoDatum + FromDatum>(sql: &str) -> Option<T> {
        Spi::get_one::<T>(sql).expect("query failed")
    }

    #[pg_test]
    fn created_writes_feature_and_one_outbox_row() {
        let v: i32 = one(&format!("SELECT feature_outbox.edit_feature(4471, '{SQUARE}', 'created')")).unwrap();
        assert_eq!(v, 1);
        let rows: i64 = one("SELECT count(*) FROM feature_outbox.outbox WHERE feature_id = 4471").unwrap();
        assert_eq!(rows, 1);
        // The routing key is the cell of ST_PointOnSurface, recomputed here independently of edit_feature.
        let same: bool = one(
            "SELECT o.routing_key = feature_outbox._h3_cell(ST_X(p), ST_Y(p), 8)
               FROM feature_outbox.outbox o JOIN feature_outbox.features f ON f.id = o.feature_id,
                    ST_PointOnSurface(f.geom) p
              WHERE o.feature_id = 4471",
        )
        .unwrap();
        assert!(same);
        let key: String = one("SELECT routing_key FROM feature_outbox.outbox WHERE feature_id = 4471").unwrap();
        assert!(key.starts_with("88") && key.len() == 15, "resolution 8 cell expected, got {key}");
    }

    #[pg_test]
    fn versions_follow_each_edit() {
        Spi::run(&format!("SELECT feature_outbox.edit_feature(7, '{SQUARE}', 'created')")).unwrap();
        let moved: i32 = one(
            "SELECT feature_outbox.edit_feature(7, ST_SetSRID(ST_MakePoint(2.35, 48.85), 4326), 'moved')",
        )
        .unwrap();
        assert_eq!(moved, 2);
        let retired: i32 = one("SELECT feature_outbox.edit_feature(7, NULL::text, 'retired')").unwrap();
        assert_eq!(retired, 3);
        let versions: String = one(
            "SELECT string_agg(feature_version::text || event_type, ',' ORDER BY id) FROM feature_outbox.outbox",
        )
        .unwrap();
        assert_eq!(versions, "1created,2moved,3retired");
    }

    #[pg_test(error = "feature 99 does not exist")]
    fn moving_a_missing_feature_fails() {
        Spi::run(&format!("SELECT feature_outbox.edit_feature(99, '{SQUARE}', 'moved')")).unwrap();
    }

    #[pg_test]
    fn outbox_has_no_geometry_column() {
        let n: i64 = one(
            "SELECT count(*) FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
              WHERE a.attrelid = 'feature_outbox.outbox'::regclass AND a.attnum > 0
                AND (t.typname IN ('geometry', 'geography') OR (a.attname LIKE '%geom%' AND t.typname <> 'uuid'))",
        )
        .unwrap();
        assert_eq!(n, 0);
    }

    #[pg_test]
    fn resolution_guc_changes_the_cell() {
        Spi::run("SET LOCAL feature_outbox.h3_resolution = 9").unwrap();
        let key: String = one("SELECT feature_outbox.routing_key(ST_SetSRID(ST_MakePoint(1, 1), 4326))").unwrap();
        assert!(key.starts_with("89"), "{key}");
    }

    /// _inspect_geometry's named fields, for a shape across the antimeridian (bbox west > east, as
    /// RFC 7946 §5.2) and for a ring around the North Pole given in a polar CRS.
    #[pg_test]
    fn geometry_facts_name_what_the_pass_found() {
        let across: String = one(
            "SELECT format('%s %s %s %s', f.antimeridian, f.polar, f.bbox, f.h3_resolution)
               FROM feature_outbox._inspect_geometry(ST_AsBinary('POLYGON((178 51, -179 51, -179 52, 178 52, 178 51))'::geometry),
                                                     true, 4326, NULL) f",
        )
        .unwrap();
        assert_eq!(across, "t 0 {178,51,-179,52} 8");
        let polar: i32 = one(
            "SELECT (feature_outbox._inspect_geometry(ST_AsBinary(ST_Transform(ST_Buffer(ST_SetSRID(ST_MakePoint(0, 0), 3413), 1e6), 4326)),
                                                      true, 3413, NULL)).polar",
        )
        .unwrap();
        assert_eq!(polar, 1);
    }
}
