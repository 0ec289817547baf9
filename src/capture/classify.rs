//! Which rows a decoded transaction changed, and which of those need an event: pure, on pgoutput's
//! messages (pgoutput.rs). A row change is skipped when the same transaction wrote the outbox row
//! of that feature after it (edit_feature or record_edit recorded it: the application's edit; a
//! plain write after the edit is looked at, or a move after an edit would go unannounced), and a whole
//! transaction is skipped when it carries the capture worker's own replication origin (its version
//! bumps). Which event a kept change becomes is decided later, against the feature's last event
//! (sql/capture.sql, __repair_row): a change decoded here only names the row.

use std::collections::{HashMap, HashSet};

use super::pgoutput::{Message, Relation, Tuple, Value};

/// A captured layer's table, as the worker read it from layer_registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerTable {
    pub layer: String,
    pub id_column: String,
}

/// What the classifier needs to know beyond the messages.
pub struct Tables {
    /// Captured layers by their table's OID (the registered table; a partition's changes arrive
    /// under its root, publish_via_partition_root).
    pub layers: HashMap<u32, LayerTable>,
    /// feature_outbox.outbox's OID.
    pub outbox: u32,
    /// The worker's own replication origin.
    pub own_origin: String,
}

/// One committed transaction's work.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Committed {
    /// The end of its commit record: a slot advanced to it has consumed the transaction.
    pub end_lsn: u64,
    pub commit_time_us: i64,
    /// Changed rows that need a look, by layer: keys (the id column's text), in first-change order,
    /// each once.
    pub rows: Vec<(String, Vec<String>)>,
    /// Layers whose table was truncated.
    pub truncated: Vec<String>,
    /// Row changes left to the application's own events.
    pub skipped: usize,
    /// (layer, key) of rows in `rows` written again after the application's edit of them in this
    /// transaction: only a move or a deletion gets an event of its own (the edit's event carries
    /// the row's properties as the relay reads them, but not its new routing key).
    pub after_edit: HashSet<(String, String)>,
}

/// Decodes a stream of messages into committed transactions.
#[derive(Default)]
pub struct Classifier {
    relations: HashMap<u32, Relation>,
    current: Option<Open>,
}

/// The transaction being read: its row changes so far, and the features its outbox rows name,
/// each with how many row changes came before its last outbox row (the changes that row covers).
#[derive(Default)]
struct Open {
    own: bool,
    changes: Vec<(String, String)>,
    recorded: HashMap<(String, String), usize>,
    truncated: Vec<String>,
}

impl Classifier {
    /// Feeds one message; returns the transaction a Commit ends, unless it was the worker's own or
    /// had nothing to look at. Errors name what the stream broke (a change outside a transaction,
    /// a relation never described): the chunk is read again.
    pub fn feed(&mut self, message: Message, tables: &Tables) -> Result<Option<Committed>, String> {
        match message {
            Message::Begin { .. } => {
                self.current = Some(Open::default());
            }
            Message::Origin { name, .. } => {
                if name == tables.own_origin {
                    self.open()?.own = true;
                }
            }
            Message::Relation(r) => {
                self.relations.insert(r.oid, r);
            }
            Message::Insert { relation, new } => {
                if relation == tables.outbox {
                    let recorded = self.outbox_feature(relation, &new)?;
                    let open = self.open()?;
                    let covered = open.changes.len();
                    open.recorded.extend(recorded.map(|feature| (feature, covered)));
                } else {
                    self.change(relation, &new, tables)?;
                }
            }
            Message::Update { relation, old, new } => {
                // A changed key: the old row is gone (a retired event), the new one is new.
                if let Some(old) = old {
                    self.change(relation, &old, tables)?;
                    // A key stored out of line and left unchanged is not sent in the new row
                    // ('u'); PostgreSQL sends the old key instead, which names the same row.
                    if self.unchanged_key(relation, &new, tables) {
                        return Ok(None);
                    }
                }
                self.change(relation, &new, tables)?;
            }
            Message::Delete { relation, old } => self.change(relation, &old, tables)?,
            Message::Truncate { relations, .. } => {
                let layers: Vec<String> = relations.iter().filter_map(|r| tables.layers.get(r)).map(|t| t.layer.clone()).collect();
                self.open()?.truncated.extend(layers);
            }
            Message::Commit { end_lsn, commit_time_us, .. } => {
                let open = self.current.take().ok_or("a commit outside a transaction")?;
                return Ok(open.finish(end_lsn, commit_time_us));
            }
            Message::Other(_) => {}
        }
        Ok(None)
    }

    fn open(&mut self) -> Result<&mut Open, String> {
        self.current.as_mut().ok_or_else(|| "a change outside a transaction".to_string())
    }

    /// Notes a changed row of a captured layer; other tables' changes (a layer no longer captured)
    /// are ignored.
    fn change(&mut self, relation: u32, tuple: &Tuple, tables: &Tables) -> Result<(), String> {
        let Some(table) = tables.layers.get(&relation) else { return Ok(()) };
        let key = self.column(relation, tuple, &table.id_column)?;
        match key {
            Some(key) => self.open()?.changes.push((table.layer.clone(), key)),
            // The key column unchanged and not sent cannot happen for a key (never TOASTed).
            None => return Err(format!("a change of layer {} without its key", table.layer)),
        }
        Ok(())
    }

