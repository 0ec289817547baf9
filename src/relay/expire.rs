//! The relay's tile step, one chunk of each expire output at a time (sql/tiles.sql holds the queue):
//! read up to 1,000 waiting edits of this worker's share (its features, as the events are shared,
//! so no lock is needed), hand them to a thread for the tile math
//! (expire_math.rs), and go back to the events. A later run takes the thread's tiles, deletes the
//! chunk's edits, reads the next chunk, delivers the tiles to every destination of the output, and
//! commits: the delete lands with the delivery or not at all. At least once: a crash after a
//! delivery and before the commit delivers the chunk again (the expire table's upsert and
//! JetStream's duplicate window absorb the copy). A destination that fails holds back its own
//! output only, which waits with a backoff; the events never wait for tiles.

use std::collections::HashMap;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use super::expire_math::{self, Computed, Queued, Zooms};
use super::worker_slot::WorkerSlot;
use super::transaction::{in_transaction_try, in_transaction_or_abort};
use crate::backoff;
use crate::plans::prepared;
use crate::settings;
use crate::signals;
use crate::sinks::Sink;
use crate::tiles::cache_purge::{self, CachePurger, Method};
use crate::tiles::http_post::{KeptAgent, ListPoster};
use crate::tiles::{Tile, list};

/// Edits per output and chunk: enough to merge the tiles of neighbouring edits and spread a
/// chunk's fixed cost (a read, a PubAck, a delete: about 2 ms) thin. 1,000 over 200 took the
/// relay with an output from 0.58 to 0.71 of its rate without one on points (make bench).
const CHUNK: i64 = 1000;
/// Room left in a NATS message for its headers.
const HEADER_ROOM: usize = 1024;

const OUTPUTS_SQL: &str = "SELECT o.name, o.minzoom, o.maxzoom, o.expire_table, o.subject, o.url, o.max_tiles_geometry,
       o.cache_url, o.cache_method
  FROM feature_outbox.expire_outputs o
 WHERE EXISTS (SELECT 1 FROM feature_outbox.tile_queue q WHERE q.output = o.name AND q.parked_at IS NULL) ORDER BY o.name";

// This worker's share only ($2 workers, $3 this one), by feature as the events are shared (claim.rs):
// no other worker reads these rows, so they need no lock, and the chunk can be read in one
// transaction and delivered in a later one; and the commit that wakes a feature's worker for its
// event wakes the worker of its tiles.
const READ_SQL: &str = "SELECT q.outbox_id, q.event_type, q.old_shape, q.new_shape, q.previous_bbox, q.properties_changed,
       q.mode, q.buffer, q.full_area_limit, q.diff
  FROM feature_outbox.tile_queue q
 WHERE q.output = $1 AND q.parked_at IS NULL AND ($2 <= 1 OR (hashint8(q.feature_id) & 2147483647) % $2 = $3)
 ORDER BY q.outbox_id LIMIT $4";

const DONE_SQL: &str = "DELETE FROM feature_outbox.tile_queue WHERE output = $1 AND outbox_id = ANY($2)";

const PROGRESS_SQL: &str = "INSERT INTO feature_outbox.expire_progress AS p (output) VALUES ($1) ON CONFLICT (output) DO UPDATE
   SET tiles_by_zoom = (SELECT array_agg(coalesce(a, 0) + coalesce(b, 0) ORDER BY i)
                          FROM unnest(p.tiles_by_zoom, $2::int8[]) WITH ORDINALITY u(a, b, i)),
       edits = p.edits + $3, lists_sent = p.lists_sent + $4, boundary_fallbacks = p.boundary_fallbacks + $5,
       dropped_zooms = p.dropped_zooms + $6, box_fallbacks = p.box_fallbacks + $7, purge_requests = p.purge_requests + $8,
       last_sent_at = now()";

const OWNER_SQL: &str = "SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid = pg_catalog.to_regclass($1)";

const ERROR_SQL: &str = "UPDATE feature_outbox.expire_progress SET last_error = $2, last_error_at = now() WHERE output = $1";

// A destination refused a chunk: each of its edits counts a failure, and is parked at
// feature_outbox.max_attempts ($4; 0 never parks), as an outbox row is.
const REFUSED_SQL: &str = "UPDATE feature_outbox.tile_queue
   SET attempts = attempts + 1, last_error = $3,
       parked_at = CASE WHEN $4 > 0 AND attempts + 1 >= $4 THEN now() END
 WHERE output = $1 AND outbox_id = ANY($2)";

