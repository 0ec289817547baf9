//! This database's logical slot, replication origin and publications, through PostgreSQL's SQL
//! functions: what the worker finds, the chunk it reads, how far it has written, and the drop once
//! no layer is captured. Each call runs inside the caller's transaction.

use std::collections::HashMap;

use pgrx::pg_sys;
use pgrx::prelude::*;

use super::classify::LayerTable;
use crate::relay::transaction::read_one;
use crate::relay_state::this_database;

/// The publications pgoutput reads (sql/capture.sql).
const PUBLICATIONS: &str = "feature_outbox_capture,feature_outbox_capture_edits";

/// The slot's and the origin's name: cluster-wide objects, so named after the database's OID.
pub fn name() -> String {
    format!("feature_outbox_capture_{}", this_database())
}

/// What the worker finds at the start of a round.
pub struct Look {
    /// The extension is installed here.
    pub extension: bool,
    /// Captured layers by table OID.
    pub layers: HashMap<u32, LayerTable>,
    pub outbox: u32,
    pub slot: SlotState,
    /// WAL from the slot's restart position to the flushed end: what each read decodes again.
    pub retained: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum SlotState {
    Missing,
    Ready,
    /// Invalidated (wal_status lost, max_slot_wal_keep_size): changes were lost.
    Lost,
}

pub fn look() -> Result<Look, pgrx::spi::Error> {
    Spi::connect(|client| {
        let extension = client
            .select("SELECT (SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'feature_outbox')", None, &[])?
            .first()
            .get_one::<String>()?;
        let mut look = Look { extension: extension.is_some(), layers: HashMap::new(), outbox: 0, slot: SlotState::Missing, retained: 0 };
        if !look.extension {
            return Ok(look);
        }
        let rows = client.select(
            "SELECT l.tbl::oid::bigint, l.layer, l.id_column::text FROM feature_outbox.layer_registry l WHERE l.captured_at IS NOT NULL",
            None,
            &[],
        )?;
        for row in rows {
            let (Some(oid), Some(layer), Some(id_column)) = (row.get::<i64>(1)?, row.get::<String>(2)?, row.get::<String>(3)?) else { continue };
            look.layers.insert(oid as u32, LayerTable { layer, id_column });
        }
        look.outbox = client
            .select("SELECT 'feature_outbox.outbox'::regclass::oid::bigint", None, &[])?
            .first()
            .get_one::<i64>()?
            .unwrap_or(0) as u32;
        let row = client
            .select(
                "SELECT coalesce(s.wal_status, ''), pg_catalog.pg_wal_lsn_diff(pg_catalog.pg_current_wal_flush_lsn(), s.restart_lsn)::bigint
                   FROM (SELECT 1) one LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name = $1",
                None,
                &[name().into()],
            )?
            .first()
            .get_two::<String, i64>()?;
        let (status, retained) = row;
        look.retained = retained.unwrap_or(0).max(0) as u64;
        look.slot = match status.as_deref() {
            None => SlotState::Missing,
            Some("lost") => SlotState::Lost,
            Some(_) => SlotState::Ready,
        };
        Ok(look)
    })
}

/// Where a read of the slot stops: the end of the last WAL record inserted so far, flushed first
/// when it was not (free when it was). PostgreSQL's read goes on to the flushed end, and a record
/// that crosses that end waits, inside PostgreSQL, until it is flushed: a record written
/// without a flush (an asynchronous commit, a page prune) that the WAL writer had flushed only up
/// to a page boundary held the read until some commit flushed it, and in a fast shutdown, which
/// stops every writer and the WAL writer first, forever: the server never stopped (CI, drill 21).
/// 0 during recovery, where there is no slot to read.
pub fn read_end() -> u64 {
    // SAFETY: plain calls into xlog.c; XLogFlush may raise an ERROR, which the caller's
    // transaction() catches.
    unsafe {
        if pg_sys::RecoveryInProgress() {
            return 0;
        }
        // The end, not the insert position: past a page's header XLogFlush refuses the request
        // (nothing is inserted there yet: "xlog flush request ... is not satisfied").
        let end = record_end(pg_sys::GetXLogInsertRecPtr(), pg_sys::wal_segment_size as u64);
        pg_sys::XLogFlush(end);
        end
    }
}

/// The end of the record that precedes a record starting at `start`. The same position, except
/// at the top of a page: GetXLogInsertRecPtr then points past the page's header, while the
/// record before ended at the page boundary; a read asked to go past it would wait for the next.
fn record_end(start: u64, segment: u64) -> u64 {
    const fn maxalign(n: usize) -> u64 {
        ((n + 7) & !7) as u64
    }
    let short = maxalign(std::mem::size_of::<pg_sys::XLogPageHeaderData>());
    let long = maxalign(std::mem::size_of::<pg_sys::XLogLongPageHeaderData>());
    if start % segment == long {
        start - long
    } else if start % pg_sys::XLOG_BLCKSZ as u64 == short {
        start - short
    } else {
        start
    }
}

/// Runs `read` with PostgreSQL's own SIGTERM handler, die(), in place of pgrx's, which only sets
/// a flag: a read waiting inside PostgreSQL (for WAL, or on 17 and later for the standbys in
/// synchronized_standby_slots) then ends at SIGTERM as a backend's query does, FATAL at its next
/// interrupt check, the slot where it was. pgrx's handler is back afterwards, also on an ERROR,
/// and a SIGTERM that came during a read that finished is raised again for it. None: SIGTERM came
/// before the read.
pub fn hearing_sigterm<R>(read: impl FnOnce() -> R) -> Option<R> {
    unsafe extern "C-unwind" {
        #[link_name = "die"]
        fn postgres_die(signal: std::ffi::c_int);
    }
    // Through sigaction, not pqsignal (pqsignal_be on 18, returning nothing): the action saved is
    // put back exactly. errno is kept here, as 17's and 18's wrapper around a handler keeps it.
    extern "C" fn on_sigterm(signal: std::ffi::c_int) {
        // SAFETY: errno is this thread's; die only sets flags and the latch.
        unsafe {
            let errno = *libc::__errno_location();
            postgres_die(signal);
            *libc::__errno_location() = errno;
        }
    }
    struct Restore(libc::sigaction);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the action saved below; ProcDiePending is a sig_atomic_t only
            // signal handlers and interrupt checks touch, and signals run on this thread.
            unsafe {
                libc::sigaction(libc::SIGTERM, &self.0, std::ptr::null_mut());
                if std::ptr::read_volatile(&raw const pg_sys::ProcDiePending) != 0 {
                    std::ptr::write_volatile(&raw mut pg_sys::ProcDiePending, 0);
                    libc::raise(libc::SIGTERM);
                }
            }
        }
    }
    // SAFETY: sigaction is plain data, zeroed then filled; the handler is async-signal-safe.
    let _restore = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigterm as *const () as libc::sighandler_t;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = libc::SA_RESTART;
        let mut saved: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGTERM, &action, &mut saved);
        Restore(saved)
    };
    if crate::relay::stopping() {
        return None;
    }
    Some(read())
}

