//! GUCs. Every setting is `feature_outbox.<name>`; the README lists them with context and default.

use std::ffi::{CStr, CString};
use std::time::Duration;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};

/// What `edit_feature` does with a well-formed geometry that fails `ST_IsValid`.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum InvalidGeometry {
    #[name = c"accept"]
    Accept,
    #[name = c"repair"]
    Repair,
    #[name = c"reject"]
    Reject,
}

/// The NATS subject layout (README, "Subjects").
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum SubjectFormat {
    /// `<prefix>.<layer>.<event_type>.<routing_key>` (0.2.0).
    #[name = c"0.2"]
    Layered,
    /// `<prefix>.<event_type>.<routing_key>` for the built-in layer, as 0.1.0 published it.
    #[name = c"0.1"]
    Legacy,
}

/// How an event leaves (README, "CloudEvents and tracing").
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Envelope {
    /// The event JSON with this project's headers, as 0.2.0 sends it.
    #[name = c"native"]
    Native,
    /// Binary-mode CloudEvents 1.0: the same body, the attributes in `ce-` headers.
    #[name = c"cloudevents"]
    CloudEvents,
}

/// librdkafka's `security.protocol`: how the relay reaches Kafka brokers.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum KafkaSecurity {
    #[name = c"plaintext"]
    Plaintext,
    #[name = c"ssl"]
    Ssl,
    #[name = c"sasl_plaintext"]
    SaslPlaintext,
    #[name = c"sasl_ssl"]
    SaslSsl,
}

/// librdkafka's `sasl.mechanism` (Kafka's SASL/PLAIN and SASL/SCRAM, RFC 5802 and 7677).
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum KafkaSaslMechanism {
    #[name = c"PLAIN"]
    Plain,
    #[name = c"SCRAM-SHA-256"]
    ScramSha256,
    #[name = c"SCRAM-SHA-512"]
    ScramSha512,
}

pub static ENVELOPE: GucSetting<Envelope> = GucSetting::<Envelope>::new(Envelope::Native);
pub static TRACEPARENT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static TRACESTATE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static SUBJECT_FORMAT: GucSetting<SubjectFormat> = GucSetting::<SubjectFormat>::new(SubjectFormat::Layered);
pub static H3_RESOLUTION: GucSetting<i32> = GucSetting::<i32>::new(8);
pub static AREA_OF_USE_MARGIN: GucSetting<f64> = GucSetting::<f64>::new(1.0);
pub static INVALID_GEOMETRY: GucSetting<InvalidGeometry> = GucSetting::<InvalidGeometry>::new(InvalidGeometry::Accept);

pub static RELAY_WORKERS: GucSetting<i32> = GucSetting::<i32>::new(1);
pub static WAKE_AT_COMMIT: GucSetting<bool> = GucSetting::<bool>::new(true);
pub static DDL_GUARD: GucSetting<bool> = GucSetting::<bool>::new(true);
pub static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"*"));
pub static ENDPOINT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(1000);
pub static POLL_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
pub static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
pub static PUBLISH_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(5000);
pub static MAX_ATTEMPTS: GucSetting<i32> = GucSetting::<i32>::new(10);
pub static RETRY_BACKOFF_MIN_MS: GucSetting<i32> = GucSetting::<i32>::new(1000);
pub static RETRY_BACKOFF_MAX_MS: GucSetting<i32> = GucSetting::<i32>::new(60_000);
pub static HTTP_SECRET: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static HTTP_SECRET_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static TLS_CA_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static NATS_SUBJECT_PREFIX: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"features"));
pub static NATS_STREAM: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"FEATURES"));
pub static NATS_DUPLICATE_WINDOW_S: GucSetting<i32> = GucSetting::<i32>::new(600);
pub static NATS_REPLICAS: GucSetting<i32> = GucSetting::<i32>::new(1);
pub static NATS_MAX_AGE_S: GucSetting<i32> = GucSetting::<i32>::new(7 * 24 * 3600);
pub static NATS_OBJECT_BUCKET: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"FEATURES_GEOMETRY"));
pub static NATS_CREDENTIALS_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static NATS_NKEY_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static SUBJECT_RESOLUTIONS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"3,5,7"));
pub static HTTP_MAX_BODY_KB: GucSetting<i32> = GucSetting::<i32>::new(10 * 1024);
pub static HTTP_CONCURRENCY: GucSetting<i32> = GucSetting::<i32>::new(8);
pub static HTTP_BATCH: GucSetting<i32> = GucSetting::<i32>::new(1);
pub static KAFKA_TOPIC: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static KAFKA_PARTITIONS: GucSetting<i32> = GucSetting::<i32>::new(1);
pub static KAFKA_REPLICATION_FACTOR: GucSetting<i32> = GucSetting::<i32>::new(-1);
pub static KAFKA_SECURITY_PROTOCOL: GucSetting<KafkaSecurity> = GucSetting::<KafkaSecurity>::new(KafkaSecurity::Plaintext);
pub static KAFKA_SASL_MECHANISM: GucSetting<KafkaSaslMechanism> = GucSetting::<KafkaSaslMechanism>::new(KafkaSaslMechanism::Plain);
pub static KAFKA_SASL_USERNAME: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static KAFKA_SASL_PASSWORD_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static STANDBY_SLOTS: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
pub static WAIT_FOR_SYNCHRONOUS_STANDBYS: GucSetting<bool> = GucSetting::<bool>::new(false);
pub static STANDBY_WAIT_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(0);
pub static CACHE_SECRET_FILE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);

