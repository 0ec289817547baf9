"""What the capture tests and drills share (issue 49): a cluster with wal_level = logical, a durable
JetStream subscriber, layers made for a test, the check of one event against the committed row, and
the state a failed capture_layer must leave as it was."""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from conftest import PG_BIN, RUN_DIR, Cluster, free_port
from relay_harness import subject, wait_for

# The capture worker's publication and slot (one each per database).
PUBLICATION = "feature_outbox_capture"
SLOT_PREFIX = "feature_outbox_capture_"


def logical_cluster(name: str, db: str, *settings: str) -> Cluster:
    """A cluster of its own with wal_level = logical (the shared one stays at replica, so no other
    test comes to depend on it), and database `db` with the extension."""
    c = Cluster(RUN_DIR / name, free_port())
    c.start("wal_level = logical", *settings)
    c.create_db(db)
    with c.connect(db) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    return c


def psql(c: Cluster, db: str, sql: str = "", *args: str, stdin: str | None = None) -> str:
    """psql as a user runs it: `sql` with -c (or the script on stdin), stopping at the first error,
    which fails the test with psql's own output."""
    cmd = [PG_BIN / "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres",
           "-d", db, *(["-c", sql] if sql else []), *args]
    out = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, f"psql failed ({out.returncode}): {out.stdout}"
    return out.stdout


class Subscriber:
    """A durable JetStream pull consumer on the relay's subjects, acking each message as a
    subscriber does; poll() takes what arrived since the last call. `received`: events (subject,
    headers, body) of database `db`, in arrival order; departure notices are left out."""

    def __init__(self, url: str, db: str, durable: str, stream: str = "FEATURES", prefix: str = "features"):
        self.url, self.db, self.durable, self.stream, self.prefix = url, db, durable, stream, prefix
        self.received: list[dict] = []
        # Stream sequences taken: a message redelivered to this consumer (an ack lost) is the same
        # message again, not a second event from the relay, which would have a sequence of its own.
        self.seen: set[int] = set()

    def poll(self) -> list[dict]:
        async def run():
            nc = await nats.connect(self.url, connect_timeout=5)
            js = nc.jetstream(timeout=10)
            try:
                await js.stream_info(self.stream)
            except nats.js.errors.NotFoundError:  # nothing relayed yet
                await nc.close()
                return
            sub = await js.pull_subscribe(f"{self.prefix}.>", durable=self.durable, stream=self.stream,
                                          config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                                                deliver_policy=DeliverPolicy.ALL, ack_wait=60))
            while True:
                try:
                    batch = await sub.fetch(1000, timeout=0.3)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):  # nats-py raises either
                    break
                for m in batch:
                    headers = dict(m.headers or {})
                    seq = m.metadata.sequence.stream
                    if seq not in self.seen and not headers.get("Nats-Msg-Id", "").endswith(":departed"):
                        self.seen.add(seq)
                        event = json.loads(m.data)
                        if event.get("database") == self.db:
                            self.received.append({"subject": m.subject, "headers": headers, "event": event})
                    await m.ack()
            await nc.close()
        asyncio.run(run())
        return self.received

    def of(self, layer: str, fid) -> list[dict]:
        return [m for m in self.poll() if m["event"]["layer"] == layer and m["event"]["feature_id"] == str(fid)]

    def wait(self, layer: str, fid, n: int, what: str = "") -> list[dict]:
        """The feature's events once there are at least `n`."""
        wait_for(lambda: len(self.of(layer, fid)) >= n, 20,
                 what or f"event {n} of feature {fid} of layer {layer}", interval=0.1)
        return self.of(layer, fid)