/// One expire output as the relay reads it.
#[derive(Clone, PartialEq)]
struct Output {
    name: String,
    zooms: Zooms,
    table: Option<String>,
    subject: Option<String>,
    url: Option<String>,
    /// The cache to purge: its URL template and method.
    cache: Option<(String, Method)>,
}

/// A chunk read and handed to a thread for its tiles; a later run delivers it.
struct InFlight {
    /// The output as it was read: a definition changed since (zooms, limit) computes afresh.
    output: Output,
    ids: Vec<i64>,
    work: Work,
    /// Where WAL ended when the chunk was read: its tiles go out once the standbys the settings
    /// name have confirmed it (standby_gate.rs). None when no standby is named.
    read_at: Option<super::standby_gate::Lsn>,
}

enum Work {
    Thread(JoinHandle<Computed>),
    /// No thread could be started: computed on the spot.
    Done(Computed),
}

impl Work {
    fn is_finished(&self) -> bool {
        match self {
            Work::Thread(h) => h.is_finished(),
            Work::Done(_) => true,
        }
    }

    fn join(self) -> Result<Computed, RelayError> {
        match self {
            Work::Thread(h) => h.join().map_err(|_| RelayError::Destination("the tile math of a chunk panicked".into())),
            Work::Done(c) => Ok(c),
        }
    }
}

/// The step's memory between wake-ups: the chunks in flight, and when each failed output may be
/// tried again.
#[derive(Default)]
pub struct ExpireStep {
    in_flight: HashMap<String, InFlight>,
    waits: HashMap<String, (Instant, u32)>,
    last_run: Option<Instant>,
    /// The HTTP clients of the outputs' URLs and caches, kept between deliveries.
    poster: Option<ListPoster>,
    purger: Option<CachePurger>,
}

/// Between the batches of a drain the step looks for new chunks at most this often: one more
/// transaction per batch would cost the events' rate even where no layer has an output. A chunk
/// whose tiles are ready is delivered at the next batch's end.
const BETWEEN_BATCHES: Duration = Duration::from_millis(100);

impl ExpireStep {
    /// `run` between the batches of a drain, without waiting for a thread: when a chunk's tiles
    /// are ready, or at most every BETWEEN_BATCHES to read new chunks.
    pub fn run_between_batches(&mut self, me: &WorkerSlot, sink: Option<&mut dyn Sink>) {
        let ready = self.in_flight.values().any(|f| f.work.is_finished());
        if ready || self.last_run.is_none_or(|t| t.elapsed() >= BETWEEN_BATCHES) {
            self.run(me, sink, false);
        }
    }

    /// For each output with waiting edits that is not waiting out a failure: delivers its chunk in
    /// flight (waiting for its thread when `wait`, else only when ready) and reads the next.
    /// Returns true when some output may have more. Errors are the output's own: recorded in
    /// expire_progress and logged, never handed to the event loop.
    pub fn run(&mut self, me: &WorkerSlot, mut sink: Option<&mut dyn Sink>, wait: bool) -> bool {
        self.last_run = Some(Instant::now());
        let outputs = match in_transaction_try(|| Spi::connect_mut(|client| outputs(client))) {
            Ok(o) => o,
            // Before 0.4.0's schema, or the extension is being dropped: nothing to do here.
            Err(_) => return false,
        };
        // A chunk of an output dropped meanwhile goes nowhere.
        self.in_flight.retain(|name, _| outputs.iter().any(|o| o.name == *name));
        let mut more = false;
        let now = Instant::now();
        for output in outputs {
            if self.waits.get(&output.name).is_some_and(|(until, _)| *until > now) {
                continue;
            }
            if !wait && self.in_flight.get(&output.name).is_some_and(|f| !f.work.is_finished()) {
                more = true;
                continue;
            }
            // The chunk in flight, unless the output was redefined since it was read; delivered
            // once the standbys the settings name have its edits, waited for outside a transaction.
            let ready = self.in_flight.remove(&output.name).filter(|f| f.output == output);
            if let Some(target) = ready.as_ref().and_then(|f| f.read_at)
                && !super::standby_gate::wait_outside(me, target)
            {
                return false;
            }
            let ready = match ready.map(|f| f.work.join().map(|c| (f.ids, c, f.read_at))).transpose() {
                Ok(r) => r,
                Err(e) => {
                    self.failed(me, &output, e, &[]);
                    continue;
                }
            };
            // The edits a refusal counts against (past the chunk's tile cap they stay for later).
            let chunk: Vec<i64> = ready.as_ref().map(|(ids, c, _)| ids[..c.taken.min(ids.len())].to_vec()).unwrap_or_default();
            let (poster, purger) = (&mut self.poster, &mut self.purger);
            let result = in_transaction_or_abort(|| {
                Spi::connect_mut(|client| {
                    let sink: Option<&mut dyn Sink> = match &mut sink {
                        Some(s) => Some(&mut **s),
                        None => None,
                    };
                    step(client, &output, sink, poster, purger, me, ready)
                })
            });
            match result {
                Ok((next, delivered)) => {
                    // Only a delivery ends a backoff: a step that only read the next chunk (the one
                    // right after a failure) says nothing about the destination.
                    if delivered {
                        self.waits.remove(&output.name);
                    }
                    more |= next.is_some() || delivered;
                    if let Some(next) = next {
                        self.in_flight.insert(output.name.clone(), next);
                    }
                }
                Err(RelayError::Stopping) => return false,
                // Behind again since the wait above: the chunk is read and delivered afresh.
                Err(RelayError::StandbyBehind(_)) => {}
                Err(e) => self.failed(me, &output, e, &chunk),
            }
        }
        more
    }

