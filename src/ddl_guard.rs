//! The Rust half of the DDL guard (sql/ddl_guard.sql): whether it is on for this session.

use pgrx::prelude::*;

use crate::settings;

/// `feature_outbox.ddl_guard` in this session. Called from the event triggers, so that the library
/// (which defines the setting as superuser-only) is loaded before the value is read: a placeholder
/// that an ordinary role set before the load is discarded then, and cannot turn the guard off.
#[pg_extern(stable, parallel_safe)]
fn _ddl_guard_on() -> bool {
    settings::DDL_GUARD.get()
}
