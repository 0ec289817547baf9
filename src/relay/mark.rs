//! Marks a batch: the delivered rows sent, the failed ones with their error, retry time or park,
//! in the transaction that holds their locks.

use pgrx::pg_sys;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use crate::backoff;
use crate::event::Row;
use crate::plans::prepared;
use crate::settings;
use crate::sinks::Outcome;

/// What one batch's transaction did, for the worker's figures and log.
#[derive(Default)]
pub struct Published {
    pub claimed: usize,
    pub not_tried: usize,
    pub delivered_by_type: [i64; 5],
    pub duplicates: i64,
    pub failed: i64,
    pub parked: Vec<(i64, &'static str, String)>,
    pub row_error: Option<String>,
    /// The first sink-level failure: the worker backs off.
    pub sink_error: Option<RelayError>,
}

/// Marks delivered rows sent and records failures, in the claiming transaction.
pub fn mark(client: &mut SpiClient<'_>, rows: &[Row], outcomes: &[Outcome]) -> Result<Published, RelayError> {
    let mut p = Published { claimed: rows.len(), ..Default::default() };
    let mut delivered = Vec::new();
    let max_attempts = settings::MAX_ATTEMPTS.get();
    let (floor, cap) = (settings::millis(&settings::RETRY_BACKOFF_MIN_MS), settings::millis(&settings::RETRY_BACKOFF_MAX_MS));
    for (row, outcome) in rows.iter().zip(outcomes) {
        let (error, permanent, park_now) = match outcome {
            Outcome::Delivered { duplicate } => {
                delivered.push(row.id);
                if let Some(i) = crate::relay_state::EVENT_TYPES.iter().position(|t| *t == row.event_type) {
                    p.delivered_by_type[i] += 1;
                }
                p.duplicates += *duplicate as i64;
                continue;
            }
            Outcome::NotTried => {
                p.not_tried += 1;
                continue;
            }
            Outcome::SinkFailed { error, retry_after } => {
                p.sink_error.get_or_insert(RelayError::SinkDown { reason: error.clone(), retry_after: *retry_after });
                (error, false, false)
            }
            Outcome::RowFailed(error) | Outcome::Undeliverable(error) => {
                p.row_error = Some(format!("outbox row {}: {error}", row.id));
                (error, true, matches!(outcome, Outcome::Undeliverable(_)))
            }
        };
        p.failed += 1;
        // Only row-level failures count towards parking and get a per-row retry time; a sink outage
        // is handled by the worker's backoff and never parks a row.
        let row_failures = row.row_failures + permanent as i32;
        let park = park_now || (permanent && max_attempts > 0 && row_failures >= max_attempts);
        let retry_ms = permanent.then(|| backoff::delay(row_failures as u32, floor, cap, None, rand::random::<f64>()).as_millis() as f64);
        client
            .update(
                "UPDATE feature_outbox.outbox
                    SET attempts = attempts + 1, row_failures = row_failures + $5::int, last_error = $2, last_attempt_at = now(),
                        next_attempt_at = CASE WHEN $4 OR $3::float8 IS NULL THEN NULL ELSE now() + make_interval(secs => $3 / 1000) END,
                        parked_at = CASE WHEN $4 THEN now() END
                  WHERE id = $1",
                None,
                &[row.id.into(), error.as_str().into(), retry_ms.into(), park.into(), (permanent as i32).into()],
            )?;
        if park {
            let why = if park_now { "at once (no retry can deliver it under the current settings)" } else { "after feature_outbox.max_attempts failures" };
            p.parked.push((row.id, why, error.clone()));
        }
    }
    if !delivered.is_empty() {
        let plan = prepared(client, "UPDATE feature_outbox.outbox SET published_at = clock_timestamp() WHERE id = ANY($1)", &[pg_sys::INT8ARRAYOID], true);
        client.update(&*plan, None, &[delivered.into()])?;
    }
    Ok(p)
}
