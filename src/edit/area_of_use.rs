//! A CRS's area of use, as PROJ records it (the EPSG "extent" of the CRS), in degrees of longitude
//! and latitude. PostGIS 3.3 has no SQL function for it (`postgis_srs` came in 3.4), so this reads
//! it from the PROJ library that PostGIS already loads (`proj_create_from_database`,
//! `proj_get_area_of_use`; PROJ C API, https://proj.org/en/stable/development/reference/functions.html).
//! Looked up once per backend and CRS.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_double, c_int, c_void};

use crate::input_error::{Code, InputError};

/// Where a CRS may be used, in EPSG:4326 degrees. `west > east` when the area crosses the antimeridian.
#[derive(Debug, Clone, PartialEq)]
pub struct Area {
    /// `AUTHORITY:code`, e.g. `EPSG:3031`.
    pub crs: String,
    /// The CRS's name, e.g. `WGS 84 / Antarctic Polar Stereographic`.
    pub crs_name: String,
    /// The area's name, e.g. `Antarctica`.
    pub name: String,
    pub west: f64,
    pub south: f64,
    pub east: f64,
    pub north: f64,
    /// Set when the CRS is a layer's storage CRS (its column's SRID) rather than the input's: the
    /// error then names the layer. The same area and margin apply to both (issue 20).
    pub layer: Option<String>,
}

impl Area {
    /// True when (lon, lat) lies inside the area widened by `margin` degrees on every side.
    pub fn contains(&self, lon: f64, lat: f64, margin: f64) -> bool {
        if lat < self.south - margin || lat > self.north + margin {
            return false;
        }
        let east = if self.west > self.east { self.east + 360.0 } else { self.east };
        if east - self.west + 2.0 * margin >= 360.0 {
            return true;
        }
        [lon - 360.0, lon, lon + 360.0].iter().any(|x| (self.west - margin..=east + margin).contains(x))
    }

    /// 22023, naming the CRS and its area (and the layer, for a storage CRS).
    pub fn outside_error(&self, lon: f64, lat: f64, margin: f64) -> InputError {
        let (what, hint) = match &self.layer {
            Some(layer) => (
                format!("the geometry is outside the area of use of {} ({}), the CRS layer \"{layer}\" stores in", self.crs, self.crs_name),
                format!(
                    "A later edit in {crs} would be refused, so this one is too. Store shapes from elsewhere in a layer \
                     whose column uses a CRS that covers them: EPSG:4326, or a projected CRS of their own region (a UTM \
                     zone, a State Plane zone). feature_outbox.area_of_use_margin allows {margin}° beyond the area.",
                    crs = self.crs
                ),
            ),
            None => (
                format!("coordinates are outside the area of use of {} ({})", self.crs, self.crs_name),
                format!(
                    "Check the coordinates and their SRID: are x and y swapped, or the units wrong? \
                     feature_outbox.area_of_use_margin allows {margin}° beyond the area."
                ),
            ),
        };
        InputError::new(
            Code::InvalidParameter,
            format!(
                "{what}: ({lon}, {lat}) in degrees is not in {} (longitude {} to {}, latitude {} to {})",
                self.name.trim_end_matches('.'),
                self.west,
                self.east,
                self.south,
                self.north
            ),
        )
        .hint(hint)
    }
}

#[allow(non_camel_case_types)]
type PJ_CONTEXT = c_void;
#[allow(non_camel_case_types)]
type PJ = c_void;
/// `PJ_CATEGORY_CRS` of proj.h's `PJ_CATEGORY`.
const PJ_CATEGORY_CRS: c_int = 3;
/// `PJ_LOG_NONE`: a code missing from proj.db is an answer here, not something for the server log.
const PJ_LOG_NONE: c_int = 0;

unsafe extern "C" {
    fn proj_context_create() -> *mut PJ_CONTEXT;
    fn proj_log_level(ctx: *mut PJ_CONTEXT, level: c_int) -> c_int;
    fn proj_create_from_database(
        ctx: *mut PJ_CONTEXT,
        auth_name: *const c_char,
        code: *const c_char,
        category: c_int,
        use_proj_alternative_grid_names: c_int,
        options: *const *const c_char,
    ) -> *mut PJ;
    fn proj_get_area_of_use(
        ctx: *mut PJ_CONTEXT,
        obj: *const PJ,
        west: *mut c_double,
        south: *mut c_double,
        east: *mut c_double,
        north: *mut c_double,
        area_name: *mut *const c_char,
    ) -> c_int;
    fn proj_get_name(obj: *const PJ) -> *const c_char;
    fn proj_destroy(obj: *mut PJ) -> *mut PJ;
}

thread_local! {
    /// This backend's PROJ context (its own, so its log level leaves PostGIS's alone) and the areas found.
    static CACHE: RefCell<(usize, HashMap<String, Option<Area>>)> = RefCell::new((0, HashMap::new()));
}

