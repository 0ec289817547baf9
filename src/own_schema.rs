//! Objects of the extension's own schema, looked up by name in that schema (pinned by the control
//! file), never through the caller's search_path.

use std::ffi::CStr;

use pgrx::pg_sys;

/// The OID of table `name` in schema feature_outbox, or InvalidOid (no such schema or table): two
/// syscache lookups.
pub fn relid(name: &CStr) -> pg_sys::Oid {
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"feature_outbox".as_ptr(), true);
        if schema == pg_sys::InvalidOid {
            return pg_sys::InvalidOid;
        }
        pg_sys::get_relname_relid(name.as_ptr(), schema)
    }
}
