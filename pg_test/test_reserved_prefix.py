"""The reserved prefix (PostgreSQL 15+'s MarkGUCPrefixReserved): a feature_outbox.* name the library
does not define is warned about and removed when the library loads, and setting one fails, so a typo
such as feature_outbox.standby_slotz cannot silently turn a setting off. make test and CI run it on
15 and 18; the package tests' quick start (pg_test/package_check.py) checks SET, ALTER DATABASE and
ALTER SYSTEM on 15, 17 and 18."""

import psycopg

from conftest import PG_MAJOR

TYPO = "feature_outbox.standby_slotz"
# SET, ALTER DATABASE and ALTER ROLE name an invalid name (42602). ALTER SYSTEM on 15 takes no
# unknown custom name at all (42704); from 17 it takes one unless its prefix is reserved (42602).
ALTER_SYSTEM_REFUSED = "42704" if PG_MAJOR == 15 else "42602"


def sqlstate(conn: psycopg.Connection, sql: str) -> str | None:
    try:
        conn.execute(sql)
    except psycopg.Error as e:
        return e.sqlstate
    return None


def test_a_typo_in_postgresql_conf_is_warned_about_and_dropped(cluster_with):
    c = cluster_with(f"{TYPO} = 'typo'", "feature_outbox.relay_workers = 1")
    assert f'invalid configuration parameter name "{TYPO}", removing it' in c.log()
    assert '"feature_outbox" is now a reserved prefix' in c.log()
    with c.connect() as conn:
        assert sqlstate(conn, f"SHOW {TYPO}") == "42704"
        assert conn.execute("SELECT count(*) FROM pg_settings WHERE name = %s", (TYPO,)).fetchone() == (0,)
        # The settings it does define keep their values from the same file.
        assert conn.execute("SHOW feature_outbox.relay_workers").fetchone() == ("1",)


def test_set_alter_system_and_alter_database_of_an_unknown_name_fail(cluster_with):
    c = cluster_with()
    c.create_db("gis")
    with c.connect() as conn:
        assert sqlstate(conn, f"SET {TYPO} = 'typo'") == "42602"
        assert sqlstate(conn, f"SET LOCAL {TYPO} = 'typo'") == "42602"
        assert sqlstate(conn, f"SELECT set_config('{TYPO}', 'typo', false)") == "42602"
        assert sqlstate(conn, f"ALTER SYSTEM SET {TYPO} = 'typo'") == ALTER_SYSTEM_REFUSED
        assert sqlstate(conn, f"ALTER DATABASE gis SET {TYPO} = 'typo'") == "42602"
        assert sqlstate(conn, f"ALTER ROLE postgres SET {TYPO} = 'typo'") == "42602"
        # Nothing was written anywhere.
        assert conn.execute("SELECT count(*) FROM pg_db_role_setting, unnest(setconfig) s "
                            "WHERE s LIKE 'feature_outbox.%'").fetchone() == (0,)
        assert TYPO not in (c.dir / "data" / "postgresql.auto.conf").read_text()
        # A defined name is still set as before.
        assert sqlstate(conn, "SET feature_outbox.h3_resolution = 9") is None
        assert sqlstate(conn, "ALTER DATABASE gis SET feature_outbox.h3_resolution = 9") is None


def test_a_session_that_set_a_name_before_the_library_loaded_loses_it(cluster_with):
    """Without the preload the library loads in the session that first needs it (here LOAD; CREATE
    EXTENSION or a call does the same): a placeholder set before that is removed with a WARNING,
    and setting it again fails."""
    c = cluster_with("shared_preload_libraries = ''", "feature_outbox.relay_workers = 2",
                     "feature_outbox.database = 'gis'")
    warnings = []
    with c.connect() as conn:
        conn.add_notice_handler(lambda n: warnings.append(n.message_primary))
        conn.execute(f"SET {TYPO} = 'typo'")
        assert conn.execute(f"SHOW {TYPO}").fetchone() == ("typo",)
        conn.execute("LOAD 'feature_outbox'")
        assert f'invalid configuration parameter name "{TYPO}", removing it' in warnings, warnings
        assert sqlstate(conn, f"SHOW {TYPO}") == "42704"
        assert sqlstate(conn, f"SET {TYPO} = 'again'") == "42602"
        # The settings only the postmaster reads keep their postgresql.conf values, not dropped as unknown.
        assert conn.execute("SHOW feature_outbox.relay_workers").fetchone() == ("2",)
        assert conn.execute("SHOW feature_outbox.database").fetchone() == ("gis",)
    assert not [w for w in warnings if "relay_workers" in w or "feature_outbox.database" in w], warnings


def test_near_misses_are_refused_too(cluster_with):
    c = cluster_with()
    with c.connect() as conn:
        for name in ["feature_outbox.relay_worker", "feature_outbox.endpoint.extra", "feature_outbox.x"]:
            assert sqlstate(conn, f"SET {name} = 1") == "42602", name
        # Names are case-insensitive, as PostgreSQL's own are: this one is feature_outbox.endpoint.
        assert sqlstate(conn, "SET \"feature_outbox.Endpoint\" = 'nats://127.0.0.1:1'") is None
