//! The relay's errors. Each carries what the worker needs to decide (back off, wait, retry after the
//! poll interval) and, as Display, the text it records in the workers view and logs.

use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone, PartialEq)]
pub enum RelayError {
    /// A statement failed, or its result could not be read: the batch is rolled back, the worker
    /// records the error and tries again after the poll interval.
    Sql(String),
    /// The sink cannot take events now (not configured, unreachable, refusing, overloaded): the worker
    /// backs off, at least `retry_after` when the sink asked for it.
    SinkDown { reason: String, retry_after: Option<Duration> },
    /// The database's extension is at another version than this library: the worker waits for
    /// ALTER EXTENSION UPDATE rather than run its SQL against an older schema.
    SchemaBehind { schema: String, library: &'static str },
    /// An expire output's destination did not take its tiles (src/relay/expire.rs): that output
    /// waits with a backoff; the events and other outputs go on.
    Destination(String),
    /// An expire output's destination is down or overloaded (a cache's 5xx, 408, 429, no answer):
    /// the output waits with the relay's backoff, at least `retry_after`.
    DestinationBusy { reason: String, retry_after: Option<Duration> },
    /// An expire output's destination refused the chunk (a cache's other 4xx): its edits count a
    /// failure, and are parked after feature_outbox.max_attempts.
    DestinationRefused(String),
    /// SIGTERM arrived while a batch waited (for a standby): nothing of it went out; the worker ends.
    Stopping,
    /// The standbys the settings name have not confirmed the batch's WAL position yet
    /// (relay/standby_gate.rs): nothing of it went out; the worker lets it go, waits outside any
    /// transaction, and claims again.
    StandbyBehind(u64),
    /// database_identity changed under the identity the worker kept (a restore's rows arrived):
    /// nothing of the batch went out; the worker asks `_identity_check()` again at once.
    IdentityChanged,
}

impl RelayError {
    pub fn sink_down(reason: impl Into<String>) -> RelayError {
        RelayError::SinkDown { reason: reason.into(), retry_after: None }
    }
}

impl fmt::Display for RelayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RelayError::Sql(message) => f.write_str(message),
            RelayError::SinkDown { reason, .. }
            | RelayError::Destination(reason)
            | RelayError::DestinationBusy { reason, .. }
            | RelayError::DestinationRefused(reason) => f.write_str(reason),
            RelayError::Stopping => f.write_str("the relay worker is stopping"),
            RelayError::IdentityChanged => f.write_str("this database's recorded identity changed; checking it again"),
            RelayError::StandbyBehind(lsn) => write!(f, "waiting for standbys to confirm WAL position {:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff),
            RelayError::SchemaBehind { schema, library } => write!(
                f,
                "the schema is at version {schema} and the library at {library}; waiting for ALTER EXTENSION feature_outbox UPDATE"
            ),
        }
    }
}

impl std::error::Error for RelayError {}

impl From<pgrx::spi::SpiError> for RelayError {
    fn from(e: pgrx::spi::SpiError) -> Self {
        RelayError::Sql(e.to_string())
    }
}

impl From<crate::subxact::Failure> for RelayError {
    fn from(f: crate::subxact::Failure) -> Self {
        RelayError::Sql(f.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_reads_as_the_reason_the_worker_records() {
        assert_eq!(RelayError::Sql("relation \"x\" does not exist".into()).to_string(), "relation \"x\" does not exist");
        let down = RelayError::SinkDown { reason: "HTTP 503: busy".into(), retry_after: Some(Duration::from_secs(5)) };
        assert_eq!(down.to_string(), "HTTP 503: busy");
        assert_eq!(
            RelayError::SchemaBehind { schema: "0.2.0".into(), library: "0.3.0" }.to_string(),
            "the schema is at version 0.2.0 and the library at 0.3.0; waiting for ALTER EXTENSION feature_outbox UPDATE"
        );
    }
}
