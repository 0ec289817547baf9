//! Test and benchmark builds only (`discard://`): acknowledges every event without sending it, so
//! `make bench` can measure the worker's own claim and mark (the in-worker floor).

use super::{Outcome, Sink};
use crate::event::Row;

pub struct Discard;

impl Sink for Discard {
    fn send(&mut self, rows: &[Row], _bodies: &[&[u8]], _relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
        meanwhile();
        rows.iter().map(|_| Outcome::Delivered { duplicate: false }).collect()
    }
}
