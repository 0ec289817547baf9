//! The worker's sink: connected for the settings in effect, reconnected when they change, looked at
//! with a deadline while idle, and the backoff after it failed. The worker knows it only as
//! `dyn Sink`.

use std::time::{Duration, Instant};

use pgrx::prelude::*;

use super::error::RelayError;
use super::slot::WorkerSlot;
use super::{poll_interval, reload_if_asked, source, stopping};
use crate::backoff;
use crate::settings;
use crate::sinks::{self, Sink, SinkConfig};

/// How often a worker backing off after failed connects looks whether a server answers.
const SINK_PROBE_EVERY: Duration = Duration::from_millis(500);
const SINK_PROBE_TIMEOUT: Duration = Duration::from_millis(250);

/// The shortest wait for a look, whatever the settings: below it a sound sink would fail for its
/// round-trip time alone (poll_interval may be as low as 10 ms).
const SHORTEST_WAIT: Duration = Duration::from_millis(100);

#[derive(Default)]
pub struct Connection {
    current: Option<(SinkConfig, Box<dyn Sink>)>,
    /// Sink failures in a row, for the backoff.
    failures: u32,
    /// The last try failed to connect (no server answered), rather than to publish.
    connect_failed: bool,
    /// When the sink last proved to work (a connect, an acknowledged batch, a look): the next look
    /// is due half a poll interval later, so a draining worker adds no round trips.
    proven_at: Option<Instant>,
    down_logged: bool,
    /// The sink's notice last logged, so a reconnect does not log it again.
    notice_logged: Option<String>,
}

/// The sink settings in effect, for this worker's database.
fn config() -> SinkConfig {
    SinkConfig::from_settings(source())
}

/// How long the look at a connected sink waits for its answer: half a poll interval, so that a sink
/// that hangs with its connection open shows within 1.5 poll intervals (the next wake-up comes at
/// most one poll interval after the hang), and at most publish_timeout.
fn look_wait(config: &SinkConfig) -> Duration {
    (poll_interval() / 2).max(SHORTEST_WAIT).min(config.publish_timeout)
}

impl Connection {
    /// The sink as connected now, without connecting: for the tile step, which never waits for one.
    pub fn connected(&mut self) -> Option<&mut dyn Sink> {
        match &mut self.current {
            Some((_, sink)) => Some(&mut **sink),
            None => None,
        }
    }

    /// The connected sink for the current settings, (re)connecting when they changed; true when it
    /// is a new connection (a batch read ahead may have been sent ahead to the old one). Connects
    /// outside any transaction, so a slow connect never holds row locks.
    pub fn sink(&mut self, me: &WorkerSlot) -> Result<(&mut dyn Sink, bool), RelayError> {
        let config = config();
        let fresh = self.current.as_ref().is_none_or(|(c, _)| *c != config);
        if fresh {
            self.current = None;
            let connected = if config.endpoint.is_empty() {
                Err("feature_outbox.endpoint is not set; nothing is published".to_string())
            } else {
                sinks::connect(&config, &me.tag)
            };
            self.connect_failed = connected.is_err();
            let sink = connected.map_err(|reason| {
                me.count_failed_connect();
                RelayError::sink_down(reason)
            })?;
            if let Some(notice) = sink.notice()
                && self.notice_logged.as_ref() != Some(&notice)
            {
                log!("{}: {notice}", me.tag);
                self.notice_logged = Some(notice);
            }
            self.current = Some((config, sink));
            self.proven(me);
        } else if self.look_due() {
            // An idle worker's look, at each wake-up (at least each poll interval): a sink that is
            // lost or hangs shows in metrics() and the views without waiting for an edit.
            let (config, sink) = self.current.as_ref().expect("not fresh");
            match sink.health(look_wait(config)) {
                Some(Ok(())) => self.proven(me),
                Some(Err(reason)) => return Err(RelayError::sink_down(reason)),
                None => {}
            }
        }
        self.connect_failed = false;
        let (_, sink) = self.current.as_mut().expect("connected above");
        Ok((sink.as_mut(), fresh))
    }

    /// Whether the connected sink is due a look: nothing proved it working for half a poll interval.
    fn look_due(&self) -> bool {
        self.proven_at.is_none_or(|at| at.elapsed() >= poll_interval() / 2)
    }

    /// The connected sink works: shown as up, no look due for a while.
    fn proven(&mut self, me: &WorkerSlot) {
        me.sink_ok();
        self.proven_at = Some(Instant::now());
    }

    /// The sink failed: drops it (the next batch reconnects from scratch), records and logs the
    /// reason (logged once per outage), and returns how long to back off.
    pub fn down(&mut self, me: &WorkerSlot, reason: &str, retry_after: Option<Duration>) -> Duration {
        self.current = None;
        self.proven_at = None;
        self.failures += 1;
        me.sink_failed();
        me.record_error(reason);
        if !self.down_logged {
            log!("{}: sink down, backing off: {reason}", me.tag);
            self.down_logged = true;
        }
        backoff::delay(
            self.failures,
            settings::millis(&settings::RETRY_BACKOFF_MIN_MS),
            settings::millis(&settings::RETRY_BACKOFF_MAX_MS),
            retry_after,
            rand::random::<f64>(),
        )
    }

    /// A batch went through: the sink works (again).
    pub fn worked(&mut self, me: &WorkerSlot) {
        self.proven(me);
        if self.down_logged {
            log!("{}: sink back, publishing again", me.tag);
        }
        self.down_logged = false;
        self.failures = 0;
    }

    /// Sleeps out a sink backoff of `delay`. A changed sink setting (say, a corrected endpoint) ends
    /// it at once. After failed connects to a sink that can tell whether a server answers (NATS), a
    /// server that went from refusing connections to accepting them ends it within
    /// SINK_PROBE_EVERY: the delay grew through the outage, and the server is back now. (One that
    /// answers all along, refusing the credentials, say, does not.) False on SIGTERM.
    pub fn back_off(&self, delay: Duration) -> bool {
        let config = config();
        let answers = || if self.connect_failed { sinks::answers(&config, SINK_PROBE_TIMEOUT) } else { None };
        let deadline = Instant::now() + delay;
        let first = answers();
        let probe = first.is_some();
        let mut was_down = first == Some(false);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            let slice = if probe { left.min(SINK_PROBE_EVERY) } else { left };
            if !sleep_for(slice, || self::config() != config) {
                return false;
            }
            if self::config() != config {
                return true;
            }
            if let Some(up) = answers() {
                if up && was_down {
                    return true;
                }
                was_down |= !up;
            }
        }
    }
}

/// Sleeps for `d` on the latch, ignoring commit wake-ups, until `d` passed or `stop()` holds after a
/// settings reload. False when SIGTERM arrived.
fn sleep_for(d: Duration, stop: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + d;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        if !pgrx::bgworkers::BackgroundWorker::wait_latch(Some(left)) || stopping() {
            return false;
        }
        if reload_if_asked() && stop() {
            return true;
        }
    }
}
