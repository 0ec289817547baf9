//! feature_outbox: a transactional outbox for PostGIS feature edits.
//!
//! `edit_feature` writes a feature and a thin outbox row in the caller's transaction; the routing key
//! is the H3 cell of the feature's routing point. Background workers relay the outbox to NATS
//! JetStream or HTTP. One module per concern; schema SQL lives in sql/.

use pgrx::prelude::*;

mod backoff;
mod capture;
mod databases;
mod datum_bytes;
mod ddl_guard;
mod edit;
mod event;
mod event_origin;
mod outbox_check;
mod own_schema;
mod geojson;
mod input_error;
mod launcher;
mod monitoring;
mod plans;
mod relay;
mod relay_state;
mod roles;
mod routing;
mod server_text;
mod settings;
mod signals;
mod sinks;
mod subjects;
mod subxact;
mod trace_context;
mod utility_hook;
mod cloudevents;
mod tiles;

#[cfg(any(test, feature = "pg_test"))]
mod tests;
#[cfg(test)]
mod hostile_tests;

pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!(
    "../sql/edit.sql",
    name = "edit",
    requires = [
        "schema",
        edit::_geojson_to_ewkb,
        edit::_inspect_geometry_facts,
        edit::_close_polar_caps,
        edit::_h3_cell,
        edit::_check_storage_area,
        relay_state::_wake_relay_at_commit,
        relay_state::_wake_relay_for,
        edit::layers::_layer_write_row_composite,
        edit::layers::_written_by_this_transaction,
        edit::layers::_as_caller_row
    ]
);
extension_sql_file!("../sql/origin.sql", name = "origin", requires = ["schema"]);
extension_sql_file!("../sql/outbox_check.sql", name = "outbox_check", requires = ["schema"]);
extension_sql_file!("../sql/trace.sql", name = "trace", requires = ["schema", trace_context::_traceparent, trace_context::_tracestate]);
extension_sql_file!("../sql/layers.sql", name = "layers", requires = ["schema", edit::layers::_caller_role]);
extension_sql_file!(
    "../sql/monitoring.sql",
    name = "monitoring",
    requires = [
        "edit",
        "layers",
        "tiles",
        "capture",
        monitoring::_relay_workers,
        monitoring::_relay_status,
        monitoring::_relay_databases,
        monitoring::_relay_preloaded,
        monitoring::_relay_relayed,
        monitoring::_relay_held,
        monitoring::_relay_workers_configured,
        edit::_h3_parent,
        relay_state::_relay_low_water,
        relay_state::_relay_low_water_reset
    ]
);
extension_sql_file!(
    "../sql/backfill.sql",
    name = "backfill",
    requires = ["edit", "layers", edit::layers::_as_caller_rows, edit::layers::_row_digests_sql]
);
extension_sql_file!(
    "../sql/drift.sql",
    name = "drift",
    requires = ["edit", "layers", edit::layers::_as_caller_rows, edit::layers::_row_digests_sql]
);
extension_sql_file!(
    "../sql/capture.sql",
    name = "capture",
    requires = ["drift", "layers", monitoring::_relay_preloaded, monitoring::_relay_workers_configured, capture::status::_capture_wake, capture::status::_capture_status, capture::status::_capture_outside_transaction]
);
extension_sql_file!("../sql/ddl_guard.sql", name = "ddl_guard", requires = ["layers", "capture", ddl_guard::_ddl_guard_on]);
extension_sql_file!("../sql/identity.sql", name = "identity", requires = ["schema", relay_state::_wake_relay_at_commit]);
extension_sql_file!(
    "../sql/tiles.sql",
    name = "tiles",
    requires = [
        "edit",
        "layers",
        tiles::functions::_tiles_touched,
        tiles::functions::_tiles_changed,
        tiles::functions::_expire_rule_check,
        tiles::rule_cache::_expire_rules_changed,
        relay_state::_wake_relay_at_commit
    ]
);
extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // Errors reach users as SQL errors: no Rust backtrace in their DETAIL, whatever RUST_BACKTRACE
    // the server inherited. Set before any backtrace is captured, while the backend is one thread.
    unsafe { std::env::set_var("RUST_LIB_BACKTRACE", "0") };
    settings::init();
    if unsafe { pgrx::pg_sys::process_shared_preload_libraries_in_progress } {
        relay_state::init();
        launcher::register();
        utility_hook::init();
    }
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