    /// An output's delivery failed: it waits with the relay's backoff (retry_backoff_min doubling
    /// up to retry_backoff_max, at least a cache's Retry-After), and its error is recorded and
    /// logged once. Its edits stay queued (the transaction that would have deleted them was rolled
    /// back); a refusal also counts against `chunk`'s edits, parking them at max_attempts.
    fn failed(&mut self, me: &WorkerSlot, output: &Output, e: RelayError, chunk: &[i64]) {
        self.in_flight.remove(&output.name);
        let failures = self.waits.get(&output.name).map_or(0, |(_, f)| *f) + 1;
        let retry_after = match &e {
            RelayError::DestinationBusy { retry_after, .. } => *retry_after,
            _ => None,
        };
        let wait = backoff::delay(
            failures,
            settings::millis(&settings::RETRY_BACKOFF_MIN_MS),
            settings::millis(&settings::RETRY_BACKOFF_MAX_MS),
            retry_after,
            rand::random::<f64>(),
        );
        self.waits.insert(output.name.clone(), (Instant::now() + wait, failures));
        let text = e.to_string();
        if failures == 1 {
            log!("{}: expire output {}: {text}; its tiles wait, retried in {} ms", me.tag, output.name, wait.as_millis());
        }
        let refused = matches!(e, RelayError::DestinationRefused(_)) && !chunk.is_empty();
        let _ = in_transaction_try(|| {
            Spi::connect_mut(|client| {
                let plan = prepared(client, ERROR_SQL, &[pg_sys::TEXTOID, pg_sys::TEXTOID], true);
                client.update(&*plan, None, &[output.name.as_str().into(), text.as_str().into()])?;
                if refused {
                    let plan = prepared(client, REFUSED_SQL, &[pg_sys::TEXTOID, pg_sys::INT8ARRAYOID, pg_sys::TEXTOID, pg_sys::INT4OID], true);
                    let args = [output.name.as_str().into(), chunk.to_vec().into(), text.as_str().into(), settings::MAX_ATTEMPTS.get().into()];
                    client.update(&*plan, None, &args)?;
                }
                Ok(())
            })
        });
    }

    /// `run`, waiting for each thread, until no output has anything waiting; false when SIGTERM
    /// came meanwhile.
    pub fn drain(&mut self, me: &WorkerSlot, mut sink: Option<&mut dyn Sink>) -> bool {
        loop {
            let sink: Option<&mut dyn Sink> = match &mut sink {
                Some(s) => Some(&mut **s),
                None => None,
            };
            if !self.run(me, sink, true) {
                return true;
            }
            if super::stopping() {
                return false;
            }
        }
    }

    /// Whether an output waits out a failure; an idle worker wakes for it in time.
    pub fn next_try(&self) -> Option<Duration> {
        let now = Instant::now();
        self.waits.values().map(|(until, _)| until.saturating_duration_since(now)).min()
    }
}

/// Index walks for the step's statements (claim.rs's PLANNER_SQL), in effect when their kept plans
/// are made: a plan made while the queue was empty seq-scanned it for each output, over the dead
/// rows of every chunk delivered since (9 % of a worker's time on a county backlog, perf).
fn plan_for_index_walks(client: &mut SpiClient<'_>) -> Result<(), RelayError> {
    let settings = prepared(client, super::claim::PLANNER_SQL, &[], true);
    client.update(&*settings, None, &[])?;
    Ok(())
}

