//! Running a piece of work in an internal subtransaction, as PL/pgSQL's EXCEPTION blocks do, so
//! that an ERROR in it is rolled back alone and comes back as a value.

use pgrx::pg_sys;
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;

/// A caught ERROR: its SQLSTATE and text.
pub struct Failure {
    pub code: PgSqlErrorCode,
    pub message: String,
    pub detail: Option<String>,
}

/// Runs `f` in a subtransaction of the current transaction. Ok: `f` returned and its work stays.
/// Err: an ERROR (or panic) in `f`, whose work is rolled back; the transaction goes on.
pub fn run<R>(f: impl FnOnce() -> R) -> Result<R, Failure> {
    let f = std::panic::AssertUnwindSafe(f);
    let (context, owner) = unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner) };
    unsafe { pg_sys::BeginInternalSubTransaction(std::ptr::null()) };
    PgTryBuilder::new(move || {
        let f = f;
        let r = (f.0)();
        unsafe {
            pg_sys::ReleaseCurrentSubTransaction();
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        }
        Ok(r)
    })
    .catch_others(move |e| {
        unsafe {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        }
        Err(match e {
            CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) | CaughtError::RustPanic { ereport: r, .. } => Failure {
                code: r.sql_error_code(),
                message: r.message().to_string(),
                detail: r.detail().map(str::to_string),
            },
        })
    })
    .execute()
}
