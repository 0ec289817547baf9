//! The CHECK of an outbox row's `event_type` and `origin` (sql/outbox_check.sql), as one C function.
//!
//! PostgreSQL reads, plans and prepares every CHECK expression of a table anew for each statement
//! that writes it (ExecRelCheck keeps them per executor run only). The two `IN (...)` lists this
//! replaces cost each edit about 86,000 instructions (callgrind, bench/edit_steps.py), a tenth of
//! the edit; one call of this function about 15,000. The values allowed are the same.

use pgrx::pg_sys;

use crate::event_origin::Origin;

/// The event types an outbox row may carry.
pub const EVENT_TYPES: [&str; 5] = ["created", "moved", "retired", "updated", "snapshot"];

/// Whether `event_type` and `origin` are values an outbox row may hold.
pub fn valid(event_type: &[u8], origin: &[u8]) -> bool {
    EVENT_TYPES.iter().any(|t| t.as_bytes() == event_type)
        && [Origin::Application, Origin::Captured, Origin::Resync].iter().any(|o| o.as_str().as_bytes() == origin)
}

#[unsafe(no_mangle)]
pub extern "C" fn pg_finfo_feature_outbox_outbox_values_valid() -> &'static pg_sys::Pg_finfo_record {
    const V1: pg_sys::Pg_finfo_record = pg_sys::Pg_finfo_record { api_version: 1 };
    &V1
}

/// `_outbox_values_valid(event_type text, origin text)`, declared STRICT in sql/outbox_check.sql:
/// compares the bytes, with no conversion to Rust strings.
#[pgrx::pg_guard]
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn feature_outbox_outbox_values_valid(fcinfo: pg_sys::FunctionCallInfo) -> pg_sys::Datum {
    unsafe {
        pg_sys::Datum::from(valid(crate::datum_bytes::arg(fcinfo, 0), crate::datum_bytes::arg(fcinfo, 1)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_exactly_the_listed_values() {
        for t in EVENT_TYPES {
            for o in ["application", "captured", "resync"] {
                assert!(valid(t.as_bytes(), o.as_bytes()), "{t} {o}");
            }
        }
        assert!(!valid(b"Moved", b"application"));
        assert!(!valid(b"moved", b"applications"));
        assert!(!valid(b"", b"resync"));
        assert!(!valid(b"moved ", b"resync"));
    }
}
