"""Real components for the relay tests: nats-server -js on a free port, and an HTTP receiver running
in the test process on 127.0.0.1 (the standard library's ThreadingHTTPServer)."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import h3
import nats
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from conftest import RUN_DIR, Cluster, free_port


# Tests wait for states, and a timeout only bounds how long a failing test takes to say so. A busy
# machine (make test beside a build) is slower by a factor: every timeout is multiplied by this.
WAIT_SCALE = float(os.environ.get("FEATURE_OUTBOX_WAIT_SCALE", "3"))


def wait_for(predicate, timeout=20.0, what="condition", interval=0.05):
    """Polls until predicate() is truthy; returns its value or fails with `what`. A server that does
    not accept connections yet (restarting, in crash recovery) counts as not yet."""
    deadline = time.monotonic() + timeout * WAIT_SCALE
    while True:
        try:
            value = predicate()
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout * WAIT_SCALE:g}s waiting for {what}")
        time.sleep(interval)


class NatsServer:
    """nats-server -js; `args` adds options (auth, TLS, a config file), `client` options for reading."""

    def __init__(self, directory: Path, *args: str, scheme: str = "nats", userinfo: str = "",
                 max_payload: int | None = None, **client):
        self.dir = directory
        self.port = free_port()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        if max_payload is not None:  # only a config file can set it
            (self.dir / "nats.conf").write_text(f"max_payload: {max_payload}\n")
            args = (*args, "-c", str(self.dir / "nats.conf"))
        self.args, self.scheme, self.userinfo, self.client = args, scheme, userinfo, client

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.userinfo}127.0.0.1:{self.port}"

    def start(self) -> None:
        # The same store directory across restarts, so the stream survives an outage like a real one.
        self.proc = subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port),
                                      "-sd", str(self.dir / "store"), *self.args],
                                     stdout=open(self.dir / "nats.log", "a"), stderr=subprocess.STDOUT)
        wait_for(lambda: "Server is ready" in (self.dir / "nats.log").read_text(), 10, "nats-server to start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def messages(self, stream: str = "FEATURES", departed: bool = False) -> list[dict]:
        """Every message in the stream: subject, headers and decoded JSON body. Departure notices
        (Nats-Msg-Id `<event_id>:departed`, the same body again) only with `departed`."""
        async def read():
            nc = await nats.connect(self.url.replace("tls://", "nats://"), connect_timeout=5,
                                    max_reconnect_attempts=2, **self.client)
            js = nc.jetstream()
            try:
                info = await js.stream_info(stream)
            except Exception:
                await nc.close()
                return []
            out = []
            if not info.state.messages:
                await nc.close()
                return out
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                m = await js.get_msg(stream, seq)
                if not departed and (m.headers or {}).get("Nats-Msg-Id", "").endswith(":departed"):
                    continue
                out.append({"subject": m.subject, "headers": dict(m.headers or {}), "event": json.loads(m.data)})
            await nc.close()
            return out
        return asyncio.run(read())


def alter_system(c: Cluster, settings: dict) -> None:
    """ALTER SYSTEM SET (None: RESET) each setting, by its full name, then reload; the workers re-read
    their settings on SIGHUP."""
    with c.connect() as conn:
        for name, value in settings.items():
            if value is None:
                conn.execute(f"ALTER SYSTEM RESET {name}")
            else:
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        conn.execute("SELECT pg_reload_conf()")


def configure(c: Cluster, **settings) -> None:
    """alter_system of each feature_outbox.<name>."""
    alter_system(c, {f"feature_outbox.{name}": value for name, value in settings.items()})


def reconfigure(c: Cluster, **settings) -> None:
    """configure, then a pause for the workers to take the reload before the test's next edit (a
    commit can wake a worker before its SIGHUP does)."""
    configure(c, **settings)
    time.sleep(0.5)


def consume(urls: list[str], filters: list[str], stream: str = "FEATURES") -> list[dict]:
    """Every message of the stream matching any of `filters`, through one ephemeral JetStream pull
    consumer per filter (nats-server 2.9 takes one filter subject per consumer): subject, message id,
    headers and body, as a subscriber that selects by subject alone receives them."""
    async def run():
        nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=5)
        js = nc.jetstream(timeout=10)
        out = []
        for f in filters:
            sub = await js.pull_subscribe(f, stream=stream, config=ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=60))
            pending = (await sub.consumer_info()).num_pending
            while pending > 0:
                batch = await sub.fetch(min(pending, 2000), timeout=10)
                pending -= len(batch)
                out += [{"subject": m.subject, "id": (m.headers or {}).get("Nats-Msg-Id", ""), "headers": dict(m.headers or {}),
                         "event": json.loads(m.data)} for m in batch]
            await sub.unsubscribe()
        await nc.close()
        return out
    return asyncio.run(run())


def nats_fixture(name: str):
    """A module-scoped fixture: a nats-server -js of its own under RUN_DIR/name, for a test module."""
    @pytest.fixture(scope="module")
    def fixture():
        server = NatsServer(RUN_DIR / name)
        server.start()
        yield server
        server.stop()
    return fixture


@pytest.fixture(scope="module")
def receiver():
    """A module-scoped HTTP Receiver on 127.0.0.1; a test module imports it as its `receiver` fixture."""
    r = Receiver()
    yield r
    r.close()


def relay_cluster(name: str, db: str, *settings: str, setup: tuple[str, ...] = ()) -> Cluster:
    """A cluster that preloads feature_outbox with `settings`, and database `db` with the extension
    and the `setup` statements run in it."""
    c = Cluster(RUN_DIR / name, free_port())
    c.start(f"feature_outbox.database = '{db}'", *settings)
    c.create_db(db)
    with c.connect(db) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        for sql in setup:
            conn.execute(sql)
    return c


def subject(layer: str, event_type: str, key: str, resolutions=(3, 5, 7), prefix: str = "features") -> str:
    """The subject the relay publishes an event on: `<prefix>.<layer>.<event_type>.<parents>.<key>`,
    the parents being the key's H3 parents at each of `resolutions` coarser than its own (src/subjects.rs)."""
    own = h3.get_resolution(key)
    return ".".join([prefix, layer, event_type, *(h3.cell_to_parent(key, r) for r in resolutions if r < own), key])