fn outputs(client: &mut SpiClient<'_>) -> Result<Vec<Output>, RelayError> {
    plan_for_index_walks(client)?;
    let plan = prepared(client, OUTPUTS_SQL, &[], false);
    let mut out = Vec::new();
    for r in client.select(&*plan, None, &[])? {
        out.push(Output {
            name: r.get::<String>(1)?.unwrap_or_default(),
            zooms: Zooms {
                minzoom: r.get::<i32>(2)?.unwrap_or_default(),
                maxzoom: r.get::<i32>(3)?.unwrap_or_default(),
                max_tiles_geometry: r.get::<i64>(7)?.unwrap_or(100_000),
            },
            table: r.get::<String>(4)?,
            subject: r.get::<String>(5)?,
            url: r.get::<String>(6)?,
            cache: match (r.get::<String>(8)?, r.get::<String>(9)?) {
                (Some(url), Some(method)) => Some((url, Method::parse(&method).unwrap_or(Method::Xkey))),
                _ => None,
            },
        });
    }
    Ok(out)
}

/// One output's step, in the caller's transaction (rolled back on an error): delete the edits of
/// the ready chunk, read and hand off the next chunk, then deliver the ready chunk's tiles, so that
/// its thread computes the next while this one delivers. Returns the next chunk in flight, and
/// whether a chunk was delivered.
fn step(
    client: &mut SpiClient<'_>,
    output: &Output,
    sink: Option<&mut dyn Sink>,
    poster: &mut Option<ListPoster>,
    purger: &mut Option<CachePurger>,
    me: &WorkerSlot,
    ready: Option<(Vec<i64>, Computed, Option<super::standby_gate::Lsn>)>,
) -> Result<(Option<InFlight>, bool), RelayError> {
    let started = Instant::now();
    plan_for_index_walks(client)?;
    let ready = ready.map(|(mut ids, c, read_at)| {
        // Edits past the chunk's tile cap stay queued and are read again just below.
        ids.truncate(c.taken);
        (ids, c, read_at)
    });
    if let Some((ids, _, _)) = &ready {
        let done = prepared(client, DONE_SQL, &[pg_sys::TEXTOID, pg_sys::INT8ARRAYOID], true);
        client.update(&*done, None, &[output.name.as_str().into(), ids.clone().into()])?;
    }
    let next = read(client, output, me)?;
    let read_at = started.elapsed();
    let Some((ids, c, _)) = ready else {
        return Ok((next, false));
    };
    // The position now, not the chunk's (`read_at`, which only spares a wait in a transaction): it
    // is past the chunk's edits too, and a slot created since (its restart_lsn the last
    // checkpoint's) cannot confirm the chunk on an old position.
    let now_at = super::standby_gate::read_position(client)?;
    super::standby_gate::check(me, client, now_at, &format!("the tiles of {} edits (expire output {})", ids.len(), output.name))?;
    for note in &c.notes {
        log!("{}: {note}", me.tag);
    }
    let (lists, purges) = deliver(client, output, sink, poster, purger, &c.tiles, &ids)?;
    let delivered_at = started.elapsed();
    super::fault_points::crash_if_tiles_requested();
    let f = &c.figures;
    let progress = prepared(
        client,
        PROGRESS_SQL,
        &[
            pg_sys::TEXTOID,
            pg_sys::INT8ARRAYOID,
            pg_sys::INT8OID,
            pg_sys::INT8OID,
            pg_sys::INT8OID,
            pg_sys::INT8OID,
            pg_sys::INT8OID,
            pg_sys::INT8OID,
        ],
        true,
    );
    client.update(
        &*progress,
        None,
        &[
            output.name.as_str().into(),
            f.by_zoom.to_vec().into(),
            f.edits.into(),
            lists.into(),
            f.boundary_fallbacks.into(),
            f.dropped_zooms.into(),
            f.box_fallbacks.into(),
            purges.into(),
        ],
    )?;
    debug1!(
        "{}: expire output {}: {} edits, {} tiles: deleted and next read in {} µs, delivered in {} µs, counted in {} µs",
        me.tag, output.name, ids.len(), c.tiles.len(), read_at.as_micros(), (delivered_at - read_at).as_micros(),
        (started.elapsed() - delivered_at).as_micros()
    );
    Ok((next, true))
}