/// pgoutput's messages of the transactions committed up to `upto`, at least `changes` rows of
/// them when there are so many (PostgreSQL stops only at a commit), without consuming them.
pub fn peek(upto: u64, changes: i32) -> Result<Vec<Vec<u8>>, pgrx::spi::Error> {
    crate::relay::fault_points::stall_capture_read_if_requested()?;
    quiet_decoding()?;
    Spi::connect(|client| {
        let rows = client.select(
            "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, $3,
                    'proto_version', '1', 'publication_names', $4)",
            None,
            &[name().into(), lsn_text(upto).into(), changes.into(), PUBLICATIONS.into()],
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            out.push(row.get::<Vec<u8>>(1)?.unwrap_or_default());
        }
        Ok(out)
    })
}

/// Marks every change up to `lsn` consumed. The slot then keeps no WAL before it.
pub fn advance(lsn: u64) -> Result<(), pgrx::spi::Error> {
    quiet_decoding()?;
    read_one::<String>(
        "SELECT pg_catalog.pg_replication_slot_advance($1, $2::pg_lsn)::text WHERE $2::pg_lsn > (SELECT s.confirmed_flush_lsn FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1)",
        &[name().into(), lsn_text(lsn).into()],
    )
    .map(drop)
}

/// The end of the commit record of the last transaction this process committed.
pub fn last_commit_end() -> u64 {
    unsafe { pg_sys::XactLastCommitEnd }
}