def get_object(server, bucket: str, name: str) -> bytes:
    """The content of one JetStream Object Store object on `server`."""
    async def read():
        nc = await nats.connect(server.url.replace("tls://", "nats://"), **server.client)
        store = await nc.jetstream().object_store(bucket)
        data = (await store.get(name)).data
        await nc.close()
        return data
    return asyncio.run(read())


class Receiver:
    """Records every POST; `respond(request) -> (status, headers)` decides each answer (default 200),
    under the receiver's lock. Each answer waits `delay` seconds, outside the lock (a receiver's own
    work); `max_in_flight` is the most requests it held at once."""

    def __init__(self, tls=None):
        self.requests: list[dict] = []
        self.scheme = "https" if tls else "http"
        self.lock = threading.Lock()
        self.respond = lambda request: (200, {})
        self.delay = 0.0
        self.in_flight = self.max_in_flight = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the relay's client expects

            def setup(self):
                super().setup()
                # Headers and body go out in two writes; without this, Nagle's algorithm and the
                # client's delayed ACK add 40 ms to every response.
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = {"at": time.monotonic(), "path": self.path, "body": body, "peer": self.client_address[1],
                           "headers": {k.lower(): v for k, v in self.headers.items()}}
                with receiver.lock:
                    receiver.requests.append(request)
                    status, headers = receiver.respond(request)
                    receiver.in_flight += 1
                    receiver.max_in_flight = max(receiver.max_in_flight, receiver.in_flight)
                if receiver.delay:
                    time.sleep(receiver.delay)
                with receiver.lock:
                    receiver.in_flight -= 1
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        if tls:  # an ssl.SSLContext holding the server certificate
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server.server_port}/hook"

    def events(self, path="/hook") -> list[dict]:
        with self.lock:
            return [json.loads(r["body"]) for r in self.requests if r["path"] == path]

    def close(self):
        self.server.shutdown()


def point_edits(conn, first: int, n: int) -> None:
    """`created` edits of n point features, ids first .. first + n - 1, in one statement."""
    conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,%%s]}',
                                                   (i %% 340) - 170, (i %% 160) - 80), 'created')
                      FROM generate_series(%s::bigint, %s::bigint) i""", (first, first + n - 1))


def all_published(conn) -> bool:
    """True when no outbox row waits: a cheap probe (the first unpublished row), so polling does not
    compete with the relay for CPU."""
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL)").fetchone()[0]


# The claim's scan as a single worker runs it (src/relay/claim.rs, CLAIM_SQL, with $3 workers = 1, so the
# partition test drops out), from the id given as `low`, claiming 200 rows.
CLAIM_FROM = """SELECT o.id FROM feature_outbox.outbox o
                 WHERE o.published_at IS NULL AND o.parked_at IS NULL AND o.id >= {low}
                   AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= now())
                   AND o.layer <> ALL (ARRAY(SELECT h.layer FROM feature_outbox.layer_registry h WHERE h.held_since IS NOT NULL))
                   AND NOT EXISTS (SELECT 1 FROM feature_outbox.outbox w
                                    WHERE w.published_at IS NULL AND w.next_attempt_at IS NOT NULL AND w.parked_at IS NULL
                                      AND w.feature_id = o.feature_id AND w.next_attempt_at > now() AND w.layer = o.layer
                                      AND w.id < o.id)
                 ORDER BY o.id LIMIT 200 FOR UPDATE OF o SKIP LOCKED"""


def make_tls(directory):
    """A private CA and a server certificate for 127.0.0.1, made with openssl."""
    import subprocess
    directory.mkdir(parents=True, exist_ok=True)
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=directory)
    # Key usages as RFC 5280 has them: Python 3.13+ verifies strictly (VERIFY_X509_STRICT) and refuses
    # a CA certificate without keyUsage.
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=feature_outbox test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                                       "extendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.pem")
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"
