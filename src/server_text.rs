//! A `text` argument as UTF-8 whatever the database's encoding. pgrx's `&str` and `String` panic on
//! text that is not UTF-8, which is any non-ASCII text of a LATIN1 (or other non-UTF8) database: a
//! user's typo would end as XX000. This converts it as PostgreSQL converts for a UTF8 client
//! (`pg_server_to_any`), whose own errors (22021 in an SQL_ASCII database) are SQL errors.

use pgrx::callconv::{Arg, ArgAbi};
use pgrx::pg_sys;
use pgrx::prelude::*;

/// The text, in UTF-8.
pub struct ServerText(pub String);

impl FromDatum for ServerText {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Self> {
        if is_null || datum.is_null() {
            return None;
        }
        let bytes = unsafe { crate::datum_bytes::of(datum) };
        if let Some(text) = utf8_as_is(bytes) {
            return Some(ServerText(text.to_owned()));
        }
        let converted = unsafe {
            let p = pg_sys::pg_server_to_any(bytes.as_ptr().cast(), bytes.len() as i32, pg_sys::pg_enc::PG_UTF8 as i32);
            std::slice::from_raw_parts(p.cast::<u8>(), std::ffi::CStr::from_ptr(p).count_bytes())
        };
        Some(ServerText(String::from_utf8_lossy(converted).into_owned()))
    }
}

/// Text in the database's encoding that is UTF-8 as it is: any text of a UTF8 database, ASCII
/// text of another. None where it needs converting.
pub fn utf8_as_is(bytes: &[u8]) -> Option<&str> {
    let utf8 = bytes.is_ascii() || unsafe { pg_sys::GetDatabaseEncoding() } == pg_sys::pg_enc::PG_UTF8 as i32;
    utf8.then(|| std::str::from_utf8(bytes).ok()).flatten()
}

unsafe impl<'fcx> ArgAbi<'fcx> for ServerText {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        let index = arg.index();
        unsafe { arg.unbox_arg_using_from_datum().unwrap_or_else(|| panic!("argument {index} must not be null")) }
    }
}

pgrx::pgrx_sql_entity_graph::impl_sql_translatable!(ServerText, arg_only = "TEXT");
