//! Prepared statements kept for the session, by their text. The statements of a layer are built
//! from its registry row, so they cannot be written as constants; each is planned once per
//! backend, and PostgreSQL's plan cache replans it after DDL on its table.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use pgrx::pg_sys::{self, PgOid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};

type Key = (String, Vec<u32>);

thread_local! {
    static PLANS: RefCell<HashMap<Key, Rc<OwnedPreparedStatement>>> = RefCell::new(HashMap::new());
}

/// The kept plan of `sql` with parameter `types`, prepared on first use. `mutating`: the statement
/// writes (SPI runs it read-write). Kept by text and parameter types: one text may be called with
/// a uuid and with a text key, and a plan reads its parameters as the types it was prepared with.
pub fn prepared(client: &SpiClient<'_>, sql: &str, types: &[pg_sys::Oid], mutating: bool) -> Rc<OwnedPreparedStatement> {
    let key: Key = (sql.to_string(), types.iter().map(|t| t.to_u32()).collect());
    if let Some(p) = PLANS.with(|m| m.borrow().get(&key).cloned()) {
        return p;
    }
    let types: Vec<PgOid> = types.iter().map(|t| PgOid::from(*t)).collect();
    let plan = if mutating { client.prepare_mut(sql, &types) } else { client.prepare(sql, &types) };
    let plan = Rc::new(plan.unwrap_or_else(|e| error!("cannot prepare \"{sql}\": {e}")).keep());
    PLANS.with(|m| m.borrow_mut().insert(key, plan.clone()));
    plan
}
