//! NATS subjects of an event (README, "Subjects"). Pure Rust, no Postgres.
//!
//! `<prefix>.<layer>.<event_type>.<cell at r1>.<cell at r2>...<routing_key>`, where r1 < r2 < ... are
//! feature_outbox.subject_resolutions coarser than the key's own and each cell is the key's H3
//! parent. A subscriber takes an area with a wildcard per level above it:
//! `features.parcels.*.*.<res-5 cell>.>` is every event routed inside that res-5 cell.
//! A `moved` or `retired` event that left its previous cell is published a second time on
//! `<prefix>.<layer>.departed.<hierarchy of previous_routing_key>`, so that the area it left learns
//! of it by subject alone (the guide's gotcha 2).

use crate::event::Row;
use crate::routing;

/// The event type token of a departure notice.
pub const DEPARTED: &str = "departed";

/// The message id of an event's departure notice (its Nats-Msg-Id and CloudEvents `id`), so that
/// (source, id) stays unique beside the event's own.
pub fn departed_id(event_id: &str) -> String {
    format!("{event_id}:{DEPARTED}")
}

/// Where one row's event goes.
#[derive(Debug, PartialEq)]
pub struct Subjects {
    pub event: String,
    /// The departure notice's subject, for a move or retirement out of the previous cell.
    pub departed: Option<String>,
}

/// The subjects of `row`'s event. `legacy` (feature_outbox.subject_format = '0.1') keeps the
/// built-in layer's 0.1.0 subject, `<prefix>.<event_type>.<routing_key>`, without parent cells;
/// departure notices always use the 0.2.0 grammar. An error (a routing key that is no H3 cell, a
/// token that would break the subject) concerns this row only.
pub fn of(prefix: &str, legacy: bool, resolutions: &[u8], row: &Row) -> Result<Subjects, String> {
    let event = if legacy && row.layer == "features" {
        format!("{prefix}.{}.{}", row.event_type, row.routing_key)
    } else {
        join(prefix, &row.layer, &row.event_type, &routing::hierarchy(&row.routing_key, resolutions).map_err(|e| e.message)?)
    };
    let departed = match (&row.previous_routing_key, row.event_type.as_str()) {
        (Some(previous), "moved" | "retired") if *previous != row.routing_key => {
            Some(join(prefix, &row.layer, DEPARTED, &routing::hierarchy(previous, resolutions).map_err(|e| e.message)?))
        }
        _ => None,
    };
    for s in std::iter::once(&event).chain(departed.as_ref()) {
        if !valid(s) {
            return Err(format!("invalid NATS subject \"{s}\""));
        }
    }
    Ok(Subjects { event, departed })
}

fn join(prefix: &str, layer: &str, event_type: &str, cells: &[String]) -> String {
    format!("{prefix}.{layer}.{event_type}.{}", cells.join("."))
}

/// A publish subject: dot-separated non-empty tokens, no whitespace, no wildcards.
pub fn valid(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| !t.is_empty() && t != "*" && t != ">" && !t.chars().any(|c| c.is_whitespace()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(event_type: &str, key: &str, previous: Option<&str>) -> Row {
        let mut r = crate::event::tests::row();
        r.event_type = event_type.into();
        r.routing_key = key.into();
        r.previous_routing_key = previous.map(Into::into);
        r
    }

    #[test]
    fn subjects_carry_parent_cells_then_the_key() {
        let key = "881f1d4891fffff";
        let (r3, r5, r7) = (routing::parent(key, 3).unwrap(), routing::parent(key, 5).unwrap(), routing::parent(key, 7).unwrap());
        let s = of("features", false, &[3, 5, 7], &row("created", key, None)).unwrap();
        assert_eq!(s.event, format!("features.parcels.created.{r3}.{r5}.{r7}.{key}"));
        assert_eq!(s.departed, None);
        assert_eq!(of("features", false, &[], &row("updated", key, Some(key))).unwrap().event, format!("features.parcels.updated.{key}"));
    }

    #[test]
    fn a_move_out_of_its_cell_also_departs_the_previous_one() {
        let (key, previous) = ("881f1d4891fffff", "881fb46753fffff");
        let s = of("f", false, &[5], &row("moved", key, Some(previous))).unwrap();
        assert_eq!(s.departed, Some(format!("f.parcels.departed.{}.{previous}", routing::parent(previous, 5).unwrap())));
        assert!(of("f", false, &[5], &row("retired", key, Some(previous))).unwrap().departed.is_some());
        // Same cell, or an event type that does not move: no notice.
        assert_eq!(of("f", false, &[5], &row("moved", key, Some(key))).unwrap().departed, None);
        assert_eq!(of("f", false, &[5], &row("updated", key, Some(previous))).unwrap().departed, None);
        assert_eq!(of("f", false, &[5], &row("snapshot", key, None)).unwrap().departed, None);
    }

    #[test]
    fn legacy_subjects_stay_flat_for_the_built_in_layer_only() {
        let mut r = row("moved", "881f1d4891fffff", Some("881fb46753fffff"));
        r.layer = "features".into();
        let s = of("features", true, &[3], &r).unwrap();
        assert_eq!(s.event, "features.moved.881f1d4891fffff");
        assert!(s.departed.unwrap().starts_with("features.features.departed."));
        r.layer = "parcels".into();
        assert!(of("x", true, &[3], &r).unwrap().event.starts_with("x.parcels.moved."));
    }

    #[test]
    fn bad_tokens_fail_the_row() {
        assert!(of("features", false, &[3], &row("moved", "not-a-cell", None)).is_err());
        assert!(of("my features", false, &[3], &row("created", "881f1d4891fffff", None)).is_err());
        assert!(valid("features.moved.881f1d4891fffff"));
        assert!(!valid("features..x"));
        assert!(!valid("features.>"));
    }
}