/// Defines every setting. Postmaster-context ones only while preloading, where defining them is legal.
pub fn init() {
    GucRegistry::define_int_guc(
        c"feature_outbox.h3_resolution",
        c"H3 resolution (0-15) of the routing key that edit_feature computes.",
        c"Resolution 8 cells average 0.74 km². Changing it affects new outbox rows only.",
        &H3_RESOLUTION,
        0,
        15,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_enum_guc(
        c"feature_outbox.invalid_geometry",
        c"What edit_feature does with an invalid polygon: accept, repair (ST_MakeValid) or reject.",
        c"The routing point is taken from a made-valid copy under every policy.",
        &INVALID_GEOMETRY,
        GucContext::Suset,
        GucFlags::default(),
    );

    GucRegistry::define_float_guc(
        c"feature_outbox.area_of_use_margin",
        c"Degrees by which a geometry given in a projected SRID may lie outside that CRS's area of use.",
        c"The area of use is PROJ's (the EPSG extent). Real data often sits a little outside a UTM zone.",
        &AREA_OF_USE_MARGIN,
        0.0,
        360.0,
        GucContext::Suset,
        GucFlags::default(),
    );

    GucRegistry::define_enum_guc(
        c"feature_outbox.envelope",
        c"How the relay sends events: native (the event JSON and this project's headers) or cloudevents (binary-mode CloudEvents 1.0).",
        c"Superuser-settable, so that it can differ per database; the relay reads it when it connects and on reload.",
        &ENVELOPE,
        GucContext::Suset,
        GucFlags::default(),
    );
    // The writer's trace: SET LOCAL in the editing transaction; every outbox row records the value
    // in effect (the columns' defaults). Not in postgresql.conf: a trace belongs to one request.
    let trace_flags = GucFlags::DISALLOW_IN_FILE | GucFlags::DISALLOW_IN_AUTO_FILE;
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.traceparent",
            c"W3C traceparent of the edits that follow (00-<trace-id>-<parent-id>-<flags>); empty for none.",
            c"Set it with SET LOCAL from the application's current span; the relay sends it with each event.",
            &TRACEPARENT,
            GucContext::Userset,
            trace_flags,
            Some(check_traceparent),
            None,
            None,
        );
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.tracestate",
            c"W3C tracestate that goes with feature_outbox.traceparent; empty for none.",
            c"Recorded only for an edit that has a traceparent.",
            &TRACESTATE,
            GucContext::Userset,
            trace_flags,
            Some(check_tracestate),
            None,
            None,
        );
    }

    GucRegistry::define_bool_guc(
        c"feature_outbox.ddl_guard",
        c"Whether DDL that would break a registered layer (DROP TABLE, DROP/RENAME/ALTER TYPE of a registered column) is refused.",
        c"Superusers may turn it off for a session, for pg_restore --clean and repairs.",
        &DDL_GUARD,
        GucContext::Suset,
        GucFlags::default(),
    );

    GucRegistry::define_bool_guc(
        c"feature_outbox.wake_at_commit",
        c"Whether a committing edit wakes the relay worker that owns its feature at once.",
        c"Off: workers find new rows at their poll interval.",
        &WAKE_AT_COMMIT,
        GucContext::Sighup,
        GucFlags::default(),
    );

    // The two settings read only by the postmaster are Postmaster-context when preloading, the only
    // time PostgreSQL allows that. A backend that loads the library later (CREATE EXTENSION without
    // preloading, or LOAD) defines them at reload level instead, where no worker reads them: they
    // must still exist there, or the reserved prefix below would drop them from postgresql.conf as
    // unknown names.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    let startup = || if preloading { GucContext::Postmaster } else { GucContext::Sighup };
    GucRegistry::define_int_guc(
        c"feature_outbox.relay_workers",
        c"Relay background workers per served database (0-32). Each counts against max_worker_processes.",
        c"0 starts no relay.",
        &RELAY_WORKERS,
        0,
        32,
        startup(),
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"feature_outbox.database",
        c"Databases whose outboxes the relay publishes: * (every one that has the extension), one name, or a comma-separated list.",
        c"Templates and databases that allow no connections are never served.",
        &DATABASE,
        startup(),
        GucFlags::default(),
    );
    let sighup = |name: &'static CStr, short: &'static CStr, setting: &'static GucSetting<i32>, min: i32, max: i32, flags: GucFlags| {
        GucRegistry::define_int_guc(name, short, c"", setting, min, max, GucContext::Sighup, flags)
    };
    sighup(c"feature_outbox.batch_size", c"Outbox rows a relay worker claims per transaction.", &BATCH_SIZE, 1, 10_000, GucFlags::default());
    sighup(c"feature_outbox.poll_interval", c"Fallback poll interval of an idle relay worker; commits wake it sooner.", &POLL_INTERVAL_MS, 10, 3_600_000, GucFlags::UNIT_MS);
    sighup(c"feature_outbox.retention", c"Published outbox rows older than this are deleted; 0 keeps them.", &RETENTION_S, 0, i32::MAX, GucFlags::UNIT_S);
    sighup(c"feature_outbox.publish_timeout", c"Timeout of one publish (HTTP request or NATS PubAck).", &PUBLISH_TIMEOUT_MS, 1, 3_600_000, GucFlags::UNIT_MS);
    sighup(c"feature_outbox.max_attempts", c"Row-level failures after which a row is parked; 0 never parks.", &MAX_ATTEMPTS, 0, i32::MAX, GucFlags::default());
    sighup(c"feature_outbox.retry_backoff_min", c"Floor of the relay's exponential retry backoff.", &RETRY_BACKOFF_MIN_MS, 1, 86_400_000, GucFlags::UNIT_MS);
    sighup(c"feature_outbox.retry_backoff_max", c"Cap of the relay's exponential retry backoff (also caps Retry-After).", &RETRY_BACKOFF_MAX_MS, 1, 86_400_000, GucFlags::UNIT_MS);
    sighup(c"feature_outbox.nats_duplicate_window", c"JetStream duplicate window of the stream the relay creates.", &NATS_DUPLICATE_WINDOW_S, 1, 7 * 86_400, GucFlags::UNIT_S);
    sighup(c"feature_outbox.nats_replicas", c"Replicas of the JetStream stream the relay creates.", &NATS_REPLICAS, 1, 5, GucFlags::default());
    sighup(c"feature_outbox.nats_max_age", c"Max age of messages in the JetStream stream (and object bucket) the relay creates; at least nats_duplicate_window, 0 keeps them forever.", &NATS_MAX_AGE_S, 0, i32::MAX, GucFlags::UNIT_S);
    sighup(c"feature_outbox.http_concurrency", c"Webhook requests a relay worker keeps in flight, over as many keep-alive connections.", &HTTP_CONCURRENCY, 1, 256, GucFlags::default());
    sighup(c"feature_outbox.http_batch", c"Events per webhook request; above 1 the body is a JSON array (CloudEvents batch format under the cloudevents envelope).", &HTTP_BATCH, 1, 10_000, GucFlags::default());
    sighup(c"feature_outbox.kafka_partitions", c"Partitions of each Kafka topic the relay creates.", &KAFKA_PARTITIONS, 1, 100_000, GucFlags::default());
    sighup(c"feature_outbox.kafka_replication_factor", c"Replication factor of each Kafka topic the relay creates; -1 takes the broker's default.", &KAFKA_REPLICATION_FACTOR, -1, 100, GucFlags::default());
    standby_gate();
    sighup(c"feature_outbox.http_max_body", c"Largest webhook body; a larger event is parked at once.", &HTTP_MAX_BODY_KB, 1, 1024 * 1024, GucFlags::UNIT_KB);
    // The sink settings are superuser-settable (Suset), so that ALTER DATABASE ... SET can give each
    // database its own; the relay workers read them when they connect and on reload.
    let per_database = |name: &'static CStr, short: &'static CStr, setting: &'static GucSetting<Option<CString>>| {
        GucRegistry::define_string_guc(name, short, c"Superuser-settable, also per database.", setting, GucContext::Suset, GucFlags::default())
    };
    // A file holding a secret (credentials, a password, a signing key): superuser-settable, also per
    // database, its path shown to superusers only; the relay reads the file, SQL never shows it.
    let secret_file = |name: &'static CStr, short: &'static CStr, long: &'static CStr, setting: &'static GucSetting<Option<CString>>| unsafe {
        GucRegistry::define_string_guc_with_hooks(name, short, long, setting, GucContext::Suset, GucFlags::SUPERUSER_ONLY, None, None, None)
    };
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.endpoint",
            c"Sink URL: nats://, tls:// (NATS JetStream), http://, https:// (webhook) or kafka://host:port[,host:port...].",
            c"Credentials in the URL are shown to superusers only, and refused per database or role.",
            &ENDPOINT,
            GucContext::Suset,
            GucFlags::SUPERUSER_ONLY,
            Some(check_endpoint),
            None,
            Some(show_endpoint),
        );
    }
    per_database(c"feature_outbox.tls_ca_file", c"PEM file of a private CA: added to the system roots for NATS, replaces the built-in roots for HTTPS.", &TLS_CA_FILE);
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.nats_subject_prefix",
            c"First subject tokens: <prefix>.<layer>.<event_type>.<parent cells>.<routing_key>.",
            c"One or more dot-separated tokens without whitespace, control characters, * or >.",
            &NATS_SUBJECT_PREFIX,
            GucContext::Suset,
            GucFlags::default(),
            Some(check_prefix),
            None,
            None,
        );
        secret_file(c"feature_outbox.nats_credentials_file", c"A NATS .creds file (user JWT and NKey seed), as NGS, Synadia Cloud and operator mode hand them out.", c"Read by the relay workers; only the postgres OS user needs to read the file. SQL never shows its content.", &NATS_CREDENTIALS_FILE);
        secret_file(c"feature_outbox.nats_nkey_file", c"A file holding a NATS user NKey seed (SU...), for servers that authenticate by nkey.", c"Read by the relay workers; SQL never shows its content.", &NATS_NKEY_FILE);
    }
    GucRegistry::define_enum_guc(
        c"feature_outbox.subject_format",
        c"NATS subject layout: 0.2 is <prefix>.<layer>.<event_type>.<routing_key>; 0.1 keeps <prefix>.<event_type>.<routing_key> for the built-in layer.",
        c"0.1 is for subscribers that have not moved to the 0.2.0 subjects yet; user layers always use 0.2.",
        &SUBJECT_FORMAT,
        GucContext::Sighup,
        GucFlags::default(),
    );
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.subject_resolutions",
            c"H3 resolutions whose parent cells go into each NATS subject before the routing key, e.g. 3,5,7.",
            c"Strictly ascending integers 0-15, comma-separated; empty for none. Only levels coarser than a key's own are used.",
            &SUBJECT_RESOLUTIONS,
            GucContext::Sighup,
            GucFlags::default(),
            Some(check_resolutions),
            None,
            None,
        );
    }
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.kafka_topic",
            c"One Kafka topic for every layer (keys then <layer>/<id>); empty: a topic per layer, <prefix>.<layer>.",
            c"Superuser-settable, also per database. Kafka's topic names: 1 to 249 letters, digits, ., _ and -; not . or ..",
            &KAFKA_TOPIC,
            GucContext::Suset,
            GucFlags::default(),
            Some(check_kafka_topic),
            None,
            None,
        );
    }
    GucRegistry::define_enum_guc(
        c"feature_outbox.kafka_security_protocol",
        c"How the relay reaches Kafka brokers: plaintext, ssl, sasl_plaintext or sasl_ssl (Kafka's security.protocol).",
        c"ssl and sasl_ssl verify the brokers against the system roots, or feature_outbox.tls_ca_file's CA.",
        &KAFKA_SECURITY_PROTOCOL,
        GucContext::Suset,
        GucFlags::default(),
    );
    GucRegistry::define_enum_guc(
        c"feature_outbox.kafka_sasl_mechanism",
        c"SASL mechanism under sasl_plaintext or sasl_ssl: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.",
        c"Superuser-settable, also per database.",
        &KAFKA_SASL_MECHANISM,
        GucContext::Suset,
        GucFlags::default(),
    );
    per_database(c"feature_outbox.kafka_sasl_username", c"SASL user name under sasl_plaintext or sasl_ssl.", &KAFKA_SASL_USERNAME);
    secret_file(c"feature_outbox.cache_secret_file", c"A file holding the secret an expire output's cache purges carry (Authorization: Bearer <secret>).", c"Read by the relay workers at each purge; SQL never shows its content.", &CACHE_SECRET_FILE);
    secret_file(c"feature_outbox.kafka_sasl_password_file", c"A file holding the SASL password (one line) under sasl_plaintext or sasl_ssl.", c"Read by the relay workers when they connect; SQL never shows its content.", &KAFKA_SASL_PASSWORD_FILE);
    per_database(c"feature_outbox.nats_stream", c"JetStream stream over <prefix>.>, created when missing.", &NATS_STREAM);
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.nats_object_bucket",
            c"JetStream Object Store bucket for geometries of events over the server's max_payload.",
            c"Letters, digits, - and _ (the NATS rule for bucket names).",
            &NATS_OBJECT_BUCKET,
            GucContext::Suset,
            GucFlags::default(),
            Some(check_bucket),
            None,
            None,
        );
    }
    unsafe {
        GucRegistry::define_string_guc_with_hooks(
            c"feature_outbox.http_secret",
            c"Standard Webhooks signing secret (whsec_<base64>); shown to superusers only.",
            c"Not per database or role: pg_db_role_setting is readable by every role. Use http_secret_file there.",
            &HTTP_SECRET,
            GucContext::Suset,
            GucFlags::SUPERUSER_ONLY,
            Some(check_secret),
            None,
            Some(show_secret),
        );
        secret_file(c"feature_outbox.http_secret_file", c"A file holding the Standard Webhooks signing secret (whsec_<base64>); used instead of http_secret when set.", c"Read by the relay workers when they connect to the sink; SQL never shows its content. Can be set per database.", &HTTP_SECRET_FILE);
    }
    reserve_prefix();
}