    /// The captured layer's key column of `tuple` is an unchanged TOASTed value PostgreSQL did not send.
    fn unchanged_key(&self, relation: u32, tuple: &Tuple, tables: &Tables) -> bool {
        let (Some(table), Some(r)) = (tables.layers.get(&relation), self.relations.get(&relation)) else { return false };
        r.columns.iter().position(|c| c.name == table.id_column).and_then(|at| tuple.0.get(at)) == Some(&Value::Unchanged)
    }

    /// (layer, key) of an outbox row: its feature_key for a uuid or text key, else its feature_id.
    fn outbox_feature(&self, relation: u32, tuple: &Tuple) -> Result<Option<(String, String)>, String> {
        let layer = self.column(relation, tuple, "layer")?;
        let key = match self.column(relation, tuple, "feature_key")? {
            Some(key) => Some(key),
            None => self.column(relation, tuple, "feature_id")?,
        };
        Ok(layer.zip(key))
    }

    /// The text of column `name` of `tuple`; None for NULL or unchanged.
    fn column(&self, relation: u32, tuple: &Tuple, name: &str) -> Result<Option<String>, String> {
        let r = self.relations.get(&relation).ok_or_else(|| format!("relation {relation} was not described"))?;
        let at = r.columns.iter().position(|c| c.name == name).ok_or_else(|| format!("relation {}.{} has no column {name} in the publication", r.namespace, r.name))?;
        Ok(match tuple.0.get(at) {
            Some(Value::Text(t)) => Some(t.clone()),
            _ => None,
        })
    }
}

