//! Sends one batch to the sink, a feature's rows in id order: round k sends the k-th row of each
//! feature in the batch, and only when its feature's row of round k - 1 was delivered.

use std::collections::{HashMap, HashSet};

use super::pipeline::{Ahead, Batch, rounds};
use crate::event::Row;
use crate::sinks::{Outcome, Sink};

/// Publishes the rows of `batch` whose events were built. A row whose event could not be built
/// fails alone and never blocks other features; its feature's later rows wait (NotTried).
/// `meanwhile` runs once, while round 0 is in flight: on JetStream while its PubAcks come back, on
/// HTTP while its requests are out. The rows sent `ahead` (taken out of the batch) take their
/// outcomes from the transaction before's sending.
pub fn publish(sink: &mut dyn Sink, batch: &Batch, ahead: Option<Ahead>, meanwhile: impl FnOnce()) -> Vec<Outcome> {
    let (rows, events) = (&batch.rows, &batch.events);
    let round = rounds(rows);
    let mut meanwhile = Some(meanwhile);
    let mut once = move || {
        if let Some(f) = meanwhile.take() {
            f()
        }
    };
    // Rows sent ahead: their outcomes come after `meanwhile`, from the transaction before's sending.
    let mut ahead_outcomes: HashMap<i64, Outcome> = HashMap::new();
    if let Some(Ahead { ids, in_flight }) = ahead {
        once();
        ahead_outcomes = ids.into_iter().zip(in_flight.outcomes()).collect();
    }
    let mut outcomes: Vec<Option<Outcome>> = vec![None; rows.len()];
    let mut blocked: HashSet<(&str, i64)> = HashSet::new();
    for k in 0..=round.iter().copied().max().unwrap_or(0) {
        let (mut send, mut bodies) = (Vec::new(), Vec::new());
        for (i, row) in rows.iter().enumerate().filter(|(i, _)| round[*i] == k) {
            if blocked.contains(&(row.layer.as_str(), row.feature_id)) {
                outcomes[i] = Some(Outcome::NotTried);
                continue;
            }
            if let Some(outcome) = ahead_outcomes.remove(&row.id) {
                outcomes[i] = Some(outcome);
                continue;
            }
            match &events[i] {
                Ok(body) => {
                    send.push(i);
                    bodies.push(body.as_slice());
                }
                Err(error) => outcomes[i] = Some(Outcome::RowFailed(error.clone())),
            }
        }
        if !send.is_empty() {
            // Usually round 0 is the whole batch: one call, no copies.
            let subset: Vec<Row>;
            let sent_rows = if send.len() == rows.len() {
                rows
            } else {
                subset = send.iter().map(|&i| rows[i].clone()).collect();
                &subset
            };
            let sent = sink.send(sent_rows, &bodies, &batch.relayed_at, &mut once);
            for (&i, outcome) in send.iter().zip(sent) {
                outcomes[i] = Some(outcome);
            }
        }
        for (i, row) in rows.iter().enumerate().filter(|(i, _)| round[*i] == k) {
            if !matches!(outcomes[i], Some(Outcome::Delivered { .. })) {
                blocked.insert((row.layer.as_str(), row.feature_id));
            }
        }
    }
    outcomes.into_iter().map(|o| o.unwrap_or(Outcome::NotTried)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::tests::row;

    /// Records each call's row ids; refuses (row-level) the ids in `refuse`.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<Vec<i64>>,
        refuse: Vec<i64>,
    }

    impl Sink for Recorder {
        fn send(&mut self, rows: &[Row], _bodies: &[&[u8]], _relayed_at: &str, meanwhile: &mut dyn FnMut()) -> Vec<Outcome> {
            meanwhile();
            self.calls.push(rows.iter().map(|r| r.id).collect());
            rows.iter()
                .map(|r| if self.refuse.contains(&r.id) { Outcome::RowFailed("422".into()) } else { Outcome::Delivered { duplicate: false } })
                .collect()
        }
    }

    fn batch(spec: &[(i64, i64)]) -> Batch {
        let rows: Vec<Row> = spec.iter().map(|&(id, feature_id)| Row { id, feature_id, ..row() }).collect();
        let events = rows.iter().map(|r| Ok(r.id.to_string().into_bytes())).collect();
        Batch { rows, events, relayed_at: "t".into(), ahead: None }
    }

    #[test]
    fn a_features_second_row_goes_only_after_its_first_was_delivered() {
        let mut sink = Recorder { refuse: vec![3], ..Default::default() };
        let b = batch(&[(1, 1), (2, 2), (3, 3), (4, 1), (5, 3), (6, 1)]);
        let mut ran = 0;
        let outcomes = publish(&mut sink, &b, None, || ran += 1);
        assert_eq!(ran, 1, "meanwhile runs once");
        assert_eq!(sink.calls, [vec![1, 2, 3], vec![4], vec![6]]);
        assert!(matches!(outcomes[2], Outcome::RowFailed(_)));
        assert_eq!(outcomes[4], Outcome::NotTried, "row 5 waits behind the refused row 3");
        assert_eq!(outcomes.iter().filter(|o| matches!(o, Outcome::Delivered { .. })).count(), 4);
    }

    #[test]
    fn a_row_whose_event_was_not_built_fails_alone_and_holds_back_its_feature() {
        let mut sink = Recorder::default();
        let mut b = batch(&[(1, 1), (2, 2), (3, 1)]);
        b.events[0] = Err("cannot build the event".into());
        let outcomes = publish(&mut sink, &b, None, || {});
        assert_eq!(sink.calls, [vec![2]]);
        assert_eq!(outcomes[0], Outcome::RowFailed("cannot build the event".into()));
        assert_eq!(outcomes[2], Outcome::NotTried);
    }

    #[test]
    fn rows_sent_ahead_take_their_outcomes_from_the_sending_before() {
        let mut sink = Recorder::default();
        let b = batch(&[(1, 1), (2, 2), (3, 1)]);
        let acks = vec![Outcome::Delivered { duplicate: true }, Outcome::SinkFailed { error: "no PubAck".into(), retry_after: None }];
        let ahead = Some(Ahead { ids: vec![1, 2], in_flight: crate::sinks::InFlight::new(move || acks) });
        let mut ran = false;
        let outcomes = publish(&mut sink, &b, ahead, || ran = true);
        assert!(ran);
        assert_eq!(sink.calls, [vec![3]], "only row 3, behind the delivered row 1, is sent now");
        assert_eq!(outcomes[0], Outcome::Delivered { duplicate: true });
        assert!(matches!(outcomes[1], Outcome::SinkFailed { .. }));
    }
}
