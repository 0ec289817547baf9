//! The digest of a layer row's registered properties, which every event records beside the
//! geometry's (md5 of its EWKB, taken in SQL: layers.rs `digests`) and drift() compares; and that
//! geometry digest taken here, for the built-in move's path (moved.rs).

use md5::Md5;
use pgrx::datum::{AnyElement, Uuid};
use pgrx::prelude::*;
use pgrx::PgTupleDesc;
use sha2::{Digest, Sha256};

/// The 16 bytes of `md5(bytes)`, as `md5(bytes)::uuid` holds them in SQL: the geometry digest
/// `md5(ST_AsEWKB(g))::uuid` that events and feature_state record. PostgreSQL's md5() sets up an
/// OpenSSL EVP context on every call, about 15 µs an edit with two clients busy (issue 51);
/// this hashes in place.
#[inline(never)] // a step of its own in bench/edit_steps.py
pub(super) fn md5_bytes(bytes: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    out.copy_from_slice(&<Md5 as md5::Digest>::digest(bytes));
    out
}

/// The digest of `row`, `ROW(t.p1, t.p2, ...)` of a layer's registered properties in their
/// registered order (`ROW()` for none): the first 16 bytes of SHA-256 over each value as stored
/// (a by-value datum's bytes, a varlena's detoasted contents, a fixed-length value's bytes), with
/// its NULL flag and length. So no setting that changes how a value prints (TimeZone, DateStyle,
/// extra_float_digits, bytea_output) changes it, and it costs no output function. Change
/// detection, not security: the rows are the caller's own.
#[pg_extern(immutable, parallel_safe)]
fn _properties_digest(row: AnyElement) -> Uuid {
    let mut hash = Sha256::new();
    unsafe {
        let header = pg_sys::pg_detoast_datum(row.datum().cast_mut_ptr()) as pg_sys::HeapTupleHeader;
        let typid = pgrx::htup::heap_tuple_header_get_type_id(header);
        let typmod = pgrx::htup::heap_tuple_header_get_typmod(header);
        let tupdesc = PgTupleDesc::from_pg_is_copy(pg_sys::lookup_rowtype_tupdesc_copy(typid, typmod));
        let natts = tupdesc.len();
        let mut tuple: pg_sys::HeapTupleData = std::mem::zeroed();
        tuple.t_len = pgrx::htup::heap_tuple_header_get_datum_length(header) as u32;
        tuple.t_data = header;
        let mut values = vec![pg_sys::Datum::from(0usize); natts];
        let mut nulls = vec![false; natts];
        pg_sys::heap_deform_tuple(&mut tuple, tupdesc.as_ptr(), values.as_mut_ptr(), nulls.as_mut_ptr());
        for (i, (value, null)) in values.iter().zip(&nulls).enumerate() {
            let Some(att) = tupdesc.get(i) else { continue };
            if *null {
                hash.update([0u8]);
                continue;
            }
            hash.update([1u8]);
            let len = att.attlen as isize;
            if att.attbyval {
                hash.update(&(value.value() as u64).to_le_bytes()[..len as usize]);
            } else if len == -1 {
                let v = pg_sys::pg_detoast_datum_packed(value.cast_mut_ptr());
                let n = pgrx::varlena::varsize_any_exhdr(v);
                hash.update((n as u64).to_le_bytes());
                hash.update(std::slice::from_raw_parts(pgrx::varlena::vardata_any(v) as *const u8, n));
            } else if len == -2 {
                let s = std::ffi::CStr::from_ptr(value.cast_mut_ptr::<std::ffi::c_char>()).to_bytes();
                hash.update((s.len() as u64).to_le_bytes());
                hash.update(s);
            } else {
                hash.update(std::slice::from_raw_parts(value.cast_mut_ptr::<u8>(), len as usize));
            }
        }
    }
    let digest = hash.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::md5_bytes;

    fn hex(b: [u8; 16]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn md5_matches_rfc_1321_test_suite() {
        // RFC 1321 A.5: the values SQL's md5() gives for the same input.
        assert_eq!(hex(md5_bytes(b"")), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(md5_bytes(b"abc")), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(hex(md5_bytes(b"12345678901234567890123456789012345678901234567890123456789012345678901234567890")),
                   "57edf4a22be3c955ac49da2e2107b67a");
    }
}
