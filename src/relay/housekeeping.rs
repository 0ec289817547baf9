//! Worker 0's periodic jobs for its database: each a name, an interval and a body. The loop runs
//! those due between batches (`Phase::Draining`, only the jobs that must keep up with a drain) and
//! once the backlog is drained (`Phase::Idle`). Other workers have none.

use std::time::{Duration, Instant};

use pgrx::prelude::*;

use super::error::RelayError;
use super::low_water::{self, LowWater};
use super::worker_slot::WorkerSlot;
use super::transaction::{in_transaction_try, kept_one};
use crate::relay_state::{RELAY, now, this_database};
use crate::settings;

/// How soon an idle worker 0 looks at the low-water mark again while a candidate waits.
const LOW_WATER_LOOK: Duration = Duration::from_millis(150);
/// How often worker 0 counts its database's unpublished rows for relay_databases, at most.
const COUNT_EVERY: Duration = Duration::from_secs(1);
/// A count that took t waits COUNT_SHARE x t before the next: counting a deep backlog every second
/// took 10 % of a draining worker's CPU (perf, 100,000 rows), now at most 1/COUNT_SHARE.
const COUNT_SHARE: u32 = 50;
/// Counting stops here: the figure is for a view, and a deep backlog must not slow its drain.
const COUNT_CAP: i64 = 1_000_000;
const RETENTION_EVERY: Duration = Duration::from_secs(60);
const RETENTION_CHUNK: i64 = 5000;
/// Retention's scan starts this long before the newest publish time it deleted. A row's published_at
/// is taken by the mark statement, just before its transaction commits, so no row published earlier
/// than that can become visible after a run's scan has passed it.
const RETENTION_FLOOR_MARGIN_S: f64 = 600.0;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Before each batch of a drain.
    Draining,
    /// The backlog is drained.
    Idle,
}

/// What a job's failure does: recorded as the worker's last error, logged as a warning, or left
/// for the next run.
#[derive(Clone, Copy)]
enum OnError {
    Record,
    Warn,
    Quiet,
}

/// One periodic job.
pub struct Task {
    pub name: &'static str,
    /// Runs between the batches of a drain too, not only once it is drained.
    during_drain: bool,
    /// How long after its last start it is due again; None: nothing to do under the settings.
    every: fn(&State) -> Option<Duration>,
    body: fn(&mut State) -> Result<(), RelayError>,
    on_error: OnError,
    /// While it has work waiting (or missed a run for being too soon), an idle worker wakes within
    /// this long to run it.
    soon: Option<(Duration, fn(&State) -> bool)>,
}

/// What the jobs keep between runs.
#[derive(Default)]
pub struct State {
    low_water: LowWater,
    /// How long the last count took.
    count_took: Duration,
    /// The newest publish time (epoch seconds) retention has deleted, since this worker started.
    retention_floor: Option<f64>,
}

/// Worker 0's jobs, in the order they run.
static TASKS: [Task; 3] = [
    Task { name: "retention", during_drain: false, every: retention_every, body: retention, on_error: OnError::Record, soon: None },
    // Before each claim, so a mark that moved is used at once.
    Task {
        name: "low-water mark",
        during_drain: true,
        every: |_| Some(low_water::EVERY),
        // Never outside a transaction: the mark reads the catalog, which needs a resource owner (a
        // segfault, seen in make bench, when a look ran outside one).
        body: |s| in_transaction_try(|| s.low_water.advance()),
        on_error: OnError::Warn,
        soon: Some((LOW_WATER_LOOK, |s| s.low_water.pending())),
    },
    Task {
        name: "backlog count",
        during_drain: true,
        every: |s| Some(COUNT_EVERY.max(s.count_took * COUNT_SHARE)),
        body: count_unpublished,
        on_error: OnError::Quiet,
        soon: None,
    },
];

/// The jobs of one worker, with when each last started and whether it missed a run.
pub struct Housekeeping {
    tasks: Vec<(&'static Task, Option<Instant>, bool)>,
    state: State,
}

impl Housekeeping {
    /// Worker 0 keeps its database's jobs; the others none.
    pub fn for_worker(index: usize) -> Housekeeping {
        let tasks = if index == 0 { TASKS.iter().map(|t| (t, None, false)).collect() } else { Vec::new() };
        Housekeeping { tasks, state: State::default() }
    }

