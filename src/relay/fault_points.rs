//! Test builds only (cargo feature `fault-injection`): switches and entry points the tests reach
//! through SQL. Each is declared by the test harness (as a superuser, outside the extension:
//! `CREATE FUNCTION ... LANGUAGE c AS 'feature_outbox', '<name>_wrapper'`), never by the install
//! script, so test and release builds generate the same SQL.

use crate::sinks::Outcome;

#[cfg(feature = "fault-injection")]
mod enabled {
    use pgrx::prelude::*;

    use crate::relay::claim::Request;
    use crate::relay::pipeline::Pipeline;
    use crate::relay_state::RELAY;

    /// The next relay batch that gets acknowledgements exits before marking them.
    #[pg_extern(sql = false)]
    fn _test_crash_after_next_publish() {
        RELAY.exclusive().crash_after_next_publish = true;
    }

    /// The next tile delivery of an expire output exits after its destinations took the tiles
    /// and before its queued edits are deleted (src/relay/expire.rs).
    #[pg_extern(sql = false)]
    fn _test_crash_after_next_tiles() {
        RELAY.exclusive().crash_after_next_tiles = true;
    }

    /// The next capture transaction that completes a decoded one exits after its commit and
    /// before the slot is advanced (src/capture/worker.rs): the chunk is read again.
    #[pg_extern(sql = false)]
    fn _test_crash_after_next_capture() {
        RELAY.exclusive().crash_after_next_capture = true;
    }

    /// The capture worker's next read of its slot first sleeps an hour in pg_sleep, inside
    /// PostgreSQL, as a read waiting for WAL or for standbys does (slot::hearing_sigterm).
    #[pg_extern(sql = false)]
    fn _test_stall_next_capture_read() {
        RELAY.exclusive().stall_next_capture_read = true;
    }

    /// The worker's fresh claim, run in the caller's transaction: the ids of the outbox rows it
    /// claims (locked FOR UPDATE until the transaction ends) and keeps under the ordering rule,
    /// for every feature (one worker's partition of one), at most `batch_size`. The same code the
    /// worker runs (pipeline.rs `Pipeline::claim`), so isolation specs test it, not a copy of its
    /// SQL. Like the worker's, it sets the claim's planner settings for the rest of the transaction
    /// (no bitmap or sequential scans, no JIT).
    /// Declared as `_test_claim(batch_size int) RETURNS SETOF bigint`, symbol `_test_claim_wrapper`.
    #[pg_extern(sql = false)]
    fn _test_claim(batch_size: i32) -> SetOfIterator<'static, i64> {
        let request = Request { limit: i64::from(batch_size.max(0)), index: 0, workers: 1, passed_over: &[] };
        let claimed = Spi::connect_mut(|client| Pipeline::default().claim(client, &request));
        match claimed {
            Ok((batch, _)) => SetOfIterator::new(batch.rows.into_iter().map(|r| r.id)),
            Err(e) => error!("feature_outbox claim: {e}"),
        }
    }
}

/// Exits between the sink's acknowledgement and the commit that marks the rows, as a crash would,
/// when a test asked for it. The rows stay unpublished and are republished.
#[cfg(feature = "fault-injection")]
pub fn crash_if_requested(outcomes: &[Outcome]) {
    if !outcomes.iter().any(|o| matches!(o, Outcome::Delivered { .. })) {
        return;
    }
    let requested = std::mem::take(&mut crate::relay_state::RELAY.exclusive().crash_after_next_publish);
    if requested {
        pgrx::log!("feature_outbox relay: fault injection: exiting after publish, before marking rows sent");
        super::exit_process(1);
    }
}

#[cfg(not(feature = "fault-injection"))]
pub fn crash_if_requested(_outcomes: &[Outcome]) {}

/// Exits between a tile delivery and the commit that deletes its queued edits, when a test asked.
#[cfg(feature = "fault-injection")]
pub fn crash_if_tiles_requested() {
    let requested = std::mem::take(&mut crate::relay_state::RELAY.exclusive().crash_after_next_tiles);
    if requested {
        pgrx::log!("feature_outbox relay: fault injection: exiting after a tile delivery, before deleting its queued edits");
        super::exit_process(1);
    }
}

#[cfg(not(feature = "fault-injection"))]
pub fn crash_if_tiles_requested() {}

/// Exits after a capture transaction committed and before the slot is advanced, when a test asked.
#[cfg(feature = "fault-injection")]
pub fn crash_if_capture_requested() {
    let requested = std::mem::take(&mut crate::relay_state::RELAY.exclusive().crash_after_next_capture);
    if requested {
        pgrx::log!("feature_outbox capture: fault injection: exiting after writing events, before advancing the slot");
        super::exit_process(1);
    }
}

#[cfg(not(feature = "fault-injection"))]
pub fn crash_if_capture_requested() {}

/// Waits an hour inside PostgreSQL before the capture worker's read, when a test asked.
#[cfg(feature = "fault-injection")]
pub fn stall_capture_read_if_requested() -> Result<(), pgrx::spi::Error> {
    if std::mem::take(&mut crate::relay_state::RELAY.exclusive().stall_next_capture_read) {
        pgrx::log!("feature_outbox capture: fault injection: the read waits inside PostgreSQL");
        super::transaction::read_one::<String>("SELECT pg_catalog.pg_sleep(3600)::text", &[])?;
    }
    Ok(())
}

#[cfg(not(feature = "fault-injection"))]
pub fn stall_capture_read_if_requested() -> Result<(), pgrx::spi::Error> {
    Ok(())
}
