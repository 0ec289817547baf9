//! The relay's tile step: for each expire output with waiting edits (sql/tiles.sql), claim a chunk
//! of them (`FOR UPDATE SKIP LOCKED`, so workers share the queue), turn their shapes into tiles
//! (src/tiles/), merge the chunk's tiles into one sorted set, deliver it to every destination of the
//! output, and delete the chunk's rows in the same transaction. At least once: a crash after a
//! delivery and before the commit delivers the chunk again (the expire table's upsert and
//! JetStream's duplicate window absorb the copy). A destination that fails holds back its own
//! output only, which waits with a backoff; the events never wait for tiles.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use super::error::RelayError;
use super::slot::WorkerSlot;
use super::transaction::in_transaction_try;
use crate::backoff;
use crate::plans::prepared;
use crate::settings;
use crate::sinks::Sink;
use crate::tiles::http_post::ListPoster;
use crate::tiles::{self, Change, Expired, Mode, Rule, Tile, list, shape};

/// Edits per output and transaction: enough to merge the tiles of neighbouring edits and spread a
/// chunk's fixed cost (a claim, a PubAck, a delete: about 2 ms) thin. 1,000 over 200 took the
/// relay with an output from 0.58 to 0.71 of its rate without one on points (make bench).
const CHUNK: i64 = 1000;
/// A chunk stops taking edits once it holds this many tiles (12 bytes each): the edits after stay
/// queued for the next chunk, so full covers of large shapes never hold gigabytes.
const CHUNK_TILES: usize = 2_000_000;
/// An output whose delivery failed waits at least this long, at most the cap, doubling.
const WAIT_MIN: Duration = Duration::from_secs(1);
const WAIT_MAX: Duration = Duration::from_secs(60);
/// Room left in a NATS message for its headers.
const HEADER_ROOM: usize = 1024;

const OUTPUTS_SQL: &str = "SELECT o.name, o.minzoom, o.maxzoom, o.expire_table, o.subject, o.url, o.max_tiles_geometry
  FROM feature_outbox.expire_outputs o
 WHERE EXISTS (SELECT 1 FROM feature_outbox.tile_queue q WHERE q.output = o.name) ORDER BY o.name";

const CLAIM_SQL: &str = "SELECT q.outbox_id, q.event_type, q.old_shape, q.new_shape, q.previous_bbox, q.properties_changed,
       q.mode, q.buffer, q.full_area_limit, q.diff
  FROM feature_outbox.tile_queue q
 WHERE q.output = $1
 ORDER BY q.outbox_id LIMIT $2
   FOR UPDATE OF q SKIP LOCKED";

const DONE_SQL: &str = "DELETE FROM feature_outbox.tile_queue WHERE output = $1 AND outbox_id = ANY($2)";

const PROGRESS_SQL: &str = "INSERT INTO feature_outbox.expire_progress AS p (output) VALUES ($1) ON CONFLICT (output) DO UPDATE
   SET tiles_by_zoom = (SELECT array_agg(coalesce(a, 0) + coalesce(b, 0) ORDER BY i)
                          FROM unnest(p.tiles_by_zoom, $2::int8[]) WITH ORDINALITY u(a, b, i)),
       edits = p.edits + $3, lists_sent = p.lists_sent + $4, boundary_fallbacks = p.boundary_fallbacks + $5,
       dropped_zooms = p.dropped_zooms + $6, box_fallbacks = p.box_fallbacks + $7, last_sent_at = now()";

const ERROR_SQL: &str = "UPDATE feature_outbox.expire_progress SET last_error = $2, last_error_at = now() WHERE output = $1";

/// One expire output as the relay reads it.
struct Output {
    name: String,
    minzoom: i32,
    maxzoom: i32,
    table: Option<String>,
    subject: Option<String>,
    url: Option<String>,
    max_tiles_geometry: i64,
}

/// One queued edit with the rule of its layer for this output.
struct Queued {
    outbox_id: i64,
    event_type: String,
    old: Option<Vec<u8>>,
    new: Option<Vec<u8>>,
    previous_bbox: Option<Vec<f64>>,
    properties_changed: bool,
    mode: String,
    buffer: f64,
    full_area_limit: Option<f64>,
    diff: bool,
}

