"""NATS credentials as production deployments hand them out (issue 13): a .creds file (user JWT and
NKey seed) against a nats-server in operator mode (resolver: MEMORY), and an NKey seed file against
a server that authenticates users by nkey. The operator, account and user are minted here with the
PyPI packages nkeys and nats-jwt (there is no nsc on this machine). The files are readable by the
postgres OS user only; SQL shows their paths to superusers and no part of their content."""

import os
import shutil

import psycopg
import pytest

from conftest import RUN_DIR
from relay_harness import NatsServer, configure, relay_cluster, wait_for

nkeys = pytest.importorskip("nkeys")
snippets = pytest.importorskip("nats_jwt.v2.snippets")
from nats_jwt.nkeys_ext import create_account_pair, create_user_pair  # noqa: E402
from nats_jwt.v2.account_claims import AccountClaims  # noqa: E402
from nats_jwt.v2.user_claims import UserClaims  # noqa: E402

DB = "credentials"


def private_file(path, text):
    """A file only the postgres OS user can read, as a deployment would keep a secret."""
    path.write_text(text)
    shutil.chown(path, "postgres", "postgres")
    os.chmod(path, 0o600)
    return path


def operator_mode(directory):
    """An operator, an account with JetStream, and a user of it: the server's config, and the
    user's .creds file text."""
    okp, operator_jwt = snippets.init_new_operator("drills")
    akp = create_account_pair()
    account = AccountClaims(akp.public_key.decode(), "relay")
    account.nats.limits.disk_storage = -1
    account.nats.limits.memory_storage = -1
    account.nats.limits.streams = -1
    account.nats.limits.consumer = -1
    account_jwt = account.encode(okp)
    ukp = create_user_pair()
    user = UserClaims(ukp.public_key.decode(), "relay-worker")
    user_jwt = user.encode(akp)
    # JetStream needs a system account in operator mode.
    skp = create_account_pair()
    system_jwt = AccountClaims(skp.public_key.decode(), "SYS").encode(okp)
    config = (f'operator: "{operator_jwt}"\nresolver: MEMORY\nsystem_account: {skp.public_key.decode()}\n'
              f'resolver_preload: {{ {akp.public_key.decode()}: "{account_jwt}", {skp.public_key.decode()}: "{system_jwt}" }}\n')
    creds = ("-----BEGIN NATS USER JWT-----\n" + user_jwt + "\n------END NATS USER JWT------\n\n"
             "-----BEGIN USER NKEY SEED-----\n" + ukp.seed.decode() + "\n------END USER NKEY SEED------\n")
    return config, creds


@pytest.fixture(scope="module")
def relay():
    c = relay_cluster("credentials", DB, "feature_outbox.retry_backoff_max = '500ms'")
    yield c
    c.stop()


def relayed_through(c, fid):
    with c.connect(DB) as conn:
        conn.execute("SELECT feature_outbox.edit_feature(%s, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')", (fid,))
    wait_for(lambda: c.connect(DB).execute("SELECT published_at IS NOT NULL FROM feature_outbox.outbox WHERE feature_id = %s",
                                           (fid,)).fetchone()[0], 20, f"feature {fid} to be relayed")


def test_a_creds_file_against_an_operator_mode_server(relay):
    directory = RUN_DIR / "nats_operator"
    config, creds = operator_mode(directory)
    server = NatsServer(directory)
    (directory / "operator.conf").write_text(config)
    server.args = ("-c", str(directory / "operator.conf"))
    path = private_file(directory / "relay.creds", creds)
    server.start()
    try:
        # Without credentials the server refuses the relay: a sink-level error, nothing parked.
        configure(relay, endpoint=server.url, nats_credentials_file=None)
        with relay.connect(DB) as conn:
            conn.execute("SELECT feature_outbox.edit_feature(1, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')")
        wait_for(lambda: (relay.connect(DB).execute("SELECT relay_last_error FROM feature_outbox.backlog").fetchone()[0] or "")
                 .find("NATS") >= 0, 20, "the relay to report the refused connection")
        configure(relay, nats_credentials_file=str(path))
        wait_for(lambda: relay.connect(DB).execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0] == 0,
                 20, "the relay to publish with the .creds file")
        relayed_through(relay, 2)
        # An ordinary role sees neither the path nor, anywhere, the content.
        with relay.connect(DB) as su:
            su.execute("DROP ROLE IF EXISTS plain")
            su.execute("CREATE ROLE plain LOGIN")
        with psycopg.connect(relay.dsn(DB).replace("user=postgres", "user=plain"), autocommit=True) as plain:
            with pytest.raises(psycopg.Error) as e:
                plain.execute("SHOW feature_outbox.nats_credentials_file")
            assert e.value.sqlstate == "42501"
            seen = " ".join(str(v) for (v,) in plain.execute("SELECT setting FROM pg_settings WHERE name LIKE 'feature_outbox.%'"))
            assert "relay.creds" not in seen and "SU" not in seen
            with pytest.raises(psycopg.Error):
                plain.execute("SELECT pg_read_file(%s)", (str(path),))
        # A file the server cannot read: a clear error naming the setting and the path, not the content.
        configure(relay, nats_credentials_file=str(directory / "missing.creds"))
        with relay.connect(DB) as conn:
            conn.execute("SELECT feature_outbox.edit_feature(3, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')")
        wait_for(lambda: "nats_credentials_file" in (relay.connect(DB).execute("SELECT relay_last_error FROM feature_outbox.backlog").fetchone()[0] or ""),
                 20, "the missing file to be reported")
        assert creds.split("\n")[1][:20] not in relay.log()
    finally:
        configure(relay, nats_credentials_file=None)
        server.stop()


def test_an_nkey_seed_file_against_an_nkey_server(relay):
    directory = RUN_DIR / "nats_nkey"
    user = create_user_pair()
    server = NatsServer(directory)
    (directory / "nkey.conf").write_text(
        f'authorization {{ users = [ {{ nkey: "{user.public_key.decode()}" }} ] }}\n')
    server.args = ("-c", str(directory / "nkey.conf"))
    path = private_file(directory / "relay.nk", user.seed.decode() + "\n")
    server.start()
    try:
        configure(relay, endpoint=server.url, nats_nkey_file=str(path))
        relayed_through(relay, 10)
        # The wrong seed: refused, reported, nothing parked.
        other = private_file(directory / "other.nk", create_user_pair().seed.decode())
        configure(relay, nats_nkey_file=str(other))
        with relay.connect(DB) as conn:
            conn.execute("SELECT feature_outbox.edit_feature(11, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')")
        wait_for(lambda: relay.connect(DB).execute("SELECT relay_last_error IS NOT NULL FROM feature_outbox.backlog").fetchone()[0],
                 20, "the refusal to be reported")
        assert relay.connect(DB).execute("SELECT count(*) FROM feature_outbox.outbox WHERE parked_at IS NOT NULL").fetchone()[0] == 0
        configure(relay, nats_nkey_file=str(path))
        wait_for(lambda: relay.connect(DB).execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0] == 0,
                 20, "the relay to publish once the seed is right")
    finally:
        configure(relay, nats_nkey_file=None)
        server.stop()
