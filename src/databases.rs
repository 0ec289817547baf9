//! Which databases the relay serves. `feature_outbox.database` is one name, a comma-separated list,
//! or `*`: every database that allows connections and is no template. The launcher reads the
//! cluster's databases from pg_database, a shared catalog it can scan connected to none.

use pgrx::pg_sys;

use crate::settings;

#[derive(Debug, PartialEq, Eq)]
pub enum Served {
    All,
    Named(Vec<String>),
}

impl Served {
    /// The setting now in effect.
    pub fn now() -> Served {
        parse(&settings::string(&settings::DATABASE))
    }

    pub fn includes(&self, name: &str) -> bool {
        match self {
            Served::All => true,
            Served::Named(names) => names.iter().any(|n| n == name),
        }
    }
}

/// Parses the setting: `*`, or names separated by commas (spaces around each are ignored).
pub fn parse(value: &str) -> Served {
    if value.trim() == "*" {
        return Served::All;
    }
    Served::Named(value.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect())
}

/// One row of pg_database.
#[derive(Debug, Clone)]
pub struct Catalogued {
    pub oid: u32,
    pub name: String,
    pub allows_connections: bool,
    pub is_template: bool,
}

impl Catalogued {
    /// A database the relay serves under `served`: templates and those that refuse connections never.
    pub fn served_by(&self, served: &Served) -> bool {
        self.allows_connections && !self.is_template && served.includes(&self.name)
    }
}

/// Every database of the cluster, read inside the caller's transaction. A sequential scan, as the
/// autovacuum launcher does: connected to no database, a process cannot open the catalog's indexes.
pub fn scan() -> Vec<Catalogued> {
    let mut found = Vec::new();
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(pg_sys::DatabaseRelationId, lock);
        let scan = pg_sys::systable_beginscan(rel, pg_sys::InvalidOid, false, std::ptr::null_mut(), 0, std::ptr::null_mut());
        loop {
            let tuple = pg_sys::systable_getnext(scan);
            if tuple.is_null() {
                break;
            }
            let form = pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
            found.push(Catalogued {
                oid: (*form).oid.to_u32(),
                name: std::ffi::CStr::from_ptr((*form).datname.data.as_ptr()).to_string_lossy().into_owned(),
                // datconnlimit -2: a DROP DATABASE was interrupted; the database cannot be connected to.
                allows_connections: (*form).datallowconn && (*form).datconnlimit != -2,
                is_template: (*form).datistemplate,
            });
        }
        pg_sys::systable_endscan(scan);
        pg_sys::table_close(rel, lock);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_is_a_star_or_a_list() {
        assert_eq!(parse("*"), Served::All);
        assert_eq!(parse(" * "), Served::All);
        assert_eq!(parse("gis"), Served::Named(vec!["gis".into()]));
        assert_eq!(parse("a, b ,c,"), Served::Named(vec!["a".into(), "b".into(), "c".into()]));
        assert!(parse("a,b").includes("b") && !parse("a,b").includes("c") && !parse("a,b").includes("a,b"));
        assert!(Served::All.includes("anything"));
    }

    #[test]
    fn templates_and_closed_databases_are_never_served() {
        let db = |allows_connections, is_template| Catalogued { oid: 1, name: "a".into(), allows_connections, is_template };
        assert!(db(true, false).served_by(&Served::All));
        assert!(!db(false, false).served_by(&Served::All));
        assert!(!db(true, true).served_by(&Served::Named(vec!["a".into()])));
    }
}