/// What one chunk expired, for expire_progress and the log.
#[derive(Default)]
struct Figures {
    by_zoom: [i64; tiles::MAX_ZOOM as usize + 1],
    edits: i64,
    lists: i64,
    boundary_fallbacks: i64,
    dropped_zooms: i64,
    box_fallbacks: i64,
}

/// The step's memory between wake-ups: when each failed output may be tried again.
#[derive(Default)]
pub struct ExpireStep {
    waits: HashMap<String, (Instant, u32)>,
    last_run: Option<Instant>,
    /// The HTTP client of the outputs' URLs, kept between deliveries.
    poster: Option<ListPoster>,
}

/// Between the batches of a drain the step runs at most this often: one more transaction per
/// batch would cost the events' rate even where no layer has an output.
const BETWEEN_BATCHES: Duration = Duration::from_millis(100);

impl ExpireStep {
    /// `run`, between the batches of a drain: at most every BETWEEN_BATCHES.
    pub fn run_between_batches(&mut self, me: &WorkerSlot, sink: Option<&mut dyn Sink>) {
        if self.last_run.is_none_or(|t| t.elapsed() >= BETWEEN_BATCHES) {
            self.run(me, sink);
        }
    }

    /// Delivers one chunk of each output that has waiting edits and is not waiting out a failure.
    /// Returns true when some output may have more (a full chunk went out). Errors are the
    /// output's own: recorded in expire_progress and logged, never handed to the event loop.
    pub fn run(&mut self, me: &WorkerSlot, mut sink: Option<&mut dyn Sink>) -> bool {
        self.last_run = Some(Instant::now());
        let outputs = match in_transaction_try(|| Spi::connect(|client| outputs(client))) {
            Ok(o) => o,
            // Before 0.4.0's schema, or the extension is being dropped: nothing to do here.
            Err(_) => return false,
        };
        let mut more = false;
        let now = Instant::now();
        for output in outputs {
            if self.waits.get(&output.name).is_some_and(|(until, _)| *until > now) {
                continue;
            }
            let delivered = in_transaction_try(|| {
                Spi::connect_mut(|client| {
                    let sink: Option<&mut dyn Sink> = match &mut sink {
                        Some(s) => Some(&mut **s),
                        None => None,
                    };
                    chunk(client, &output, sink, &mut self.poster, me)
                })
            });
            match delivered {
                Ok(full) => {
                    self.waits.remove(&output.name);
                    more |= full;
                }
                Err(e) => {
                    let failures = self.waits.get(&output.name).map_or(0, |(_, f)| *f) + 1;
                    let wait = backoff::delay(failures, WAIT_MIN, WAIT_MAX, None, rand::random::<f64>());
                    self.waits.insert(output.name.clone(), (Instant::now() + wait, failures));
                    let text = e.to_string();
                    if failures == 1 {
                        log!("{}: expire output {}: {text}; its tiles wait, retried in {} ms", me.tag, output.name, wait.as_millis());
                    }
                    let _ = in_transaction_try(|| {
                        Spi::connect_mut(|client| {
                            let plan = prepared(client, ERROR_SQL, &[pg_sys::TEXTOID, pg_sys::TEXTOID], true);
                            client.update(&*plan, None, &[output.name.as_str().into(), text.as_str().into()])?;
                            Ok(())
                        })
                    });
                }
            }
        }
        more
    }

