//! The worker's own transactions: an ERROR inside one aborts it and comes back as a value, where
//! BackgroundWorker::transaction would end the worker (pgrx field notes).

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use crate::plans::prepared;

/// Runs `f` in its own transaction; an ERROR (or panic) aborts the transaction and comes back as
/// RelayError::Sql instead of ending the worker.
pub fn in_transaction<R>(f: impl FnOnce() -> R) -> Result<R, RelayError> {
    transaction(f, |_| true)
}

/// `f` in its own transaction, its error and the transaction's as one.
pub fn in_transaction_try<R>(f: impl FnOnce() -> Result<R, RelayError>) -> Result<R, RelayError> {
    in_transaction(f).and_then(|r| r)
}

/// `f` in its own transaction, committed only when `f` returns Ok: an Err rolls back what `f`
/// wrote (a tile chunk's delete when its delivery failed) and comes back as it was.
pub fn in_transaction_or_abort<R>(f: impl FnOnce() -> Result<R, RelayError>) -> Result<R, RelayError> {
    transaction(f, |r| r.is_ok()).and_then(|r| r)
}

/// `f` in a transaction, committed when `commit` says so of its result, else rolled back.
fn transaction<R>(f: impl FnOnce() -> R, commit: impl FnOnce(&R) -> bool) -> Result<R, RelayError> {
    // Everything `f` touches is either rolled back with the transaction or plain Rust state that
    // stays consistent when a batch fails part-way.
    let f = std::panic::AssertUnwindSafe((f, commit));
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    PgTryBuilder::new(move || {
        let f = f; // capture the whole AssertUnwindSafe, not just its field
        let (f, commit) = f.0;
        let r = f();
        unsafe {
            pg_sys::PopActiveSnapshot();
            if commit(&r) {
                pg_sys::CommitTransactionCommand();
            } else {
                pg_sys::AbortCurrentTransaction();
            }
        }
        Ok(r)
    })
    .catch_others(|e| {
        let message = match &e {
            pg_sys::panic::CaughtError::PostgresError(r) | pg_sys::panic::CaughtError::ErrorReport(r) => r.message().to_string(),
            pg_sys::panic::CaughtError::RustPanic { ereport, .. } => ereport.message().to_string(),
        };
        unsafe { pg_sys::AbortCurrentTransaction() };
        Err(RelayError::Sql(message))
    })
    .execute()
}

/// The one value of a read-only statement without parameters, through its kept plan.
pub fn kept_one<T: FromDatum + IntoDatum>(sql: &str) -> Result<Option<T>, RelayError> {
    Spi::connect(|client| {
        let plan = prepared(client, sql, &[], false);
        Ok(client.select(&*plan, None, &[])?.first().get_one::<T>()?)
    })
}

/// The one value of a read-only statement, through SPI's select. Not Spi::get_one or Spi::run:
/// pgrx runs those through SpiClient::update, which assigns a transaction id, so a transaction
/// that only reads writes and flushes a commit record (an idle capture worker 18 a second).
pub fn read_one<T: FromDatum + IntoDatum>(sql: &str, args: &[pgrx::datum::DatumWithOid<'_>]) -> Result<Option<T>, pgrx::spi::Error> {
    Spi::connect(|client| client.select(sql, Some(1), args)?.first().get_one::<T>())
}

/// The time events of a batch are relayed at, as they carry it (RFC 3339, UTC, microseconds).
pub fn relayed_at(client: &mut SpiClient<'_>) -> Result<String, RelayError> {
    let plan = prepared(client, "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')", &[], false);
    Ok(client.select(&*plan, None, &[])?.first().get_one::<String>()?.unwrap_or_default())
}
