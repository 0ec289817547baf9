//! The claim's low-water mark, so that a long transaction cannot make the relay walk dead index
//! entries (the guide's gotcha 3, through VACUUM). While any snapshot older than them lives, VACUUM
//! keeps the dead `outbox_unpublished` entries of rows already published. The claim and the backlog
//! view would walk every one, from the lowest id up. They start at the mark instead.
//!
//! The mark is conservative under out-of-order commits. An INSERT into the outbox takes
//! RowExclusiveLock on it before it draws its id. So the worker reads the sequence's last value S
//! first, then the transactions that hold that lock. Once all of those have ended, every id up to S
//! is settled: committed or rolled back. The mark then moves to the lowest id up to S that is neither
//! published nor parked, or to S + 1. Parked rows below the mark are counted through their own index.
//! retry_parked() resets the mark at its commit.

use pgrx::prelude::*;
use std::time::Duration;

use super::error::RelayError;
use crate::relay_state::{RELAY, outbox_relid, this_database};

/// How often worker 0 looks (housekeeping.rs): each advance walks the entries between the old mark
/// and the new once.
pub const EVERY: Duration = Duration::from_millis(100);

/// The settled id bound a later look may turn into a new mark.
struct Candidate {
    last_id: i64,
    writers: Vec<String>,
    generation: u64,
}

#[derive(Default)]
pub struct LowWater {
    candidate: Option<Candidate>,
}

impl LowWater {
    /// One look, inside the caller's transaction. First, if the writers seen last time have all
    /// ended, it advances the mark. Then it takes a new candidate.
    pub fn advance(&mut self) -> Result<(), RelayError> {
        let relid = outbox_relid();
        let last_id = Spi::get_one::<i64>(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM feature_outbox.outbox_id_seq",
        )?
        .unwrap_or(0);
        let database = this_database();
        let (mark, generation) = {
            let mut shared = RELAY.exclusive();
            // The launcher made the entry before it started this worker, and keeps it while we run.
            let Some(shared) = shared.database_mut(database) else { return Ok(()) };
            // Another outbox (DROP and CREATE EXTENSION), or ids that went back (TRUNCATE ...
            // RESTART IDENTITY): start again from 0.
            if shared.low_water_relid != relid || last_id + 1 < shared.low_water {
                shared.low_water = 0;
                shared.low_water_relid = relid;
                shared.low_water_generation += 1;
            }
            (shared.low_water, shared.low_water_generation)
        };
        if let Some(c) = self.candidate.take_if(|c| c.generation == generation) {
            let running = Spi::get_one_with_args::<bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks WHERE virtualtransaction = ANY($1))",
                &[c.writers.clone().into()],
            )?
            .unwrap_or(true);
            if running {
                self.candidate = Some(c);
                return Ok(());
            }
            let next = Spi::get_one_with_args::<i64>(
                "SELECT coalesce(min(id), $2 + 1) FROM feature_outbox.outbox
                  WHERE published_at IS NULL AND parked_at IS NULL AND id >= $1 AND id <= $2",
                &[mark.into(), c.last_id.into()],
            )?
            .unwrap_or(mark);
            if let Some(shared) = RELAY.exclusive().database_mut(database)
                && shared.low_water_generation == c.generation
                && next > shared.low_water
            {
                shared.low_water = next;
            }
        }
        // The sequence first (read above), then the writers: a transaction that drew an id up to
        // last_id held the lock then, and holds it until it ends.
        let writers = Spi::get_one::<Vec<String>>(
            "SELECT coalesce(array_agg(virtualtransaction), '{}') FROM pg_catalog.pg_locks
              WHERE locktype = 'relation' AND relation = 'feature_outbox.outbox'::regclass
                AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid()",
        )?
        .unwrap_or_default();
        // Nothing beyond the mark: no candidate to wait for.
        let mark = RELAY.share().database(database).map_or(0, |d| d.low_water);
        self.candidate = (last_id >= mark).then_some(Candidate { last_id, writers, generation });
        Ok(())
    }

    /// A candidate waits for a later look: an idle worker should look again soon.
    pub fn pending(&self) -> bool {
        self.candidate.is_some()
    }
}