    /// Runs the jobs due in `phase`, each in its own transaction(s).
    pub fn run_due(&mut self, phase: Phase, me: &WorkerSlot) {
        for (task, last, missed) in &mut self.tasks {
            if phase == Phase::Draining && !task.during_drain {
                continue;
            }
            let Some(every) = (task.every)(&self.state) else { continue };
            if last.is_some_and(|t| t.elapsed() < every) {
                *missed = true;
                continue;
            }
            *last = Some(Instant::now());
            *missed = false;
            match ((task.body)(&mut self.state), task.on_error) {
                (Ok(()), _) | (Err(_), OnError::Quiet) => {}
                (Err(e), OnError::Record) => me.record_error(&format!("{}: {e}", task.name)),
                (Err(e), OnError::Warn) => warning!("{}: {}: {e}", me.tag, task.name),
            }
        }
    }

    /// How long an idle worker may sleep, at most `poll`: less while a job has work waiting.
    pub fn idle_wait(&self, poll: Duration) -> Duration {
        self.tasks
            .iter()
            .filter_map(|(task, _, missed)| task.soon.filter(|(_, waiting)| *missed || waiting(&self.state)).map(|(soon, _)| soon))
            .fold(poll, Duration::min)
    }
}

/// Every minute, or twice per retention period when that is shorter; never with retention off.
fn retention_every(_: &State) -> Option<Duration> {
    let retention = settings::RETENTION_S.get();
    (retention > 0).then(|| RETENTION_EVERY.min(Duration::from_secs(retention as u64) / 2))
}

/// Deletes published rows older than feature_outbox.retention, in bounded chunks, each in its own
/// short transaction (never inside a publish transaction).
fn retention(state: &mut State) -> Result<(), RelayError> {
    let retention = settings::RETENTION_S.get() as f64;
    loop {
        // From the newest publish time deleted before, less a margin: the dead entries of rows
        // deleted earlier, which a long transaction keeps from VACUUM, are not walked again.
        let floor = state.retention_floor.map_or(f64::NEG_INFINITY, |f| f - RETENTION_FLOOR_MARGIN_S);
        let (n, newest) = in_transaction_try(|| {
            Spi::connect_mut(|c| {
                let rows = c.update(
                    "WITH gone AS (
                         DELETE FROM feature_outbox.outbox WHERE id IN (
                             SELECT id FROM feature_outbox.outbox
                              WHERE published_at IS NOT NULL AND published_at >= to_timestamp($3)
                                AND published_at < now() - make_interval(secs => $1)
                              ORDER BY published_at
                              LIMIT $2 FOR UPDATE SKIP LOCKED)
                         RETURNING published_at)
                     SELECT count(*), extract(epoch FROM max(published_at))::float8 FROM gone",
                    None,
                    &[retention.into(), RETENTION_CHUNK.into(), floor.into()],
                )?;
                let row = rows.first();
                Ok((row.get::<i64>(1)?.unwrap_or(0), row.get::<f64>(2)?))
            })
        })?;
        if let Some(t) = newest {
            state.retention_floor = Some(state.retention_floor.map_or(t, |f| f.max(t)));
        }
        if n < RETENTION_CHUNK {
            return Ok(());
        }
    }
}

/// Counts this database's unpublished rows (neither published nor parked) for relay_databases,
/// which cannot connect to each database: in at most 1/COUNT_SHARE of the worker's time.
fn count_unpublished(state: &mut State) -> Result<(), RelayError> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!(
            "SELECT count(*) FROM (SELECT FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL
                AND id >= feature_outbox._relay_low_water() LIMIT {COUNT_CAP}) AS unpublished"
        )
    });
    let started = Instant::now();
    let counted = in_transaction_try(|| kept_one::<i64>(&SQL));
    state.count_took = started.elapsed();
    if let Some(n) = counted? {
        let at = now();
        if let Some(d) = RELAY.exclusive().database_mut(this_database()) {
            d.unpublished = n;
            d.unpublished_at = at;
        }
    }
    Ok(())
}