/// Whether the physical standbys named in `synchronized_standby_slots` have received WAL up to
/// `lsn` (PostgreSQL 17 and later; before 17 there are no failover slots, and this is true).
/// A standby syncs the failover slot only up to the WAL it has; the worker advances the slot once
/// its events' transaction is there too, or a standby promoted in between would hold the slot past
/// changes whose events it lacks and never write them. `elevel`: how a slot named there that is
/// missing or invalid is reported.
pub fn standbys_have(lsn: u64, elevel: u32) -> bool {
    #[cfg(any(feature = "pg17", feature = "pg18"))]
    {
        unsafe { pg_sys::StandbySlotsHaveCaughtup(lsn, elevel as i32) }
    }
    #[cfg(not(any(feature = "pg17", feature = "pg18")))]
    {
        let _ = (lsn, elevel);
        true
    }
}

/// Binds this process to the origin: every transaction it commits carries it, and pgoutput names
/// it in their Begin, so the worker's own writes are known when they are read back.
pub fn origin_session() -> Result<(), pgrx::spi::Error> {
    read_one::<String>("SELECT pg_catalog.pg_replication_origin_session_setup($1)::text", &[name().into()]).map(drop)
}

/// Where the worker had written up to when it last committed events: the end of the last decoded
/// transaction whose events committed. 0 before the first.
pub fn origin_progress() -> Result<u64, pgrx::spi::Error> {
    let lsn = read_one::<String>(
        "SELECT (coalesce(pg_catalog.pg_replication_origin_progress($1, true), '0/0') - '0/0'::pg_lsn)::text",
        &[name().into()],
    )?;
    Ok(lsn.and_then(|l| l.parse().ok()).unwrap_or(0))
}

/// Records, with this transaction's commit, that decoded transactions up to `lsn` are written.
pub fn origin_written(lsn: u64, commit_time_us: i64) -> Result<(), pgrx::spi::Error> {
    Spi::run_with_args(
        "SELECT pg_catalog.pg_replication_origin_xact_setup($1::pg_lsn, timestamptz '2000-01-01 00:00:00+00' + make_interval(secs => $2::float8 / 1e6))",
        &[lsn_text(lsn).into(), commit_time_us.into()],
    )
}

/// No layer is captured (any more), or the extension is gone: the slot and the origin go, so that
/// no WAL is kept for nothing, and with the extension its publications. Under capture_layer's
/// lock, looked at again under it: a capture_layer between the worker's look and this keeps them.
/// Returns false when a layer is captured after all.
pub fn drop_all(extension: bool) -> Result<bool, pgrx::spi::Error> {
    Spi::run(&format!("SELECT pg_catalog.pg_advisory_xact_lock({CAPTURE_LOCK})"))?;
    if extension && Spi::get_one::<bool>("SELECT EXISTS (SELECT 1 FROM feature_outbox.layer_registry l WHERE l.captured_at IS NOT NULL)")? == Some(true) {
        return Ok(false);
    }
    Spi::run_with_args(
        "SELECT pg_catalog.pg_drop_replication_slot(s.slot_name) FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1",
        &[name().into()],
    )?;
    Spi::run("SELECT pg_catalog.pg_replication_origin_session_reset() WHERE pg_catalog.pg_replication_origin_session_is_setup()")?;
    Spi::run_with_args(
        "SELECT pg_catalog.pg_replication_origin_drop($1) WHERE pg_catalog.pg_replication_origin_oid($1) IS NOT NULL",
        &[name().into()],
    )?;
    if !extension {
        Spi::run("DROP PUBLICATION IF EXISTS feature_outbox_capture, feature_outbox_capture_edits")?;
    }
    Ok(true)
}