@dataclass
class Layer:
    """A test's own layer: table public.<name> (id bigint key, geom in `srid`, version, the
    registered properties name and kind, note unregistered, retired_at the retired column when
    `retired`)."""
    name: str
    srid: int = 4326
    retired: bool = True
    props: tuple = ("name", "kind")

    @property
    def table(self) -> str:
        return f"public.{self.name}"

    def create(self, conn, capture: bool = True, key: str = "PRIMARY KEY") -> "Layer":
        conn.execute(f"""CREATE TABLE {self.table} (
                             id         bigint {key},
                             geom       geometry(Polygon, {self.srid}) NOT NULL,
                             version    integer NOT NULL DEFAULT 0,
                             name       text,
                             kind       text,
                             note       text{", retired_at timestamptz" if self.retired else ""})""")
        conn.execute("SELECT feature_outbox.register_layer(%s, %s, properties => %s, retired_column => %s)",
                     (self.name, self.table, list(self.props), "retired_at" if self.retired else None))
        if capture:
            conn.execute(f"CALL feature_outbox.capture_layer('{self.name}')")
        return self


def square(lon: float, lat: float, d: float = 0.01, srid: int = 4326) -> str:
    """EWKT of a square `d` degrees wide at (lon, lat), in EPSG:4326."""
    return (f"SRID={srid};POLYGON(({lon} {lat},{lon + d} {lat},{lon + d} {lat + d},{lon} {lat + d},{lon} {lat}))")


def u_shape(lon: float, lat: float, d: float = 0.5) -> str:
    """EWKT of a U open to the north, `d` degrees wide: its centroid lies in the notch, outside the
    shape, so a key taken from the centroid instead of the point on surface differs."""
    w = d / 5
    pts = [(0, 0), (d, 0), (d, d), (d - w, d), (d - w, w), (w, w), (w, d), (0, d), (0, 0)]
    return "SRID=4326;POLYGON((" + ",".join(f"{lon + x} {lat + y}" for x, y in pts) + "))"


def database_id(conn) -> str:
    return str(conn.execute("SELECT identity FROM feature_outbox.database_identity").fetchone()[0])


def committed_row(conn, lay: Layer, fid, geometry: dict | None):
    """The row as committed now, in EPSG:4326: (version, routing key, properties, bbox, whether
    `geometry` (GeoJSON, from an event) is its geometry vertex for vertex, retired); None when gone."""
    props = ", ".join(f"'{p}', t.{p}" for p in lay.props)
    retired = "t.retired_at IS NOT NULL" if lay.retired else "false"
    return conn.execute(f"""
        SELECT version, feature_outbox.routing_key(g), props, ARRAY[ST_XMin(g), ST_YMin(g), ST_XMax(g), ST_YMax(g)],
               ST_OrderingEquals(ST_SnapToGrid(g, 1e-9), ST_SnapToGrid(ST_SetSRID(ST_GeomFromGeoJSON(%s::text), 4326), 1e-9)),
               retired
          FROM (SELECT t.version, ST_Transform(t.geom, 4326) g, jsonb_build_object({props}) props, {retired} retired
                  FROM {lay.table} t WHERE t.id = %s) r""",
                        (json.dumps(geometry) if geometry is not None else None, int(fid))).fetchone()


def close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(abs(x - y) < 1e-9 for x, y in zip(a, b))


