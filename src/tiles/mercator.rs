//! Web Mercator (EPSG:3857) in world units: x and y in [0, 1] over the zoom-0 tile, y counted from
//! the north as in the XYZ (slippy-map) tile scheme. Pure math, no Postgres.

/// The latitude at which Web Mercator's square world ends, in degrees: atan(sinh(π)).
pub const MAX_LATITUDE_DEG: f64 = 85.051_128_779_806_59;

/// The width of the world in EPSG:3857 metres (2π × 6,378,137 m), for limits given in metres.
pub const WORLD_WIDTH_M: f64 = 40_075_016.685_578_49;

/// Longitude and latitude in degrees to world units. Longitudes map linearly ((lon + 180) / 360),
/// so a longitude shifted past 180° (a shape across the antimeridian) lands past x = 1; latitudes
/// beyond ±85.0511° are clamped, so they fall into the edge rows.
pub fn world_xy(lon_deg: f64, lat_deg: f64) -> [f64; 2] {
    let lat = lat_deg.clamp(-MAX_LATITUDE_DEG, MAX_LATITUDE_DEG).to_radians();
    let x = (lon_deg + 180.0) / 360.0;
    let y = (1.0 - lat.tan().asinh() / std::f64::consts::PI) / 2.0;
    [x, y.clamp(0.0, 1.0)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corners_and_centre() {
        assert_eq!(world_xy(-180.0, MAX_LATITUDE_DEG)[0], 0.0);
        assert!(world_xy(-180.0, MAX_LATITUDE_DEG)[1].abs() < 1e-12);
        assert!((world_xy(180.0, -MAX_LATITUDE_DEG)[1] - 1.0).abs() < 1e-12);
        assert_eq!(world_xy(0.0, 0.0), [0.5, 0.5]);
    }

    #[test]
    fn polar_latitudes_fall_into_the_edge_rows() {
        assert_eq!(world_xy(10.0, 89.9)[1], world_xy(10.0, 90.0)[1]);
        assert!(world_xy(10.0, 90.0)[1] < 1e-12);
        assert!((world_xy(10.0, -90.0)[1] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn matches_epsg_3857_metres() {
        // Berlin: 13.4°E 52.5°N is (1,491,681.18 m, 6,891,041.72 m) in EPSG:3857 (R = 6,378,137 m, as ST_Transform gives).
        let [x, y] = world_xy(13.4, 52.5);
        let mx = (x - 0.5) * WORLD_WIDTH_M;
        let my = (0.5 - y) * WORLD_WIDTH_M;
        assert!((mx - 1_491_681.18).abs() < 0.01, "{mx}");
        assert!((my - 6_891_041.72).abs() < 0.01, "{my}");
    }
}