/// The advisory lock (two int4 keys) capture_layer and uncapture_layer hold while they change
/// what is captured (sql/capture.sql).
const CAPTURE_LOCK: &str = "1179601241, 1129338964";

/// Writes a running-transactions record now, as the background writer does every 15 s. A read of
/// the slot decodes again from its restart position, which moves only at such a record: under a
/// heavy write load 15 s of WAL were decoded at every read (20 % of a core at 35 MB/s of WAL).
pub fn log_snapshot() {
    unsafe { pg_sys::LogStandbySnapshot() };
}

/// Each read or advance of the slot starts a decoding session, which PostgreSQL logs in four LOG
/// lines: ten a second would flood the server log. For this transaction only, the server logs
/// only FATAL and PANIC from here (LOG ranks above ERROR in log_min_messages); an error of the read
/// comes back to the worker, which logs it itself.
fn quiet_decoding() -> Result<(), pgrx::spi::Error> {
    read_one::<String>("SELECT pg_catalog.set_config('log_min_messages', 'fatal', true)", &[]).map(drop)
}

/// DROP EXTENSION with no capture worker to clean up after it (none running): the slot, the origin
/// and the publications go in the DROP's own transaction (the slot at once: PostgreSQL drops slots
/// outside transactions). Through the C functions, which ask for no privilege the extension's
/// owner may lack. A failure is a WARNING, in a subtransaction of its own: the DROP goes on.
pub fn drop_with_extension(database: u32) {
    let name = std::ffi::CString::new(format!("feature_outbox_capture_{database}")).expect("no NUL");
    let dropped = crate::subxact::run(|| unsafe {
        if !pg_sys::SearchNamedReplicationSlot(name.as_ptr(), true).is_null() {
            pg_sys::ReplicationSlotDrop(name.as_ptr(), true);
        }
        pg_sys::replorigin_drop_by_name(name.as_ptr(), true, true);
        Spi::run("DROP PUBLICATION IF EXISTS feature_outbox_capture, feature_outbox_capture_edits")
    });
    match dropped {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warning!("feature_outbox: capture's publications were not dropped: {e}"),
        Err(e) => warning!("feature_outbox: capture's slot {} was not dropped: {}", name.to_string_lossy(), e.message),
    }
}

/// `lsn` as PostgreSQL writes a pg_lsn.
fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

#[cfg(test)]
mod tests {
    #[test]
    fn lsn_text_is_pg_lsn_syntax() {
        assert_eq!(super::lsn_text(0), "0/0");
        assert_eq!(super::lsn_text(0x1_0000_00A8), "1/A8");
        assert_eq!(super::lsn_text(u64::MAX), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn record_end_steps_back_over_a_page_header_only() {
        let segment = 16 << 20;
        // Mid-page: the insert position is the previous record's end.
        assert_eq!(super::record_end(0x25F_7CE8, segment), 0x25F_7CE8);
        // Just past a page's short header (24 bytes): the previous record ended at the boundary.
        assert_eq!(super::record_end(0x3A9_E018, segment), 0x3A9_E000);
        // Just past a segment's long header (40 bytes).
        assert_eq!(super::record_end(0x400_0028, segment), 0x400_0000);
        // 40 bytes into a page that starts no segment is mid-page.
        assert_eq!(super::record_end(0x3A9_E028, segment), 0x3A9_E028);
    }
}