/// Reads this worker's next chunk of the output's queue and starts its tile math on a thread.
fn read(client: &mut SpiClient<'_>, output: &Output, me: &WorkerSlot) -> Result<Option<InFlight>, RelayError> {
    let plan = prepared(client, READ_SQL, &[pg_sys::TEXTOID, pg_sys::INT4OID, pg_sys::INT4OID, pg_sys::INT8OID], true);
    let args = [output.name.as_str().into(), (me.workers as i32).into(), (me.index as i32).into(), CHUNK.into()];
    let mut rows = Vec::new();
    for r in client.select(&*plan, None, &args)? {
        rows.push(Queued {
            outbox_id: r.get::<i64>(1)?.unwrap_or_default(),
            event_type: r.get::<String>(2)?.unwrap_or_default(),
            old: r.get::<Vec<u8>>(3)?,
            new: r.get::<Vec<u8>>(4)?,
            previous_bbox: r.get::<Vec<f64>>(5)?,
            properties_changed: r.get::<bool>(6)?.unwrap_or(true),
            mode: r.get::<String>(7)?.unwrap_or_default(),
            buffer: r.get::<f64>(8)?.unwrap_or(0.1),
            full_area_limit: r.get::<f64>(9)?,
            diff: r.get::<bool>(10)?.unwrap_or(true),
        });
    }
    if rows.is_empty() {
        return Ok(None);
    }
    let ids = rows.iter().map(|r| r.outbox_id).collect();
    let rows = std::sync::Arc::new(rows);
    let (theirs, zooms, name) = (rows.clone(), output.zooms, output.name.clone());
    // Signals stay on the main thread (signals.rs); the thread touches no Postgres state.
    let spawned = signals::blocked(|| {
        std::thread::Builder::new().name("fo-tiles".into()).spawn(move || expire_math::compute(&theirs, zooms, &name))
    });
    let work = match spawned {
        Ok(h) => Work::Thread(h),
        // No thread to be had: the math here and now.
        Err(_) => Work::Done(expire_math::compute(&rows, output.zooms, &output.name)),
    };
    let read_at = super::standby_gate::read_position(client)?;
    Ok(Some(InFlight { output: output.clone(), ids, work, read_at }))
}

