//! The bytes of a varlena datum (text, bytea), detoasted and unpacked, with no conversion to a
//! Rust string: the entry points compare and parse text as bytes in the database's encoding, where
//! pgrx's `&str` panics on non-ASCII text of a database that is not UTF8.

use pgrx::pg_sys;

/// The bytes of varlena `datum` (not NULL), valid in the current memory context.
pub unsafe fn of<'a>(datum: pg_sys::Datum) -> &'a [u8] {
    unsafe { pgrx::varlena::varlena_to_byte_slice(pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr())) }
}

/// The bytes of varlena argument `i` (not NULL) of the call `fcinfo`.
pub unsafe fn arg<'a>(fcinfo: pg_sys::FunctionCallInfo, i: usize) -> &'a [u8] {
    unsafe { of(pgrx::fcinfo::pg_getarg_datum_raw(fcinfo, i)) }
}