def check(conn, lay: Layer, m: dict, action: str, before: dict | None, origin: str = "captured") -> dict:
    """Every field of one delivered event `m` against the row as committed (read back now) and the
    feature's event before it (`before`, a body, or None for its first). Returns the body."""
    e, h = m["event"], m["headers"]
    fid = e["feature_id"]
    where = f"{lay.name}/{fid} {action}: {e}"
    assert (e["action"], e["origin"], h.get("Feature-Origin")) == (action, origin, origin), where
    assert (e["schema_version"], e["database"], e["layer"], e["crs"]) == (3, conn.info.dbname, lay.name, "EPSG:4326"), where
    assert e["database_id"] == database_id(conn), where
    assert e["registration_id"] == conn.execute("SELECT registration_id FROM feature_outbox.layers WHERE layer = %s",
                                                (lay.name,)).fetchone()[0], where
    assert e["event_version"] == (before["event_version"] + 1 if before else 1), where
    assert e["previous_routing_key"] == (before["routing_key"] if before else None), where
    assert close(e["previous_bbox"], before["bbox"] if before else None), where
    assert m["subject"] == subject(lay.name, action, e["routing_key"]), where
    assert (h["Nats-Msg-Id"], h["Feature-Id"], h["Feature-Version"]) == (e["event_id"], fid, str(e["event_version"])), where
    assert h.get("Previous-Routing-Key") == e["previous_routing_key"], where
    assert e["occurred_at"] <= e["relayed_at"], where
    row = committed_row(conn, lay, fid, e["geometry"])
    if row is None:  # deleted: the event says so with null content, on the cell last seen
        assert action == "retired" and before is not None, where
        assert (e["geometry"], e["properties"], e["bbox"], e["geometry_version"]) == (None, None, None, None), where
        assert e["routing_key"] == before["routing_key"], where
    else:
        version, key, props, bbox, same_geometry, retired = row
        assert version == e["event_version"] == e["geometry_version"], (row, where)
        assert same_geometry, (row, where)
        assert e["properties"] == props, (row, where)
        assert e["routing_key"] == key, (row, where)
        assert close(e["bbox"], bbox), (row, where)
        assert retired == (action == "retired"), (row, where)
    stored = conn.execute("""SELECT origin, event_type, feature_version, routing_key, previous_routing_key
                               FROM feature_outbox.outbox WHERE event_id = %s""", (e["event_id"],)).fetchone()
    assert stored == (origin, action, e["event_version"], e["routing_key"], e["previous_routing_key"]), (stored, where)
    return e


def outbox_count(conn, layer: str, fid=None) -> int:
    """The layer's outbox rows, or one feature's (its key as the table stores it)."""
    return conn.execute("""SELECT count(*) FROM feature_outbox.outbox
                            WHERE layer = %s AND (%s::text IS NULL OR coalesce(feature_key, feature_id::text) = %s::text)""",
                        (layer, None if fid is None else str(fid), None if fid is None else str(fid))).fetchone()[0]


def relayed(conn) -> bool:
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL)").fetchone()[0]


def settle(c: Cluster, db: str, sub: Subscriber, lay: Layer, fence_id: int = 999_999) -> None:
    """A fence: a captured write to the layer's fence row, committed after everything the test
    wrote before, and its event awaited. The worker reads the slot in commit order, so by then
    every earlier change was decoded, and whatever event it would write is written; then the relay
    drains. What a test counts afterwards is final, with no sleep to guess."""
    with c.connect(db) as conn:
        n = len(sub.of(lay.name, fence_id))
        if n == 0:
            psql(c, db, f"""INSERT INTO {lay.table} (id, geom, name)
                            VALUES ({fence_id}, ST_Transform('{square(-73.90, 40.80)}'::geometry, {lay.srid}), 'fence 0')""")
        else:
            psql(c, db, f"UPDATE {lay.table} SET name = 'fence {n}' WHERE id = {fence_id}")
        sub.wait(lay.name, fence_id, n + 1, f"the fence write {n} of layer {lay.name}")
        wait_for(lambda: relayed(conn), 20, "the relay to drain the outbox")
    sub.poll()


def capture_state(conn, table: str) -> dict:
    """What capture_layer creates, as the catalogs show it: this database's logical slots (name,
    plugin), whether `table` is in the capture publication, and the layers the capture view lists."""
    slots = conn.execute("""SELECT slot_name::text, plugin::text FROM pg_replication_slots
                             WHERE database = current_database() ORDER BY 1""").fetchall()
    published = conn.execute("""SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                                  WHERE pubname = %s AND format('%%I.%%I', schemaname, tablename)::regclass = %s::regclass)""",
                             (PUBLICATION, table)).fetchone()[0]
    layers = conn.execute("SELECT coalesce((SELECT layers FROM feature_outbox.capture), '{}')").fetchone()[0]
    return {"slots": slots, "published": published, "layers": sorted(layers or [])}


def slot_name(conn) -> str:
    return SLOT_PREFIX + str(conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()[0])


def capture_pids(c: Cluster, db: str) -> list[int]:
    """The pids of db's capture worker, as pg_stat_activity sees it."""
    with c.connect() as conn:
        return [r[0] for r in conn.execute("""SELECT pid FROM pg_stat_activity
                                                WHERE backend_type ILIKE '%%capture%%' AND datname = %s""", (db,))]