/// Reserves `feature_outbox.` for the settings defined above (PostgreSQL 15+): an unknown name under
/// it, such as a typo in postgresql.conf, is warned about and removed now, and a later `SET`,
/// `ALTER DATABASE ... SET` or `ALTER ROLE ... SET` of one fails with 42602 (`ALTER SYSTEM`: 42704
/// on 15, 42602 later) instead of creating a placeholder that nothing reads. Before 15 only the
/// warning exists (EmitWarningsOnPlaceholders).
fn reserve_prefix() {
    #[cfg(any(feature = "pg13", feature = "pg14"))]
    unsafe {
        pg_sys::EmitWarningsOnPlaceholders(c"feature_outbox".as_ptr())
    };
    #[cfg(not(any(feature = "pg13", feature = "pg14")))]
    unsafe {
        pg_sys::MarkGUCPrefixReserved(c"feature_outbox".as_ptr())
    };
}

/// Parses feature_outbox.subject_resolutions: strictly ascending integers in 0–15, comma-separated,
/// spaces allowed; the empty string is the empty list.
pub fn parse_resolutions(value: &str) -> Result<Vec<u8>, String> {
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut list: Vec<u8> = Vec::new();
    for part in value.split(',') {
        let r = part.trim().parse::<u8>().ok().filter(|r| *r <= 15).ok_or_else(|| format!("\"{}\" is not an H3 resolution (0-15).", part.trim()))?;
        if list.last().is_some_and(|last| *last >= r) {
            return Err(format!("Resolutions must be strictly ascending; {r} follows {}.", list.last().copied().unwrap_or_default()));
        }
        list.push(r);
    }
    Ok(list)
}