    /// `run` until no output has a full chunk waiting; false when SIGTERM came meanwhile.
    pub fn drain(&mut self, me: &WorkerSlot, mut sink: Option<&mut dyn Sink>) -> bool {
        loop {
            let sink: Option<&mut dyn Sink> = match &mut sink {
                Some(s) => Some(&mut **s),
                None => None,
            };
            if !self.run(me, sink) {
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

fn outputs(client: &SpiClient<'_>) -> Result<Vec<Output>, RelayError> {
    let plan = prepared(client, OUTPUTS_SQL, &[], false);
    let mut out = Vec::new();
    for r in client.select(&*plan, None, &[])? {
        out.push(Output {
            name: r.get::<String>(1)?.unwrap_or_default(),
            minzoom: r.get::<i32>(2)?.unwrap_or_default(),
            maxzoom: r.get::<i32>(3)?.unwrap_or_default(),
            table: r.get::<String>(4)?,
            subject: r.get::<String>(5)?,
            url: r.get::<String>(6)?,
            max_tiles_geometry: r.get::<i64>(7)?.unwrap_or(100_000),
        });
    }
    Ok(out)
}

/// One chunk of one output, in the caller's transaction: claim, expire, deliver, delete. Returns
/// whether more edits may wait (a full claim, or one cut short by CHUNK_TILES).
fn chunk(
    client: &mut SpiClient<'_>,
    output: &Output,
    sink: Option<&mut dyn Sink>,
    poster: &mut Option<ListPoster>,
    me: &WorkerSlot,
) -> Result<bool, RelayError> {
    let started = Instant::now();
    let plan = prepared(client, CLAIM_SQL, &[pg_sys::TEXTOID, pg_sys::INT8OID], true);
    let mut rows = Vec::new();
    for r in client.update(&*plan, None, &[output.name.as_str().into(), CHUNK.into()])? {
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
        return Ok(false);
    }
    let claimed_rows = rows.len();
    let claimed = started.elapsed();
    // The edits this chunk takes: all, unless their tiles pass CHUNK_TILES first (the first edit
    // always goes, so that the queue moves).
    let mut taken = 0;
    let mut figures = Figures::default();
    let mut tiles: Vec<Tile> = Vec::new();
    for row in &rows {
        if tiles.len() >= CHUNK_TILES {
            tiles.sort_unstable();
            tiles.dedup();
            if tiles.len() >= CHUNK_TILES / 2 {
                break;
            }
        }
        taken += 1;
        let (expired, boxed) = expire_row(row, output);
        if expired.fell_back_to_boundary {
            figures.boundary_fallbacks += 1;
            log!("{}: expire output {}: outbox row {} is over max_tiles_geometry ({}): only its boundary's tiles{}",
                 me.tag, output.name, row.outbox_id, output.max_tiles_geometry,
                 expired.dropped_from_zoom.map(|z| format!(", and none from zoom {z} up")).unwrap_or_default());
        }
        if expired.overlay_failed {
            log!("{}: expire output {}: outbox row {}: the difference of its old and new shape failed; both shapes' tiles instead",
                 me.tag, output.name, row.outbox_id);
        }
        if expired.tiles.is_empty() && boxed {
            log!("{}: expire output {}: outbox row {} has no shape and no box: it expires no tile", me.tag, output.name, row.outbox_id);
        }
        figures.dropped_zooms += expired.dropped_from_zoom.is_some() as i64;
        figures.box_fallbacks += boxed as i64;
        tiles.extend(expired.tiles);
    }
    tiles.sort_unstable();
    tiles.dedup();
    for t in &tiles {
        figures.by_zoom[t.zoom as usize] += 1;
    }
    let rows = &rows[..taken];
    figures.edits = rows.len() as i64;
    let ids: Vec<i64> = rows.iter().map(|r| r.outbox_id).collect();
    let computed = started.elapsed();
    figures.lists = deliver(client, output, sink, poster, &tiles, &ids)?;
    let delivered = started.elapsed();
    super::fault_points::crash_if_tiles_requested();

    let done = prepared(client, DONE_SQL, &[pg_sys::TEXTOID, pg_sys::INT8ARRAYOID], true);
    client.update(&*done, None, &[output.name.as_str().into(), ids.into()])?;
    let progress = prepared(
        client,
        PROGRESS_SQL,
        &[pg_sys::TEXTOID, pg_sys::INT8ARRAYOID, pg_sys::INT8OID, pg_sys::INT8OID, pg_sys::INT8OID, pg_sys::INT8OID, pg_sys::INT8OID],
        true,
    );
    client.update(
        &*progress,
        None,
        &[
            output.name.as_str().into(),
            figures.by_zoom.to_vec().into(),
            figures.edits.into(),
            figures.lists.into(),
            figures.boundary_fallbacks.into(),
            figures.dropped_zooms.into(),
            figures.box_fallbacks.into(),
        ],
    )?;
    debug1!(
        "{}: expire output {}: {} edits, {} tiles: claimed in {} µs, tiles in {} µs, delivered in {} µs, done in {} µs",
        me.tag, output.name, rows.len(), tiles.len(), claimed.as_micros(), (computed - claimed).as_micros(),
        (delivered - computed).as_micros(), (started.elapsed() - delivered).as_micros()
    );
    Ok(taken < claimed_rows || claimed_rows as i64 >= CHUNK)
}

/// The tiles of one queued edit, and whether a box stood in for a shape that was never kept.
fn expire_row(row: &Queued, output: &Output) -> (Expired, bool) {
    let rule = Rule {
        minzoom: output.minzoom.clamp(0, tiles::MAX_ZOOM as i32) as u8,
        maxzoom: output.maxzoom.clamp(0, tiles::MAX_ZOOM as i32) as u8,
        buffer: row.buffer,
        mode: Mode::parse(&row.mode, row.full_area_limit).unwrap_or(Mode::FullArea),
        diff: row.diff,
        max_tiles_geometry: usize::try_from(output.max_tiles_geometry).unwrap_or(usize::MAX),
    };
    // A stored shape that does not read is treated as one never kept: its box stands in.
    let read = |w: &Option<Vec<u8>>| w.as_deref().and_then(|b| shape::from_wkb(b).ok());
    let (old, new) = (read(&row.old), read(&row.new));
    let boxed = row.previous_bbox.as_deref().and_then(|b| <[f64; 4]>::try_from(b).ok()).map(tiles::box_shape);
    let (change, used_box) = match (row.event_type.as_str(), &old, &new, &boxed) {
        ("retired", Some(o), _, _) => (Some(Change::Old(o)), false),
        ("retired", None, _, Some(b)) => (Some(Change::Old(b)), true),
        ("moved", Some(o), Some(n), _) => (Some(Change::Moved { old: o, new: n, properties_changed: row.properties_changed }), false),
        // The old side never kept (written before the layer had an output, or before 0.4.0): its box.
        ("moved", None, Some(n), Some(b)) => (Some(Change::Moved { old: b, new: n, properties_changed: true }), true),
        (_, _, Some(n), _) => (Some(Change::New(n)), false),
        (_, Some(o), None, _) => (Some(Change::New(o)), false),
        (_, None, None, Some(b)) => (Some(Change::New(b)), true),
        _ => (None, true),
    };
    (change.map(|c| tiles::expire(&c, &rule)).unwrap_or_default(), used_box)
}

/// Delivers one chunk's tiles to each destination of the output; returns the lists sent.
fn deliver(
    client: &mut SpiClient<'_>,
    output: &Output,
    sink: Option<&mut dyn Sink>,
    poster: &mut Option<ListPoster>,
    tiles: &[Tile],
    ids: &[i64],
) -> Result<i64, RelayError> {
    if tiles.is_empty() {
        return Ok(0);
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
        let p = ListPoster::for_settings(poster.take(), settings::millis(&settings::PUBLISH_TIMEOUT_MS), (!ca.is_empty()).then_some(ca.as_str()))
            .map_err(RelayError::Destination)?;
        let sent = p.post(url, &bodies, &key, &headers);
        *poster = Some(p);
        sent.map_err(RelayError::Destination)?;
        lists += bodies.len() as i64;
    }
    // The expire table last, once the lists are out: the caller's transaction commits even when this
    // returns an error, so an upsert made before a failed send would stay, and every retry would
    // move `last` again. An error of the upsert itself aborts the transaction.
    if let Some(table) = &output.table {
        // osm2pgsql's rule: a tile expired again keeps `first` and moves `last` (a row whose `last`
        // is this second already is left alone: the same value, without a new row version). Rows in
        // key order, so two workers upserting the same low-zoom tiles lock them in the same order.
        let sql = format!(
            "INSERT INTO {table} AS t (zoom, x, y) SELECT * FROM unnest($1::int4[], $2::int4[], $3::int4[]) ORDER BY 1, 2, 3
             ON CONFLICT (zoom, x, y) DO UPDATE SET last = CURRENT_TIMESTAMP(0)
              WHERE t.last IS DISTINCT FROM CURRENT_TIMESTAMP(0)"
        );
        let plan = prepared(client, &sql, &[pg_sys::INT4ARRAYOID, pg_sys::INT4ARRAYOID, pg_sys::INT4ARRAYOID], true);
        let col = |f: fn(&Tile) -> i32| tiles.iter().map(f).collect::<Vec<i32>>();
        client.update(&*plan, None, &[col(|t| t.zoom as i32).into(), col(|t| t.x as i32).into(), col(|t| t.y as i32).into()])?;
    }
    Ok(lists)
}

/// The JetStream stream of an output's tile lists when none captures its subject yet:
/// `TILES_<OUTPUT>`, the name upper-cased (output names are lower case, so two never meet).
pub fn tile_stream(output: &str) -> String {
    format!("TILES_{}", output.to_ascii_uppercase())
}
