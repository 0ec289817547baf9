//! When an idle worker wakes for rows waiting for their per-row retry time.

use std::time::{Duration, Instant};

use super::transaction::{in_transaction_try, kept_one};

pub struct Retries {
    /// A row-level failure since the last look for rows waiting for their retry time found none.
    pending: bool,
    checked_at: Option<Instant>,
}

impl Default for Retries {
    fn default() -> Self {
        // A restart may find rows waiting.
        Retries { pending: true, checked_at: None }
    }
}

impl Retries {
    /// A row failed row-level: it waits for its retry time.
    pub fn row_failed(&mut self) {
        self.pending = true;
    }

    /// `wait`, or less when the earliest per-row retry comes before it. Rows waiting for a retry
    /// exist only after a row-level failure: look for the earliest after one, and once per poll
    /// interval (a restart, another worker's rows).
    pub fn wait(&mut self, wait: Duration, poll: Duration) -> Duration {
        if !self.pending && self.checked_at.is_some_and(|t| t.elapsed() < poll) {
            return wait;
        }
        self.checked_at = Some(Instant::now());
        let due = in_transaction_try(|| {
            kept_one::<f64>(
                "SELECT extract(epoch FROM min(next_attempt_at) - clock_timestamp())::float8 FROM feature_outbox.outbox
                  WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at IS NOT NULL
                    AND id >= feature_outbox._relay_low_water()",
            )
        });
        self.pending = !matches!(due, Ok(None));
        match due {
            // A row may have come due since the claim: then look again almost at once.
            Ok(Some(secs)) => wait.min(Duration::from_secs_f64(secs.max(0.001))),
            _ => wait,
        }
    }
}