/// The subject resolutions now in effect (validated when set).
pub fn subject_resolutions() -> Vec<u8> {
    parse_resolutions(&string(&SUBJECT_RESOLUTIONS)).unwrap_or_default()
}

/// A string GUC's check hook around `check`: true when the new value passes, else false with
/// `check`'s explanation as the DETAIL of the 22023 error PostgreSQL raises. A value that is not
/// UTF-8 is checked as DEL, which none of the checks accept.
unsafe fn check_string(newval: *mut *mut std::ffi::c_char, check: impl FnOnce(&str) -> Result<(), String>) -> bool {
    let value = unsafe { if newval.is_null() || (*newval).is_null() { "" } else { CStr::from_ptr(*newval).to_str().unwrap_or("\u{7f}") } };
    let Err(detail) = check(value) else { return true };
    let detail = CString::new(detail).unwrap_or_default();
    unsafe { pg_sys::GUC_check_errdetail_string = pg_sys::pstrdup(detail.as_ptr()) };
    false
}

/// The standby gate's settings (relay/standby_gate.rs), reload-level: one value for the server,
/// set once for every member of an HA cluster (Patroni's dynamic configuration).
fn standby_gate() {
    // No check hook: a value rejected in postgresql.conf (where Patroni writes its parameters)
    // would fall back to the default, no gate, with a WARNING alone. Any value is taken, and one
    // that is no list of slot names holds publishing and says why (standby_gate.rs).
    GucRegistry::define_string_guc(
        c"feature_outbox.standby_slots",
        c"Physical replication slots whose standbys must confirm a batch's WAL before the relay publishes it; empty for none.",
        c"Comma-separated slot names, as synchronized_standby_slots. Editors never wait; a missing, logical or invalidated slot, or a value that is no list of slot names, is waited for and reported.",
        &STANDBY_SLOTS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"feature_outbox.wait_for_synchronous_standbys",
        c"Whether the relay publishes a batch only after the synchronous standbys of synchronous_standby_names flushed its WAL.",
        c"For Patroni's synchronous_mode with synchronous_commit = local: the relay waits, editors do not.",
        &WAIT_FOR_SYNCHRONOUS_STANDBYS,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"feature_outbox.standby_wait_timeout",
        c"How long a batch waits for standbys before it is published unconfirmed, with a WARNING; 0 waits as long as it takes.",
        c"",
        &STANDBY_WAIT_TIMEOUT_MS,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
}

/// Refuses a resolution list that is not strictly ascending 0–15 when it is set (22023).
#[pg_guard]
unsafe extern "C-unwind" fn check_resolutions(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe { check_string(newval, |v| parse_resolutions(v).map(|_| ())) }
}

/// Refuses a malformed traceparent when it is set (22023, with what is wrong).
#[pg_guard]
unsafe extern "C-unwind" fn check_traceparent(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe { check_string(newval, crate::trace_context::check_traceparent) }
}

/// Refuses a malformed tracestate when it is set (22023, with what is wrong).
#[pg_guard]
unsafe extern "C-unwind" fn check_tracestate(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe { check_string(newval, crate::trace_context::check_tracestate) }
}

/// A subject prefix: one or more dot-separated tokens, none empty, without whitespace, control
/// characters or the wildcards `*` and `>` (NATS docs, "Subject-Based Messaging").
pub fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.split('.').all(|t| !t.is_empty() && !t.chars().any(|c| c.is_whitespace() || c.is_control() || c == '*' || c == '>'))
}

