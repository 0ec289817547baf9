//! The identity this worker's events carry (sql/identity.sql): decided by `_identity_check()`, then
//! kept, and looked at again in every batch's transaction. A pg_restore into a database the relay
//! already serves commits the extension's own identity row first and the original's rows later: a
//! worker that took the first for good would relay the restored rows as a new source, never held.

use std::sync::Mutex;

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use super::transaction::in_transaction_try;
use crate::plans::prepared;

/// The identity found serving, until a batch finds database_identity changed under it.
static KEPT: Mutex<Option<String>> = Mutex::new(None);

/// What `_identity_check()` made of this database.
pub enum Identity {
    /// Serving as itself: the identity kept is what its events carry.
    Serving,
    /// A copy of another database, held; why, with the SQL that resolves it.
    Copy(String),
}

/// The identity kept, for the events' `database_id` (empty while there is none).
pub fn kept() -> Option<String> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

fn keep(id: Option<String>) {
    *KEPT.lock().unwrap_or_else(|e| e.into_inner()) = id;
}

/// The identity kept, or else `_identity_check()`'s answer, in a transaction of its own that may
/// write (it records a promotion, a pg_upgrade or a rename in database_identity).
pub fn check() -> Result<Identity, RelayError> {
    if kept().is_some() {
        return Ok(Identity::Serving);
    }
    let (state, id, reason) = in_transaction_try(|| {
        Spi::connect_mut(|client| {
            let row = client
                .update("SELECT c.state, c.identity::text, c.reason FROM feature_outbox._identity_check() c", None, &[])?
                .first()
                .get_three::<String, String, String>()?;
            Ok::<_, RelayError>(row)
        })
    })?;
    match (state.as_deref(), id) {
        (Some("serving"), Some(id)) => {
            keep(Some(id));
            Ok(Identity::Serving)
        }
        _ => Ok(Identity::Copy(reason.unwrap_or_else(|| "this database's identity is undecided".into()))),
    }
}

/// In a batch's transaction, after its rows were read: Ok while database_identity still holds the
/// one row kept, else IdentityChanged, with the identity forgotten so that the next wake-up asks
/// `_identity_check()` again. Under READ COMMITTED this statement sees every commit the read saw:
/// rows restored after the original's identity rows are never relayed under another.
pub fn unchanged(client: &SpiClient<'_>) -> Result<(), RelayError> {
    let plan = prepared(
        client,
        "SELECT pg_catalog.count(*)::int4, pg_catalog.min(i.identity::text) FROM feature_outbox.database_identity i",
        &[],
        false,
    );
    let (rows, first) = client.select(&*plan, None, &[])?.first().get_two::<i32, String>()?;
    let kept = kept();
    if rows == Some(1) && first.is_some() && first == kept {
        return Ok(());
    }
    keep(None);
    Err(RelayError::IdentityChanged)
}