/// The area of use of `AUTHORITY:code` (as in spatial_ref_sys's auth_name and auth_srid), or None
/// when PROJ's database has no such CRS or records no area for it.
pub fn lookup(crs: &str) -> Option<Area> {
    CACHE.with(|cache| {
        let mut cache = cache.borrow_mut();
        if let Some(found) = cache.1.get(crs) {
            return found.clone();
        }
        if cache.0 == 0 {
            // SAFETY: plain PROJ calls; a null context makes every later call use PROJ's default one.
            unsafe {
                let ctx = proj_context_create();
                if !ctx.is_null() {
                    proj_log_level(ctx, PJ_LOG_NONE);
                }
                cache.0 = ctx as usize;
            }
        }
        let found = query(cache.0 as *mut PJ_CONTEXT, crs);
        cache.1.insert(crs.to_string(), found.clone());
        found
    })
}

fn query(ctx: *mut PJ_CONTEXT, crs: &str) -> Option<Area> {
    let (auth, code) = crs.split_once(':')?;
    let (auth_c, code_c) = (CString::new(auth).ok()?, CString::new(code).ok()?);
    // SAFETY: the strings outlive the calls; the object is destroyed before returning, after its
    // name strings (owned by it) were copied.
    unsafe {
        let pj = proj_create_from_database(ctx, auth_c.as_ptr(), code_c.as_ptr(), PJ_CATEGORY_CRS, 0, std::ptr::null());
        if pj.is_null() {
            return None;
        }
        let (mut w, mut s, mut e, mut n) = (0.0, 0.0, 0.0, 0.0);
        let mut area_name: *const c_char = std::ptr::null();
        let ok = proj_get_area_of_use(ctx, pj, &mut w, &mut s, &mut e, &mut n, &mut area_name) != 0;
        let text = |p: *const c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
        // -1000 marks an unknown bound.
        let area = (ok && [w, s, e, n].iter().all(|v| v.is_finite() && *v != -1000.0)).then(|| Area {
            crs: crs.to_string(),
            crs_name: text(proj_get_name(pj)),
            name: text(area_name),
            west: w,
            south: s,
            east: e,
            north: n,
            layer: None,
        });
        proj_destroy(pj);
        area
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area(west: f64, south: f64, east: f64, north: f64) -> Area {
        Area { crs: "EPSG:1".into(), crs_name: "test".into(), name: "test".into(), west, south, east, north, layer: None }
    }

    #[test]
    fn utm_zone_with_margin() {
        let zone33n = area(12.0, 0.0, 18.0, 84.0);
        assert!(zone33n.contains(15.0, 52.0, 1.0));
        assert!(zone33n.contains(11.5, 52.0, 1.0), "real data sits a little outside the zone");
        assert!(!zone33n.contains(10.5, 52.0, 1.0));
        assert!(!zone33n.contains(15.0, -1.5, 1.0));
        assert!(!zone33n.contains(11.5, 52.0, 0.0));
    }

    #[test]
    fn polar_and_world_areas() {
        let antarctic = area(-180.0, -90.0, 180.0, -60.0);
        assert!(antarctic.contains(123.0, -89.0, 1.0));
        assert!(!antarctic.contains(45.0, 80.0, 1.0));
        let mercator = area(-180.0, -85.06, 180.0, 85.06);
        assert!(mercator.contains(-180.0, 0.0, 0.0));
        assert!(!mercator.contains(0.0, 89.0, 1.0));
    }

    #[test]
    fn area_across_the_antimeridian() {
        let fiji = area(176.0, -20.0, -178.0, -12.0);
        assert!(fiji.contains(179.5, -17.0, 0.0));
        assert!(fiji.contains(-179.5, -17.0, 0.0));
        assert!(fiji.contains(-177.5, -17.0, 1.0));
        assert!(!fiji.contains(170.0, -17.0, 1.0));
        assert!(!fiji.contains(-170.0, -17.0, 1.0));
    }

    #[test]
    fn error_names_the_crs_and_its_area() {
        let e = area(12.0, 0.0, 18.0, 84.0).outside_error(40.0, 10.0, 1.0);
        assert_eq!(e.code, Code::InvalidParameter);
        assert!(e.message.contains("EPSG:1 (test)") && e.message.contains("longitude 12 to 18"), "{}", e.message);
        assert!(e.hint.unwrap().contains("area_of_use_margin"));
    }

    #[test]
    fn a_storage_crs_error_names_the_layer_and_a_fitting_crs() {
        let mut zone = area(12.0, 0.0, 18.0, 84.0);
        zone.layer = Some("parcels".into());
        let e = zone.outside_error(-120.0, 47.0, 1.0);
        assert_eq!(e.code, Code::InvalidParameter);
        assert!(e.message.contains("layer \"parcels\"") && e.message.contains("EPSG:1"), "{}", e.message);
        let hint = e.hint.unwrap();
        assert!(hint.contains("EPSG:4326") && hint.contains("UTM") && hint.contains("area_of_use_margin"), "{hint}");
    }
}
