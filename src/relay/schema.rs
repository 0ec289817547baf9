//! Whether this database holds the extension at the library's own version, looked at every wake-up.

use pgrx::prelude::*;

use super::error::RelayError;
use super::worker_slot::WorkerSlot;
use super::transaction::{in_transaction_try, kept_one};
use super::identity::{self, Identity};
use super::{LIBRARY_VERSION, exit_worker};
use crate::relay_state::{Presence, RELAY, WorkerState, this_database};

#[derive(Default)]
pub struct SchemaCheck {
    /// The reason the worker last logged for waiting, so each is logged once.
    waiting_logged: Option<String>,
    /// Worker 0 has looked for captured layers (once per start).
    capture_looked: bool,
}

impl SchemaCheck {
    /// True when this database holds the extension at the library's own version. Otherwise the
    /// worker waits in a visible state, logged once per change of reason: the SQL it runs belongs
    /// to this library's release, and an older schema (new files installed, ALTER EXTENSION UPDATE
    /// not yet run) must not be claimed or marked by it. Every upgrade script ends by waking the
    /// workers at commit, so they resume at once. Without the extension the worker leaves the
    /// database.
    ///
    /// Then the database's identity (sql/identity.sql), kept while every batch finds it unchanged
    /// (identity.rs): a database whose outbox came from another one (restored, TEMPLATE or
    /// file-level copy) is held, its rows waiting, until resolve_copy() says what it is;
    /// resolve_copy wakes the workers at commit.
    pub fn ready(&mut self, me: &WorkerSlot) -> bool {
        let (state, error) = match installed_version(me) {
            Ok(v) if v == LIBRARY_VERSION => match identity::check() {
                Ok(Identity::Serving) => {
                    self.waiting_logged = None;
                    if me.index == 0 && !self.capture_looked {
                        self.capture_looked = want_capture();
                    }
                    return true;
                }
                Ok(Identity::Copy(reason)) => (WorkerState::Held, RelayError::Sql(reason)),
                Err(e) => (WorkerState::Idle, RelayError::Sql(format!("cannot check the database's identity: {e}"))),
            },
            Ok(schema) => (WorkerState::WaitingForUpdate, RelayError::SchemaBehind { schema, library: LIBRARY_VERSION }),
            Err(e) => (WorkerState::Idle, RelayError::Sql(format!("cannot read pg_extension: {e}"))),
        };
        // The reason is also recorded as the last error, where the views show it. One line in the
        // log per database (worker 0's) for a held copy, whose reason every worker finds alike.
        let reason = error.to_string();
        if self.waiting_logged.as_deref() != Some(reason.as_str()) {
            if state != WorkerState::Held || me.index == 0 {
                log!("{}: {reason}", me.tag);
            }
            me.record_error(&reason);
            self.waiting_logged = Some(reason);
        }
        me.set_state(state);
        false
    }
}

/// After a server start, a database with captured layers wants its capture worker again
/// (src/capture/); capture_layer asks for it itself. A copy held as such starts none. True once
/// looked.
fn want_capture() -> bool {
    let captured = in_transaction_try(|| {
        kept_one::<bool>("SELECT EXISTS (SELECT 1 FROM feature_outbox.layer_registry l WHERE l.captured_at IS NOT NULL)")
    });
    match captured {
        Ok(Some(true)) => {
            if let Some(d) = RELAY.exclusive().database_mut(this_database()) {
                d.capture.wanted = true;
            }
            crate::relay_state::wake_launcher();
            true
        }
        Ok(_) => true,
        Err(_) => false,
    }
}

/// The extension's version in this database. Leaves the database (ends the worker) when it holds
/// no extension, or the launcher forgot it.
fn installed_version(me: &WorkerSlot) -> Result<String, RelayError> {
    let database = this_database();
    loop {
        let asked = RELAY.share().database(database).map_or(0, |d| d.looks_asked);
        // One row always: get_one fails on none.
        let installed = in_transaction_try(|| kept_one::<String>("SELECT (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'feature_outbox')"));
        let mut shared = RELAY.exclusive();
        let Some(d) = shared.database_mut(database) else {
            return match installed? {
                Some(v) => Ok(v),
                None => exit_worker(), // no entry: the launcher forgot this database
            };
        };
        match installed {
            Ok(Some(v)) => {
                d.presence = Presence::Present;
                return Ok(v);
            }
            // A CREATE EXTENSION committed while this look ran: a new transaction sees it.
            Ok(None) if d.looks_asked != asked => continue,
            Ok(None) => {
                // No extension here: leave, so that the database holds no worker. Its CREATE
                // EXTENSION asks the launcher for a new look (utility_hook.rs). A first look that
                // finds none is the common case under `*`, and not logged.
                let was = std::mem::replace(&mut d.presence, Presence::Absent);
                drop(shared);
                if was != Presence::Probing {
                    log!("{}: extension feature_outbox is not in this database (any more); leaving it", me.tag);
                }
                exit_worker();
            }
            Err(e) => return Err(e),
        }
    }
}