/// Delivers one chunk's tiles to each destination of the output; returns the lists sent and the
/// purge requests the cache acknowledged.
fn deliver(
    client: &mut SpiClient<'_>,
    output: &Output,
    sink: Option<&mut dyn Sink>,
    poster: &mut Option<ListPoster>,
    purger: &mut Option<CachePurger>,
    tiles: &[Tile],
    ids: &[i64],
) -> Result<(i64, i64), RelayError> {
    if tiles.is_empty() {
        return Ok((0, 0));
    }
    let source = super::source();
    // The same key when the same edits are delivered again: JetStream's duplicate window and an
    // HTTP receiver can drop the copy.
    let key = format!("{}/{}/{}-{}-{}", source.database_id, output.name, ids[0], ids[ids.len() - 1], ids.len());
    let headers = [
        ("Feature-Outbox-Database-Id", source.database_id.clone()),
        ("Feature-Outbox-Expire-Output", output.name.clone()),
        ("Feature-Outbox-Tiles", tiles.len().to_string()),
    ];
    let mut lists = 0;
    if let Some(subject) = &output.subject {
        let sink = sink.ok_or_else(|| RelayError::Destination("the sink is not connected; tile lists wait for it".into()))?;
        let max = sink.max_message_bytes().ok_or_else(|| {
            RelayError::Destination("a NATS subject needs a nats:// endpoint (feature_outbox.endpoint)".into())
        })?;
        let bodies = list::bodies(tiles, max.saturating_sub(HEADER_ROOM).max(64));
        let stream = tile_stream(&output.name);
        match sink.publish_tile_lists(&stream, subject, &bodies, &key, &headers) {
            Some(Ok(())) => lists += bodies.len() as i64,
            Some(Err(e)) => return Err(RelayError::Destination(e)),
            None => return Err(RelayError::Destination("this sink cannot carry tile lists".into())),
        }
    }
    if let Some(url) = &output.url {
        let bodies = list::bodies(tiles, settings::HTTP_MAX_BODY_KB.get().max(1) as usize * 1024);
        let ca = settings::string(&settings::TLS_CA_FILE);
        let p = KeptAgent::for_settings(poster.take().map(|p| p.0), settings::millis(&settings::PUBLISH_TIMEOUT_MS), (!ca.is_empty()).then_some(ca.as_str()))
            .map(ListPoster)
            .map_err(RelayError::Destination)?;
        let sent = p.post(url, &bodies, &key, &headers);
        *poster = Some(p);
        sent.map_err(RelayError::Destination)?;
        lists += bodies.len() as i64;
    }
    // The cache after the lists: these edits committed before this worker read them, so a tile
    // fetched after its purge is rendered from the committed rows.
    let mut purges = 0;
    if let Some((template, method)) = &output.cache {
        purges = purge_cache(purger, template, *method, tiles)?;
    }
    // The expire table last, once the lists are out: a send that fails then rolls back no upsert
    // (the transaction is rolled back either way; the upsert would only have been work thrown away).
    if let Some(table) = &output.table {
        // osm2pgsql's rule: a tile expired again keeps `first` and moves `last` (a row whose `last`
        // is this second already is left alone: the same value, without a new row version). Rows in
        // key order, so two workers upserting the same low-zoom tiles lock them in the same order:
        // the tiles come sorted by key (expire_math), and unnest keeps their order. An ORDER BY here
        // sorted them again, a fifth of a 55,000-row upsert.
        let sql = format!(
            "INSERT INTO {table} AS t (zoom, x, y) SELECT * FROM unnest($1::int4[], $2::int4[], $3::int4[])
             ON CONFLICT (zoom, x, y) DO UPDATE SET last = CURRENT_TIMESTAMP(0)
              WHERE t.last IS DISTINCT FROM CURRENT_TIMESTAMP(0)"
        );
        let plan = prepared(client, &sql, &[pg_sys::INT4ARRAYOID, pg_sys::INT4ARRAYOID, pg_sys::INT4ARRAYOID], true);
        let col = |f: fn(&Tile) -> i32| tiles.iter().map(f).collect::<Vec<i32>>();
        // As the table's owner, in a restricted context (roles.rs), as the layers are read: its
        // triggers and defaults run with the owner's rights, never the relay's superuser ones.
        let owner = prepared(client, OWNER_SQL, &[pg_sys::TEXTOID], false);
        let owner = client.select(&*owner, None, &[table.as_str().into()])?.first().get_one::<pg_sys::Oid>()?;
        let owner = owner.ok_or_else(|| RelayError::Destination(format!("expire table {table} does not exist")))?;
        let context = crate::roles::current().context;
        let _as_owner = crate::roles::As::enter(owner, context, pg_sys::SECURITY_RESTRICTED_OPERATION);
        client.update(&*plan, None, &[col(|t| t.zoom as i32).into(), col(|t| t.x as i32).into(), col(|t| t.y as i32).into()])?;
    }
    Ok((lists, purges))
}

/// Purges `tiles` from the output's cache, with feature_outbox.cache_secret_file's secret.
fn purge_cache(purger: &mut Option<CachePurger>, template: &str, method: Method, tiles: &[Tile]) -> Result<i64, RelayError> {
    let ca = settings::string(&settings::TLS_CA_FILE);
    let p = KeptAgent::for_settings(purger.take().map(|p| p.0), settings::millis(&settings::PUBLISH_TIMEOUT_MS), (!ca.is_empty()).then_some(ca.as_str()))
        .map(CachePurger)
        .map_err(RelayError::Destination)?;
    let secret_file = settings::string(&settings::CACHE_SECRET_FILE);
    let secret = if secret_file.is_empty() {
        None
    } else {
        let s = std::fs::read_to_string(&secret_file)
            .map_err(|e| RelayError::Destination(format!("cannot read feature_outbox.cache_secret_file {secret_file}: {}", e.kind())))?;
        Some(s.trim().to_string())
    };
    let sent = p.purge(template, method, tiles, secret.as_deref());
    *purger = Some(p);
    sent.map_err(|f| match f {
        cache_purge::Failure::Retry { error, retry_after } => RelayError::DestinationBusy { reason: error, retry_after },
        cache_purge::Failure::Refused(error) => RelayError::DestinationRefused(error),
    })
}

/// The JetStream stream of an output's tile lists when none captures its subject yet:
/// `TILES_<OUTPUT>`, the name upper-cased (output names are lower case, so two never meet).
pub fn tile_stream(output: &str) -> String {
    format!("TILES_{}", output.to_ascii_uppercase())
}
