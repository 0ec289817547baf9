//! The worker's sink: connected for the settings in effect, reconnected when they change, looked at
//! with a deadline while idle, and the backoff after it failed, which probes the sink instead of
//! sleeping past its return. The worker knows it only as `dyn Sink`.

use std::time::{Duration, Instant};

use pgrx::prelude::*;

use super::error::RelayError;
use super::worker_slot::WorkerSlot;
use super::{poll_interval, reload_if_asked, source, stopping};
use crate::backoff;
use crate::settings;
use crate::sinks::{self, Sink, SinkConfig};

/// How often a worker backing off probes whether the sink answers again: with the probe's own
/// wait, a sink that comes back is seen within about this long.
const SINK_PROBE_EVERY: Duration = Duration::from_millis(500);

/// The shortest wait for a look or a probe, whatever the settings: below it a sound sink would fail
/// for its round-trip time alone (poll_interval may be as low as 10 ms).
const SHORTEST_WAIT: Duration = Duration::from_millis(100);

#[derive(Default)]
pub struct Connection {
    current: Option<(SinkConfig, Box<dyn Sink>)>,
    /// Sink failures in a row, for the backoff.
    failures: u32,
    /// Whether the sink answered when last seen (by a probe, or a connect that worked), under the
    /// settings it was seen with. A backoff ends early only for a sink seen not answering that
    /// answers again.
    seen: Option<(SinkConfig, bool)>,
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

/// How long a backoff's probe waits for a fresh connection to answer: a poll interval (it may take
/// TCP, TLS and a login), and at most publish_timeout, the connect's own limit. A sink that comes
/// back while a probe waits answers it at once.
fn probe_wait(config: &SinkConfig) -> Duration {
    poll_interval().max(SHORTEST_WAIT).min(config.publish_timeout)
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
        let (_, sink) = self.current.as_mut().expect("connected above");
        Ok((sink.as_mut(), fresh))
    }

    /// Whether the connected sink is due a look: nothing proved it working for half a poll interval.
    fn look_due(&self) -> bool {
        self.proven_at.is_none_or(|at| at.elapsed() >= poll_interval() / 2)
    }

    /// The connected sink works: shown as up, seen answering, no look due for a while.
    fn proven(&mut self, me: &WorkerSlot) {
        me.sink_ok();
        self.proven_at = Some(Instant::now());
        if let Some((config, _)) = &self.current {
            self.seen = Some((config.clone(), true));
        }
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

    /// Backs off for `delay` after a sink failure, probing the sink meanwhile (NATS, Kafka: a fresh
    /// connection that must answer within probe_wait) every SINK_PROBE_EVERY. The backoff ends early
    /// when a sink seen not answering answers again: the delay grew through the outage, and the
    /// sink is back now, whether it was down or hung. The next delay then starts again from
    /// retry_backoff_min, for a sink that answers before it works (JetStream still electing its
    /// leaders). A sink that answers and still fails (refused credentials, say) gets the whole
    /// delay, so it is never retried in a loop. A changed sink setting (say, a corrected endpoint)
    /// ends the backoff at once. False on SIGTERM.
    pub fn back_off(&mut self, delay: Duration) -> bool {
        let config = config();
        let until = Instant::now() + delay;
        loop {
            let answers = sinks::answers(&config, probe_wait(&config));
            if self.answers_again(&config, answers) {
                self.failures = 0;
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            let slice = if answers.is_some() { left.min(SINK_PROBE_EVERY) } else { left };
            if !sleep_for(slice, || self::config() != config) {
                return false;
            }
            if self::config() != config {
                return true;
            }
        }
    }

    /// Records what a probe found (None: this sink has no probe); true when the sink answers now
    /// and was last seen, under these settings, not answering.
    fn answers_again(&mut self, config: &SinkConfig, answers: Option<bool>) -> bool {
        let Some(answers) = answers else { return false };
        answered_again(self.seen.replace((config.clone(), answers)), config, answers)
    }
}

/// Whether a probe that found the sink `answers` under `config` ends a backoff, given what was
/// `seen` before: only the move from not answering to answering, under the same settings.
fn answered_again(seen: Option<(SinkConfig, bool)>, config: &SinkConfig, answers: bool) -> bool {
    answers && seen.is_some_and(|(c, was)| !was && c == *config)
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

#[cfg(test)]
mod tests {
    use super::answered_again;
    use crate::sinks::test_config;

    #[test]
    fn only_a_sink_seen_not_answering_that_answers_again_ends_a_backoff() {
        let (nats, other) = (test_config("nats://127.0.0.1:4222"), test_config("nats://127.0.0.1:4223"));
        // Down (refused or silent), then answering: back.
        assert!(answered_again(Some((nats.clone(), false)), &nats, true));
        // Answering all along and still failing (refused credentials): the whole backoff.
        assert!(!answered_again(Some((nats.clone(), true)), &nats, true));
        assert!(!answered_again(None, &nats, true));
        // Still down.
        assert!(!answered_again(Some((nats.clone(), false)), &nats, false));
        // Seen under other settings: says nothing about these.
        assert!(!answered_again(Some((other, false)), &nats, true));
    }
}
