//! An area subscription: the covering H3 cells of a GeoJSON polygon at one of the relay's subject
//! resolutions, the filter subjects that select them, and the live set of features inside.
//!
//! A subject is `<prefix>.<layer>.<event_type>.<cell at r1>...<routing_key>`, each cell the H3
//! parent of the routing key (feature_outbox README, "Subjects"). A filter with `*` for the event
//! type and for each level above r selects every event routed under one res-r cell, departure
//! notices (`departed`) included.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;

use geo::{Geometry, MultiPolygon};
use h3o::geom::{ContainmentMode, TilerBuilder};
use h3o::{CellIndex, Resolution};

/// What the relay's subjects carry, and the area to subscribe to.
pub struct Area {
    /// The resolution chosen for the covering (one of `subject_resolutions`).
    pub resolution: Resolution,
    /// feature_outbox.subject_resolutions, ascending.
    pub subject_resolutions: Vec<u8>,
    pub cells: HashSet<CellIndex>,
}

/// Reads a GeoJSON Polygon or MultiPolygon (a bare geometry, a Feature, or a FeatureCollection of
/// them) in longitude/latitude degrees.
pub fn read_polygons(text: &str) -> Result<MultiPolygon, String> {
    let gj: geojson::GeoJson = text.parse().map_err(|e| format!("--area is not GeoJSON: {e}"))?;
    let geometries: Vec<geojson::Geometry> = match gj {
        geojson::GeoJson::Geometry(g) => vec![g],
        geojson::GeoJson::Feature(f) => f.geometry.into_iter().collect(),
        geojson::GeoJson::FeatureCollection(c) => c.features.into_iter().filter_map(|f| f.geometry).collect(),
    };
    let mut polygons = Vec::new();
    for g in geometries {
        match Geometry::<f64>::try_from(g).map_err(|e| format!("--area: {e}"))? {
            Geometry::Polygon(p) => polygons.push(p),
            Geometry::MultiPolygon(m) => polygons.extend(m.0),
            other => return Err(format!("--area must be a Polygon or MultiPolygon, not {other:?}").chars().take(120).collect()),
        }
    }
    if polygons.is_empty() {
        return Err("--area holds no polygon".into());
    }
    Ok(MultiPolygon(polygons))
}

/// The cells that cover `area` at `resolution` (every cell whose boundary meets it, or that holds it).
pub fn covering(area: &MultiPolygon, resolution: Resolution) -> Result<HashSet<CellIndex>, String> {
    let mut tiler = TilerBuilder::new(resolution).containment_mode(ContainmentMode::Covers).build();
    for p in &area.0 {
        tiler.add(p.clone()).map_err(|e| format!("--area: {e}"))?;
    }
    Ok(tiler.into_coverage().collect())
}

impl Area {
    /// Picks the finest subject resolution (below the routing keys' own, `key_resolution`) whose
    /// covering needs at most `max_cells` cells, else the coarsest; `fixed` forces one.
    pub fn new(area: &MultiPolygon, subject_resolutions: Vec<u8>, key_resolution: u8, fixed: Option<u8>, max_cells: usize) -> Result<Area, String> {
        let usable: Vec<u8> = subject_resolutions.iter().copied().filter(|r| *r < key_resolution).collect();
        if usable.is_empty() {
            return Err(format!("no subject resolution is coarser than the routing keys' ({key_resolution}): {subject_resolutions:?}"));
        }
        let candidates: Vec<u8> = match fixed {
            Some(r) if usable.contains(&r) => vec![r],
            Some(r) => return Err(format!("--area-resolution {r} is not one of the usable subject resolutions {usable:?}")),
            None => usable.iter().rev().copied().collect(),
        };
        let mut chosen = None;
        for r in &candidates {
            let res = Resolution::try_from(*r).map_err(|e| e.to_string())?;
            let cells = covering(area, res)?;
            let fits = cells.len() <= max_cells;
            chosen = Some((res, cells));
            if fits {
                break;
            }
        }
        let (resolution, cells) = chosen.expect("at least one candidate");
        Ok(Area { resolution, subject_resolutions, cells })
    }

