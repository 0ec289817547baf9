//! feature_outbox: a transactional outbox for PostGIS feature edits.
//!
//! `edit_feature` writes a feature and a thin outbox row in the caller's transaction; the routing key
//! is the H3 cell of the feature's routing point. One module per concern; schema SQL lives in sql/.

use pgrx::prelude::*;

mod edit;
mod geojson;
mod geometry;
mod input_error;
mod routing;
mod settings;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/edit.sql", name = "edit", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    settings::init();
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
