//! PostGIS's own functions, called from Rust by OID: the built-in move (`moved.rs`) asks PostGIS
//! what only it knows (emptiness, validity, the point on surface) without a SQL statement and
//! without a search_path. They are found once per backend, by name and argument types, in the
//! schema of the `geometry` type the calling function is declared with, so a caller's own schemas
//! never take part; their call information is kept for the backend's life, as a kept plan keeps it.

use std::cell::Cell;
use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

/// PostGIS's functions of one `geometry` type.
pub struct Postgis {
    geometry: pg_sys::Oid,
    from_ewkb: *mut pg_sys::FmgrInfo,
    is_empty: *mut pg_sys::FmgrInfo,
    as_ewkb: *mut pg_sys::FmgrInfo,
    as_binary: *mut pg_sys::FmgrInfo,
    is_valid_detail: *mut pg_sys::FmgrInfo,
    point_on_surface: *mut pg_sys::FmgrInfo,
    x: *mut pg_sys::FmgrInfo,
    y: *mut pg_sys::FmgrInfo,
}

thread_local! {
    static FOUND: Cell<Option<&'static Postgis>> = const { Cell::new(None) };
}

/// The functions for `geometry` (the OID of PostGIS's geometry type). Raises XX000 when one is
/// missing (a PostGIS without it).
pub fn functions(geometry: pg_sys::Oid) -> &'static Postgis {
    if let Some(p) = FOUND.with(|f| f.get()).filter(|p| p.geometry == geometry) {
        return p;
    }
    let found: &'static Postgis = Box::leak(Box::new(unsafe { find(geometry) }));
    FOUND.with(|f| f.set(Some(found)));
    found
}

unsafe fn find(geometry: pg_sys::Oid) -> Postgis {
    unsafe {
        let schema = type_namespace(geometry);
        let one = |name: &CStr| function(schema, name, &[geometry]);
        Postgis {
            geometry,
            from_ewkb: function(schema, c"st_geomfromewkb", &[pg_sys::BYTEAOID]),
            is_empty: one(c"st_isempty"),
            as_ewkb: one(c"st_asewkb"),
            as_binary: one(c"st_asbinary"),
            // ST_IsValidDetail(geom, flags integer DEFAULT 0): one function of two arguments.
            is_valid_detail: function(schema, c"st_isvaliddetail", &[geometry, pg_sys::INT4OID]),
            point_on_surface: one(c"st_pointonsurface"),
            x: one(c"st_x"),
            y: one(c"st_y"),
        }
    }
}

/// The schema of type `oid`.
unsafe fn type_namespace(oid: pg_sys::Oid) -> pg_sys::Oid {
    unsafe {
        let tuple = pg_sys::SearchSysCache1(pg_sys::SysCacheIdentifier::TYPEOID as i32, pg_sys::Datum::from(oid));
        if tuple.is_null() {
            error!("cache lookup failed for type {oid:?}");
        }
        let schema = (*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_type>(tuple)).typnamespace;
        pg_sys::ReleaseSysCache(tuple);
        schema
    }
}

/// `schema.name(args)`'s call information, in TopMemoryContext.
unsafe fn function(schema: pg_sys::Oid, name: &CStr, args: &[pg_sys::Oid]) -> *mut pg_sys::FmgrInfo {
    unsafe {
        let vector = pg_sys::buildoidvector(args.as_ptr(), args.len() as i32);
        let oid = pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::PROCNAMEARGSNSP as i32,
            pg_sys::Anum_pg_proc_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(name.as_ptr()),
            pg_sys::Datum::from(vector),
            pg_sys::Datum::from(schema),
            pg_sys::Datum::from(0),
        );
        if oid == pg_sys::InvalidOid {
            error!("PostGIS function {} ({} arguments) is missing from the schema of type geometry", name.to_string_lossy(), args.len());
        }
        let info = pg_sys::MemoryContextAllocZero(pg_sys::TopMemoryContext, size_of::<pg_sys::FmgrInfo>()) as *mut pg_sys::FmgrInfo;
        pg_sys::fmgr_info_cxt(oid, info, pg_sys::TopMemoryContext);
        info
    }
}

/// One call of a strict function of one argument that never returns NULL for a non-NULL one.
unsafe fn call(info: *mut pg_sys::FmgrInfo, arg: pg_sys::Datum) -> pg_sys::Datum {
    unsafe { pg_sys::FunctionCall1Coll(info, pg_sys::InvalidOid, arg) }
}

impl Postgis {
    /// ST_GeomFromEWKB(ewkb): a geometry datum in the current memory context.
    pub unsafe fn from_ewkb(&self, ewkb: &[u8]) -> pg_sys::Datum {
        unsafe { call(self.from_ewkb, ewkb.into_datum().expect("a bytea datum")) }
    }

    /// ST_IsEmpty(g).
    pub unsafe fn is_empty(&self, g: pg_sys::Datum) -> bool {
        unsafe { call(self.is_empty, g).value() & 0xff != 0 }
    }

    /// ST_AsEWKB(g), in the current memory context.
    pub unsafe fn as_ewkb<'a>(&self, g: pg_sys::Datum) -> &'a [u8] {
        unsafe { crate::datum_bytes::of(call(self.as_ewkb, g)) }
    }

    /// ST_AsBinary(g): ISO WKB without the SRID.
    pub unsafe fn as_binary<'a>(&self, g: pg_sys::Datum) -> &'a [u8] {
        unsafe { crate::datum_bytes::of(call(self.as_binary, g)) }
    }

    /// (ST_IsValidDetail(g)).valid: GEOS's validity, without the NOTICE ST_IsValid gives.
    pub unsafe fn is_valid(&self, g: pg_sys::Datum) -> bool {
        unsafe {
            let row = pg_sys::FunctionCall2Coll(self.is_valid_detail, pg_sys::InvalidOid, g, pg_sys::Datum::from(0i32));
            let header = pg_sys::pg_detoast_datum(row.cast_mut_ptr()) as pg_sys::HeapTupleHeader;
            let mut null = false;
            let valid = pg_sys::GetAttributeByNum(header, 1, &mut null);
            !null && valid.value() & 0xff != 0
        }
    }

    /// ST_PointOnSurface(g) as {ST_X, ST_Y}.
    pub unsafe fn point_on_surface(&self, g: pg_sys::Datum) -> [f64; 2] {
        unsafe {
            let p = call(self.point_on_surface, g);
            let coordinate = |info| f64::from_bits(call(info, p).value() as u64);
            [coordinate(self.x), coordinate(self.y)]
        }
    }
}