/// Refuses a prefix that would make every subject invalid, when it is set (22023).
#[pg_guard]
unsafe extern "C-unwind" fn check_prefix(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe {
        check_string(newval, |v| {
            valid_prefix(v)
                .then_some(())
                .ok_or_else(|| "A subject prefix is one or more dot-separated tokens without whitespace, control characters, * or >.".into())
        })
    }
}

/// A JetStream bucket name, as NATS requires: one or more of A-Z, a-z, 0-9, - and _.
pub fn valid_bucket(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Refuses a bucket name NATS would refuse, when it is set (22023) rather than at the first large event.
#[pg_guard]
unsafe extern "C-unwind" fn check_bucket(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe {
        check_string(newval, |v| {
            valid_bucket(v).then_some(()).ok_or_else(|| "A bucket name is one or more letters, digits, - or _ (no dots, spaces or $).".into())
        })
    }
}

/// Refuses a topic name Kafka would refuse (22023), so that a typo shows when it is set, not as a
/// sink that stays down.
#[pg_guard]
unsafe extern "C-unwind" fn check_kafka_topic(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, _source: pg_sys::GucSource::Type) -> bool {
    unsafe {
        check_string(newval, |v| {
            (v.is_empty() || valid_kafka_topic(v))
                .then_some(())
                .ok_or_else(|| "A Kafka topic name is 1 to 249 letters, digits, ., _ and -, and not . or .. (Kafka's Topic.validate).".into())
        })
    }
}

/// Kafka's topic name rule (org.apache.kafka.common.internals.Topic.validate).
pub fn valid_kafka_topic(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// True for a value about to be stored in, or read from, pg_db_role_setting (ALTER DATABASE/ROLE ...
/// SET, checked with source PGC_S_TEST) or a function's SET clause, which every role can read.
fn stored_per_database(source: pg_sys::GucSource::Type) -> bool {
    use pg_sys::GucSource::*;
    matches!(source, PGC_S_TEST | PGC_S_GLOBAL | PGC_S_DATABASE | PGC_S_USER | PGC_S_DATABASE_USER)
}

/// True when one of the comma-separated URLs carries user-info (user:password@ or token@).
pub fn has_credentials(urls: &str) -> bool {
    // Only the authority (between :// and the first /, ? or #) holds userinfo (RFC 3986, 3.2).
    urls.split(',').any(|url| {
        let after = url.find("://").map_or(url, |s| &url[s + 3..]);
        let authority = after.split(['/', '?', '#']).next().unwrap_or_default();
        authority.contains('@')
    })
}

/// Refuses an endpoint with credentials in it per database or role (22023): every role can read
/// pg_db_role_setting.
#[pg_guard]
unsafe extern "C-unwind" fn check_endpoint(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, source: pg_sys::GucSource::Type) -> bool {
    unsafe {
        check_string(newval, |v| {
            if stored_per_database(source) && has_credentials(v) {
                return Err("Per database or role, feature_outbox.endpoint must not carry credentials: pg_db_role_setting is readable by every role. \
                            Use feature_outbox.nats_credentials_file or nats_nkey_file (NATS), kafka_sasl_password_file (Kafka), \
                            or set the endpoint in postgresql.conf."
                    .into());
            }
            Ok(())
        })
    }
}

/// Refuses the webhook secret per database or role (22023): use http_secret_file there.
#[pg_guard]
unsafe extern "C-unwind" fn check_secret(newval: *mut *mut std::ffi::c_char, _extra: *mut *mut std::ffi::c_void, source: pg_sys::GucSource::Type) -> bool {
    unsafe {
        check_string(newval, |v| {
            if stored_per_database(source) && !v.is_empty() {
                return Err("feature_outbox.http_secret cannot be set per database or role: pg_db_role_setting is readable by every role. \
                            Use feature_outbox.http_secret_file there."
                    .into());
            }
            Ok(())
        })
    }
}

/// Masks `http_secret` for everyone but superusers, including pg_read_all_settings members.
#[pg_guard]
unsafe extern "C-unwind" fn show_secret() -> *const std::ffi::c_char {
    unsafe {
        match HTTP_SECRET.get() {
            None => c"".as_ptr(),
            Some(_) if !pg_sys::superuser() => c"********".as_ptr(),
            Some(_) => {
                // The GUC machinery owns the current value; return its pointer unchanged.
                let ptr = *HTTP_SECRET.as_ptr();
                if ptr.is_null() { c"".as_ptr() } else { ptr }
            }
        }
    }
}

thread_local! {
    static SHOWN_ENDPOINT: std::cell::RefCell<CString> = std::cell::RefCell::new(CString::default());
}

/// Shows the endpoint with the credentials of each URL masked, except to superusers.
#[pg_guard]
unsafe extern "C-unwind" fn show_endpoint() -> *const std::ffi::c_char {
    let value = string(&ENDPOINT);
    let shown = if unsafe { pg_sys::superuser() } { value } else { redact_urls(&value) };
    // Postgres copies the returned string before the next call, so one buffer per backend suffices.
    SHOWN_ENDPOINT.with(|b| {
        *b.borrow_mut() = CString::new(shown).unwrap_or_default();
        b.borrow().as_ptr()
    })
}

/// Replaces the user-info part of each comma-separated URL with `********`.
pub fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(|url| match (url.find("://"), url.rfind('@')) {
            (Some(s), Some(at)) if at > s => format!("{}://********@{}", &url[..s], &url[at + 1..]),
            _ => url.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The value of a string GUC as an owned Rust string (empty when unset).
pub fn string(setting: &GucSetting<Option<CString>>) -> String {
    setting.get().map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

pub fn millis(setting: &GucSetting<i32>) -> Duration {
    Duration::from_millis(setting.get().max(0) as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn kafka_topic_names_follow_kafkas_rule() {
        assert!(super::valid_kafka_topic("features.parcels") && super::valid_kafka_topic("all-edits_v2"));
        for bad in ["", ".", "..", "bad topic!", "a/b", &"x".repeat(250)] {
            assert!(!super::valid_kafka_topic(bad), "{bad}");
        }
    }

    #[test]
    fn bucket_names_follow_the_nats_rule() {
        assert!(super::valid_bucket("FEATURES_GEOMETRY") && super::valid_bucket("geo-2"));
        for bad in ["", "a.b", "x y", "$O", "a>"] {
            assert!(!super::valid_bucket(bad), "{bad:?}");
        }
    }

    #[test]
    fn subject_prefixes_are_tokens() {
        assert!(super::valid_prefix("features") && super::valid_prefix("acme.features"));
        for bad in ["", "a..b", ".a", "a.", "a b", "a\r\nb", "a.*", "a.>", "x>y", "\t"] {
            assert!(!super::valid_prefix(bad), "{bad:?}");
        }
    }

    #[test]
    fn subject_resolutions_are_strictly_ascending_0_to_15() {
        assert_eq!(super::parse_resolutions("3,5,7"), Ok(vec![3, 5, 7]));
        assert_eq!(super::parse_resolutions(" 0, 15 "), Ok(vec![0, 15]));
        assert_eq!(super::parse_resolutions(""), Ok(vec![]));
        for bad in ["5,3", "3,3", "16", "-1", "3,,5", "a", "3;5"] {
            assert!(super::parse_resolutions(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn credentials_in_any_url_are_found() {
        assert!(super::has_credentials("nats://a:4222,nats://u:p@b:4222"));
        assert!(super::has_credentials("https://tok@h/hook"));
        assert!(!super::has_credentials("nats://a:4222,nats://b:4222"));
        assert!(!super::has_credentials("https://h/hook?owner=a@b.org"), "an @ in the query is no userinfo");
        assert!(!super::has_credentials("https://h/@team/hook"));
    }

    #[test]
    fn credentials_are_redacted_from_every_url() {
        assert_eq!(
            super::redact_urls("nats://relay:s3cret@a:4222, tls://tok@b:4222,nats://c:4222"),
            "nats://********@a:4222, tls://********@b:4222,nats://c:4222"
        );
        assert_eq!(super::redact_urls("https://u:p@h/hook"), "https://********@h/hook");
    }
}