impl Open {
    fn finish(self, end_lsn: u64, commit_time_us: i64) -> Option<Committed> {
        if self.own {
            return None;
        }
        let mut committed = Committed { end_lsn, commit_time_us, truncated: self.truncated, ..Default::default() };
        let mut seen = HashSet::new();
        let mut by_layer: HashMap<String, usize> = HashMap::new();
        for (at, (layer, key)) in self.changes.into_iter().enumerate() {
            if self.recorded.get(&(layer.clone(), key.clone())).is_some_and(|&covered| at < covered) {
                committed.skipped += 1;
                continue;
            }
            if self.recorded.contains_key(&(layer.clone(), key.clone())) {
                committed.after_edit.insert((layer.clone(), key.clone()));
            }
            if !seen.insert((layer.clone(), key.clone())) {
                continue;
            }
            let at = *by_layer.entry(layer.clone()).or_insert_with(|| {
                committed.rows.push((layer.clone(), Vec::new()));
                committed.rows.len() - 1
            });
            committed.rows[at].1.push(key);
        }
        Some(committed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::pgoutput::{Column, Message, Relation, Tuple, Value};
    use super::*;

    const PARCELS: u32 = 16500;
    const ROADS: u32 = 16600;
    const OUTBOX: u32 = 16400;

    fn tables() -> Tables {
        let mut layers = HashMap::new();
        layers.insert(PARCELS, LayerTable { layer: "parcels".into(), id_column: "id".into() });
        layers.insert(ROADS, LayerTable { layer: "roads".into(), id_column: "road_id".into() });
        Tables { layers, outbox: OUTBOX, own_origin: "feature_outbox_capture_5".into() }
    }

    fn column(name: &str) -> Column {
        Column { key: name == "id", name: name.into(), type_oid: 25, type_modifier: -1 }
    }

    fn relation(oid: u32, name: &str, columns: &[&str]) -> Message {
        Message::Relation(Relation { oid, namespace: "public".into(), name: name.into(), replica_identity: b'd', columns: columns.iter().map(|c| column(c)).collect() })
    }

    fn text(values: &[Option<&str>]) -> Tuple {
        Tuple(values.iter().map(|v| v.map_or(Value::Null, |t| Value::Text(t.into()))).collect())
    }

    fn begin() -> Message {
        Message::Begin { final_lsn: 100, commit_time_us: 7, xid: 900 }
    }

    fn commit(end_lsn: u64) -> Message {
        Message::Commit { commit_lsn: end_lsn - 8, end_lsn, commit_time_us: 7 }
    }

    fn run(messages: Vec<Message>) -> Vec<Committed> {
        let tables = tables();
        let mut c = Classifier::default();
        let mut out = Vec::new();
        for m in messages {
            if let Some(done) = c.feed(m, &tables).unwrap() {
                out.push(done);
            }
        }
        out
    }

    fn described() -> Vec<Message> {
        vec![relation(PARCELS, "parcels", &["id"]), relation(ROADS, "roads", &["road_id"]), relation(OUTBOX, "outbox", &["id", "feature_id", "layer", "feature_key"])]
    }

    #[test]
    fn plain_writes_name_their_rows_once_each_in_order() {
        let mut m = vec![begin()];
        m.extend(described());
        m.push(Message::Insert { relation: PARCELS, new: text(&[Some("3")]) });
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("3")]) });
        m.push(Message::Delete { relation: ROADS, old: text(&[Some("r9")]) });
        m.push(commit(200));
        let out = run(m);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].end_lsn, 200);
        assert_eq!(out[0].rows, vec![("parcels".to_string(), vec!["3".to_string(), "1".to_string()]), ("roads".to_string(), vec!["r9".to_string()])]);
        assert_eq!(out[0].skipped, 0);
    }

    #[test]
    fn a_row_whose_outbox_row_the_transaction_wrote_is_the_applications_edit() {
        let mut m = vec![begin()];
        m.extend(described());
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(Message::Insert { relation: OUTBOX, new: text(&[Some("77"), Some("1"), Some("parcels"), None]) });
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("2")]) });
        // A text key: the outbox names it by feature_key, feature_id being its number.
        m.push(Message::Update { relation: ROADS, old: None, new: text(&[Some("r1")]) });
        m.push(Message::Insert { relation: OUTBOX, new: text(&[Some("78"), Some("40"), Some("roads"), Some("r1")]) });
        // The same number in another layer is another feature.
        m.push(Message::Insert { relation: OUTBOX, new: text(&[Some("79"), Some("2"), Some("roads"), Some("2")]) });
        m.push(commit(300));
        let out = run(m);
        assert_eq!(out[0].rows, vec![("parcels".to_string(), vec!["2".to_string()])]);
        assert_eq!(out[0].skipped, 2);
    }

    #[test]
    fn a_plain_write_after_the_applications_edit_in_its_transaction_is_kept_for_a_move_only() {
        let mut m = vec![begin()];
        m.extend(described());
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(Message::Insert { relation: OUTBOX, new: text(&[Some("77"), Some("1"), Some("parcels"), None]) });
        // BEGIN; SELECT edit_feature(...1...); UPDATE parcels SET geom = ... WHERE id = 1; COMMIT
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(commit(350));
        let out = run(m);
        assert_eq!(out[0].rows, vec![("parcels".to_string(), vec!["1".to_string()])]);
        assert_eq!(out[0].skipped, 1);
        assert!(out[0].after_edit.contains(&("parcels".to_string(), "1".to_string())));
    }

    #[test]
    fn the_workers_own_transactions_are_skipped_and_others_origins_kept() {
        let mut m = vec![begin(), Message::Origin { origin_lsn: 0, name: "feature_outbox_capture_5".into() }];
        m.extend(described());
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(commit(400));
        m.push(begin());
        m.push(Message::Origin { origin_lsn: 0, name: "pg_16384".into() });
        m.push(Message::Update { relation: PARCELS, old: None, new: text(&[Some("1")]) });
        m.push(commit(500));
        let out = run(m);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].end_lsn, 500);
        assert_eq!(out[0].rows, vec![("parcels".to_string(), vec!["1".to_string()])]);
    }

    #[test]
    fn a_changed_key_names_the_old_row_and_the_new() {
        let mut m = vec![begin()];
        m.extend(described());
        m.push(Message::Update { relation: PARCELS, old: Some(text(&[Some("5")])), new: text(&[Some("6")]) });
        m.push(commit(600));
        assert_eq!(run(m)[0].rows, vec![("parcels".to_string(), vec!["5".to_string(), "6".to_string()])]);
    }

    #[test]
    fn an_unchanged_toasted_key_is_named_by_the_old_key() {
        let mut m = vec![begin()];
        m.extend(described());
        // UPDATE of another column of a row whose long text key is stored out of line: the new row
        // carries 'u' for the key, the old key comes with it.
        m.push(Message::Update { relation: PARCELS, old: Some(text(&[Some("long")])), new: Tuple(vec![Value::Unchanged]) });
        m.push(commit(650));
        assert_eq!(run(m)[0].rows, vec![("parcels".to_string(), vec!["long".to_string()])]);
    }

    #[test]
    fn truncate_names_captured_layers_only_and_other_tables_are_ignored() {
        let mut m = vec![begin()];
        m.extend(described());
        m.push(relation(99, "other", &["id"]));
        m.push(Message::Insert { relation: 99, new: text(&[Some("1")]) });
        m.push(Message::Truncate { relations: vec![99, ROADS], cascade: false, restart_identity: false });
        m.push(commit(700));
        let out = run(m);
        assert_eq!(out[0].truncated, vec!["roads".to_string()]);
        assert!(out[0].rows.is_empty());
    }

    #[test]
    fn a_broken_stream_is_an_error_not_a_guess() {
        let tables = tables();
        let mut c = Classifier::default();
        assert!(c.feed(Message::Insert { relation: PARCELS, new: text(&[Some("1")]) }, &tables).is_err());
        c.feed(begin(), &tables).unwrap();
        let e = c.feed(Message::Insert { relation: PARCELS, new: text(&[Some("1")]) }, &tables).unwrap_err();
        assert!(e.contains("not described"), "{e}");
        assert!(c.feed(commit(10), &tables).unwrap().is_some());
        assert!(c.feed(commit(11), &tables).is_err());
    }
}