    /// One filter subject per covering cell, for `layer` (`*`: every layer).
    pub fn filters(&self, prefix: &str, layer: &str) -> Vec<String> {
        let above = self.subject_resolutions.iter().filter(|r| **r < u8::from(self.resolution)).count();
        let mut cells: Vec<String> = self.cells.iter().map(|c| c.to_string()).collect();
        cells.sort();
        cells.into_iter().map(|c| format!("{prefix}.{layer}.*.{}{c}.>", "*.".repeat(above))).collect()
    }

    /// True when routing key `key` lies under one of the covering cells.
    pub fn contains_key(&self, key: &str) -> bool {
        CellIndex::from_str(key).ok().and_then(|c| c.parent(self.resolution)).is_some_and(|p| self.cells.contains(&p))
    }
}

/// The features inside the area now, from the events received.
#[derive(Default)]
pub struct LiveSet {
    /// (layer, feature_id) -> routing key
    pub features: HashMap<(String, String), String>,
    pub entered: u64,
    pub left: u64,
    /// Departure notices of features that moved within the area (their `moved` event kept them).
    pub departed_within: u64,
}

impl LiveSet {
    /// Applies one event. `departed`: it came as a departure notice. A departure drops the feature
    /// only when its new routing key is outside the area: a move inside the area arrives both as
    /// `moved` and as `departed`.
    pub fn apply(&mut self, area: &Area, departed: bool, layer: &str, feature_id: &str, action: &str, routing_key: &str) {
        let key = (layer.to_string(), feature_id.to_string());
        let inside = action != "retired" && area.contains_key(routing_key);
        if departed && inside {
            self.departed_within += 1;
            return;
        }
        if inside {
            if self.features.insert(key, routing_key.to_string()).is_none() {
                self.entered += 1;
            }
        } else if self.features.remove(&key).is_some() {
            self.left += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SQUARE: &str = r#"{"type":"Polygon","coordinates":[[[-105,39],[-104,39],[-104,40],[-105,40],[-105,39]]]}"#;

    fn key(lon: f64, lat: f64) -> String {
        h3o::LatLng::new(lat, lon).unwrap().to_cell(Resolution::Eight).to_string()
    }

    #[test]
    fn covering_filters_and_membership() {
        let polygons = read_polygons(SQUARE).unwrap();
        let area = Area::new(&polygons, vec![3, 5, 7], 8, None, 100).unwrap();
        assert_eq!(u8::from(area.resolution), 5, "res 7 needs more than 100 cells for a 1-degree square");
        assert!(area.contains_key(&key(-104.5, 39.5)) && !area.contains_key(&key(-100.0, 39.5)));
        let filters = area.filters("features", "parcels");
        assert_eq!(filters.len(), area.cells.len());
        assert!(filters.iter().all(|f| f.starts_with("features.parcels.*.*.85") && f.ends_with(".>")));
        assert!(Area::new(&polygons, vec![9], 8, None, 100).is_err());
        assert!(read_polygons(r#"{"type":"Point","coordinates":[1,2]}"#).is_err());
    }

    #[test]
    fn departures_drop_only_features_that_left() {
        let area = Area::new(&read_polygons(SQUARE).unwrap(), vec![3, 5, 7], 8, Some(5), 100).unwrap();
        let (inside, also_inside, outside) = (key(-104.5, 39.5), key(-104.2, 39.8), key(-90.0, 30.0));
        let mut live = LiveSet::default();
        live.apply(&area, false, "p", "1", "created", &inside);
        // A move within the area: moved, then its departure notice, which keeps the feature.
        live.apply(&area, false, "p", "1", "moved", &also_inside);
        live.apply(&area, true, "p", "1", "moved", &also_inside);
        assert_eq!((live.features.len(), live.entered, live.left, live.departed_within), (1, 1, 0, 1));
        // A move out: only the departure notice reaches an area subscriber.
        live.apply(&area, true, "p", "1", "moved", &outside);
        live.apply(&area, false, "p", "2", "snapshot", &inside);
        live.apply(&area, false, "p", "2", "retired", &inside);
        assert_eq!((live.features.len(), live.entered, live.left), (0, 2, 2));
    }
}
