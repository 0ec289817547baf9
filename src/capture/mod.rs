//! Capture of writes made outside edit_feature and record_edit (sql/capture.sql): one background
//! worker per database with a captured layer, started by the launcher. Each round it reads a chunk
//! of the logical slot (pgoutput, never consumed by the read), writes the missing events in its
//! own transactions under its replication origin, then advances the slot. A crash between the
//! two re-reads the chunk: the origin's position skips what was written, and an event is only
//! ever written for a row that differs from its feature's last event, so nothing is written twice.
//!
//! - worker.rs: the loop, its rounds and their steps; classify.rs: decoded changes → rows to look
//!   at (pure); pgoutput.rs: the protocol's messages (pure); slot.rs: the slot, origin and
//!   publications through SQL; status.rs: what the capture view shows.

pub mod classify;
pub mod pgoutput;
pub mod slot;
pub mod status;
mod worker;
