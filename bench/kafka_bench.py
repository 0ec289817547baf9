"""The Kafka sink's speed, side by side in one run (make bench, section 11). Prints figures only.

One cluster (the release build with the discard:// sink), one nats-server -js and one tansu broker
(Kafka-compatible, SQLite storage, pg_test/kafka_harness.py), the shared counties, 1 relay worker.
  1. drain: a backlog of county events (BENCH_KAFKA_BACKLOG, default BENCH_BACKLOG up to 20,000:
     tansu takes about 5,000 of them a second) to Kafka (k), beside a bare producer (p:
     bench/kafka_producer, the relay's client library and producer settings with no database)
     sending the relay's own messages, byte for byte, to the same broker; and, in the same run, the
     relay's BENCH_BACKLOG into JetStream (a) and the in-worker floor (e, discard sink). Every
     drain has a fresh topic or stream (the Kafka ones made beforehand with BENCH_KAFKA_PARTITIONS
     partitions, default 1, the relay's default) and counts what arrived; the broker's CPU per
     event shows whether it was the bound. Repeats alternate the drains, so that drift on a noisy
     machine touches each alike.
  2. commit-to-acknowledgement latency of county polygon edits at 1,000/s (sleeping between edits,
     never spinning) for BENCH_LATENCY_SECONDS, 1 worker, wake_at_commit on: the database's clock
     (published_at - created_at of the run's rows, the row is marked after the broker's
     acknowledgement) and the client's (a kafka-python consumer with fetch_max_wait_ms 5, from
     edit_feature's return to the message's arrival); beside them the bare producer's own send to
     delivery report at the same rate, the same consumer reading.
"""

import contextlib
import os
import sqlite3
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import PG_BIN, RUN_DIR, Cluster, free_port  # noqa: E402
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition  # noqa: E402
from kafka.admin import NewTopic  # noqa: E402
from kafka_harness import Tansu  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402
from bounds_bench import cpu_seconds  # noqa: E402
from results import DB, configure, fill, load_counties, memory, paused, spread, wait_drained, worker_drain  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
BACKLOG = int(os.environ.get("BENCH_BACKLOG", "100000"))
# tansu stores each record and each of its headers as SQLite rows (about 180 µs of its CPU per
# message of the relay's, with 12 headers): the Kafka drains are shorter by default.
KAFKA_BACKLOG = int(os.environ.get("BENCH_KAFKA_BACKLOG", str(min(BACKLOG, 20000))))
LATENCY_S = int(os.environ.get("BENCH_LATENCY_SECONDS", "30"))
PARTITIONS = int(os.environ.get("BENCH_KAFKA_PARTITIONS", "1"))
FETCH_WAIT_MS = int(os.environ.get("BENCH_KAFKA_FETCH_WAIT_MS", "5"))  # the latency consumer's fetch_max_wait_ms
RATE = 1000
PRODUCER_DIR = ROOT / "bench" / "kafka_producer"
PRODUCER_TARGET = Path(os.environ.get("BENCH_KAFKA_PRODUCER_TARGET", ROOT / "target" / "bench-kafka-producer"))
PRODUCER = PRODUCER_TARGET / "release" / "kafka_producer"


class BrokerCpu:
    """The CPU seconds a broker's process (all threads) spent around one drain; usable as
    results.worker_drain's meter."""

    def __init__(self, pid: int):
        self.pid = pid

    def __call__(self, poller=None):
        return self

    def __enter__(self):
        self.before = cpu_seconds(self.pid)
        return self

    def __exit__(self, *exc):
        self.spent = cpu_seconds(self.pid) - self.before
        return False


def build_producer() -> None:
    """bench/kafka_producer, built once per machine (its own target directory under target/)."""
    if PRODUCER.exists():
        return
    print("building bench/kafka_producer (bundled librdkafka, about a minute) ...", file=sys.stderr, flush=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "--manifest-path", str(PRODUCER_DIR / "Cargo.toml")],
                   check=True, env={**os.environ, "CARGO_TARGET_DIR": str(PRODUCER_TARGET)}, stdout=sys.stderr)


class Broker:
    """Topics of the tansu broker: made beforehand with PARTITIONS partitions, counted by their end
    offsets, deleted after each drain so that the broker's storage does not grow run by run.

    tansu 0.6.0 keeps each record's headers as rows of an SQLite table `header` with no index: a
    fetch (and the cascade of a topic's deletion) scans the whole table for each record, which with
    the relay's 12 headers per message read about 30 messages/s back after a 20,000-message drain.
    The broker's storage gets that index here, before any traffic; producing pays for it alike in
    both Kafka rows."""

    def __init__(self, tansu: Tansu):
        self.tansu = tansu
        with contextlib.closing(sqlite3.connect(tansu.dir / "tansu.db", timeout=30)) as db:
            wait_for(lambda: db.execute("SELECT 1 FROM sqlite_master WHERE name = 'header'").fetchone(), 20, "tansu's schema")
            db.execute("CREATE INDEX IF NOT EXISTS bench_header_record ON header (topition, offset_id)")
            db.commit()
        self.admin = KafkaAdminClient(bootstrap_servers=tansu.address)

    def create(self, topic: str) -> None:
        self.admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
        wait_for(lambda: topic in self.admin.list_topics(), 20, f"topic {topic}")

    def count(self, topic: str) -> int:
        consumer = KafkaConsumer(bootstrap_servers=self.tansu.address, group_id=None)
        try:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            return sum(consumer.end_offsets(tps).values())
        finally:
            consumer.close()

    def messages(self, topic: str) -> list:
        """Every message of `topic` (kafka-python, assign, no group), as Tansu.messages reads them but
        without CRC checks (kafka-python's CRC-32C is pure Python) and with short fetch waits."""
        consumer = KafkaConsumer(bootstrap_servers=self.tansu.address, group_id=None, check_crcs=False,
                                 fetch_max_wait_ms=5, max_partition_fetch_bytes=64 << 20, fetch_max_bytes=64 << 20)
        try:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            ends = consumer.end_offsets(tps)
            out, deadline = [], time.monotonic() + 600
            while any(consumer.position(tp) < ends[tp] for tp in tps):
                assert time.monotonic() < deadline, f"reading {topic}: {len(out)} of {sum(ends.values())} messages after 600 s"
                for batch in consumer.poll(timeout_ms=500).values():
                    out.extend(batch)
            return out
        finally:
            consumer.close()

    def delete(self, *topics: str) -> None:
        """Deletes `topics`. tansu 0.6.0 deletes every topic on any DeleteTopics request (seen here:
        deleting one of three left none), so a topic already gone is no error."""
        for topic in topics:
            if topic in self.admin.list_topics():
                self.admin.delete_topics([topic])

    def close(self) -> None:
        self.admin.close()


def dump(messages, path: Path) -> int:
    """The relay's messages as bench/kafka_producer reads them (src/main.rs: u32 little-endian
    lengths; key, value, headers), in the order the relay produced them: by timestamp, then by
    offset within a partition. Returns the bytes of keys, values and headers."""
    order = sorted(messages, key=lambda m: (m.timestamp, m.partition, m.offset))
    size = 0
    with open(path, "wb") as f:
        for m in order:
            key, value = m.key or b"", m.value or b""
            parts = [struct.pack("<I", len(key)), key, struct.pack("<I", len(value)), value, struct.pack("<I", len(m.headers))]
            for name, v in m.headers:
                name = name.encode()
                parts += [struct.pack("<I", len(name)), name]
                parts += [struct.pack("<I", 0xFFFFFFFF)] if v is None else [struct.pack("<I", len(v)), v]
            chunk = b"".join(parts)
            size += len(key) + len(value) + sum(len(n) + len(v or b"") for n, v in m.headers)
            f.write(chunk)
    return size


def rounds(conn, since: int) -> list:
    """The relay's rounds over the outbox rows after id `since`: (rows, first mark, last mark), the
    marks in epoch seconds. A round's rows are marked by one UPDATE (published_at =
    clock_timestamp(), µs apart), rounds a broker round trip apart: a row marked over 0.3 ms after
    the one before it starts a round."""
    return conn.execute("""
        WITH r AS (SELECT published_at, published_at - lag(published_at) OVER (ORDER BY published_at) > interval '0.3 ms' AS new
                     FROM feature_outbox.outbox WHERE id > %s),
             n AS (SELECT published_at, count(*) FILTER (WHERE new IS NOT FALSE) OVER (ORDER BY published_at) AS round FROM r)
        SELECT count(*), extract(epoch FROM min(published_at))::float8, extract(epoch FROM max(published_at))::float8
          FROM n GROUP BY round ORDER BY round""", (since,)).fetchall()


def kafka_drain(c: Cluster, tansu: Tansu, broker: Broker, topic: str) -> dict:
    """Events/s of the relay draining KAFKA_BACKLOG events to `topic` (made beforehand), from the
    moment it is pointed at the broker until the outbox is drained; the broker's CPU µs per event
    meanwhile; when the first batch was marked (ms after that moment) and the rate from then on.
    The topic must then hold every event once."""
    broker.create(topic)
    configure(c, kafka_topic=topic, kafka_partitions=PARTITIONS)
    with c.connect(DB) as conn:
        since = conn.execute("SELECT coalesce(max(id), 0) FROM feature_outbox.outbox").fetchone()[0]
    fill(c, KAFKA_BACKLOG)
    with c.connect(DB) as conn, BrokerCpu(tansu.proc.pid) as cpu:
        t, wall = time.monotonic(), time.time()
        configure(c, endpoint=tansu.url)
        wait_drained(conn)
        rate = KAFKA_BACKLOG / (time.monotonic() - t)
        marks = rounds(conn, since)
    paused(c)
    arrived = broker.count(topic)
    assert arrived == KAFKA_BACKLOG, f"{arrived} of {KAFKA_BACKLOG} events in topic {topic}"
    first, last = marks[0][2], marks[-1][2]
    return {"rate": rate, "us": cpu.spent * 1e6 / KAFKA_BACKLOG, "first_ms": (first - wall) * 1000,
            "steady": (KAFKA_BACKLOG - marks[0][0]) / (last - first)}


def bare(tansu: Tansu, broker: Broker, topic: str, messages: Path, *mode: str, consumer: bool = False) -> dict:
    """One run of the bare producer: messages of the file to a fresh topic (and its warm-up
    message to `<topic>-warmup`), with a consumer reading the topic meanwhile if asked; its
    figures, once the topic holds every message."""
    broker.create(topic)
    broker.create(f"{topic}-warmup")
    sub = Arrivals(tansu.address, topic) if consumer else None
    try:
        with BrokerCpu(tansu.proc.pid) as cpu:
            out = subprocess.run([str(PRODUCER), tansu.address, topic, str(messages), *mode], check=True,
                                 capture_output=True, text=True, timeout=600).stdout.split()
    finally:
        if sub:
            sub.close()
    figures = {k: float(v) for k, v in zip(out[::2], out[1::2])}
    figures["us"] = cpu.spent * 1e6 / figures["messages"]  # with the warm-up message's, a few ms in all
    arrived = broker.count(topic)
    assert figures["messages"] == arrived, f"{arrived} of {figures['messages']:.0f} messages in topic {topic}"
    broker.delete(topic, f"{topic}-warmup")
    return figures


class Arrivals:
    """A kafka-python consumer on its own thread, reading every partition of `topic` from the
    start (assign, no group) with fetch_max_wait_ms FETCH_WAIT_MS (5): when each (Feature-Id,
    Feature-Version) arrived, and its producer timestamp."""

    def __init__(self, address: str, topic: str):
        self.arrived: dict = {}
        self.sent: dict = {}
        self.stop = threading.Event()
        self.consumer = KafkaConsumer(bootstrap_servers=address, group_id=None, fetch_max_wait_ms=FETCH_WAIT_MS, fetch_min_bytes=1,
                                      auto_offset_reset="earliest", enable_auto_commit=False)
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.is_set():
            for batch in self.consumer.poll(timeout_ms=100).values():
                now, wall = time.monotonic(), time.time()
                for m in batch:
                    h = dict(m.headers)
                    key = (h["Feature-Id"].decode(), h["Feature-Version"].decode())
                    self.arrived.setdefault(key, now)
                    # The producer's timestamp (CreateTime, ms): when the relay handed it to librdkafka.
                    self.sent.setdefault(key, (m.timestamp / 1000, wall))

    def close(self):
        self.stop.set()
        self.thread.join(10)
        self.consumer.close()


def latency(c: Cluster, tansu: Tansu, broker: Broker, counties, topic: str):
    """Edits at RATE/s for LATENCY_S s into a topic the consumer already reads; client-side and
    database-side percentiles (ms)."""
    broker.create(topic)
    configure(c, kafka_topic=topic, kafka_partitions=PARTITIONS, wake_at_commit="on", endpoint=tansu.url)
    sub = Arrivals(tansu.address, topic)
    committed, walls = {}, {}
    try:
        with c.connect(DB) as conn:
            # The worker is connected (an edit relayed) before the clock starts.
            since = conn.execute("SELECT max(id) FROM feature_outbox.outbox").fetchone()[0] or 0
            fid, geometry = counties[0]
            conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'moved')", (fid, geometry))
            wait_drained(conn)
            since = conn.execute("SELECT max(id) FROM feature_outbox.outbox").fetchone()[0]
            start = time.monotonic()
            for i in range(RATE * LATENCY_S):
                due = start + i / RATE
                # Sleep, never spin: a spinning client takes one of the cores from the relay and the broker.
                time.sleep(max(0.0, due - time.monotonic()))
                fid, geometry = counties[i % len(counties)]
                v = conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'moved')", (fid, geometry)).fetchone()[0]
                committed[(str(fid), str(v))] = time.monotonic()
                walls[(str(fid), str(v))] = time.time()
            achieved = len(committed) / (time.monotonic() - start)
        wait_for(lambda: all(k in sub.arrived for k in committed), 60, "every latency event")
    finally:
        sub.close()
    ms = sorted((sub.arrived[k] - t) * 1000 for k, t in committed.items())
    pick = lambda q: ms[min(len(ms) - 1, int(len(ms) * q))]  # noqa: E731
    with c.connect(DB) as conn:
        db = conn.execute("""SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms), max(ms), count(*)
                               FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms
                                       FROM feature_outbox.outbox WHERE id > %s) d""", (since,)).fetchone()
        marks = rounds(conn, since)
        published = {(str(f), str(v)): at for f, v, at in conn.execute(
            "SELECT feature_id, feature_version, extract(epoch FROM published_at)::float8 FROM feature_outbox.outbox WHERE id > %s",
            (since,))}
    gaps = sorted((b[1] - a[1]) * 1000 for a, b in zip(marks, marks[1:]))
    sizes = sorted(n for n, _, _ in marks)
    per_round = (len(marks), sizes[len(sizes) // 2], gaps[len(gaps) // 2], gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))])
    # The client figure in parts, by the wall clock (the producer's timestamp has ms steps): commit to
    # the relay's send, send to the mark (the broker's acknowledgement and the UPDATE), send to the
    # consumer's receipt.
    parts = {"commit → send": [(sub.sent[k][0] - walls[k]) * 1000 for k in committed],
             "send → mark": [(published[k] - sub.sent[k][0]) * 1000 for k in committed],
             "send → receipt": [(sub.sent[k][1] - sub.sent[k][0]) * 1000 for k in committed]}
    parts = {name: (statistics.median(v), sorted(v)[int(len(v) * 0.99)]) for name, v in parts.items()}
    paused(c)
    arrived = broker.count(topic)
    assert db[2] == len(committed) and arrived >= len(committed), (db[2], arrived, len(committed))
    broker.delete(topic)
    return achieved, (pick(0.5), pick(0.95), pick(0.99), ms[-1]), (*db[0], db[1]), per_round, parts


def note(text: str) -> None:
    """Progress on stderr (make bench keeps stdout), with BENCH_VERBOSE set."""
    if os.environ.get("BENCH_VERBOSE"):
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main():
    t0 = time.monotonic()
    build_producer()
    messages = RUN_DIR / "kafka-bench-messages.bin"
    with contextlib.ExitStack() as stack:
        server = NatsServer(RUN_DIR / "kafka-bench-nats")
        server.start()
        stack.callback(server.stop)
        tansu = Tansu(RUN_DIR / "kafka-bench-tansu")
        tansu.start()
        stack.callback(tansu.stop)
        broker = Broker(tansu)
        stack.callback(broker.close)
        c = Cluster(RUN_DIR / "kafka-bench", free_port())
        c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
                "feature_outbox.retention = 0", "feature_outbox.retry_backoff_max = '200ms'", "shared_buffers = '512MB'",
                "max_wal_size = '4GB'", "synchronous_commit = off")
        stack.callback(c.stop)
        c.create_db(DB)
        c.restart()
        counties = load_counties(c)
        wait_for(lambda: memory(c) and len(memory(c)) == 1, 20, "the worker")
        note("cluster ready")
        rates = {k: [] for k in ("k", "steady", "base", "future", "a", "e")}
        cpu = {k: [] for k in ("k", "base", "future", "a")}
        first_ms = []
        connects, size = [], 0
        for r in range(REPEATS):
            topic = f"bench-k{r}"
            k = kafka_drain(c, tansu, broker, topic)
            rates["k"].append(k["rate"])
            rates["steady"].append(k["steady"])
            cpu["k"].append(k["us"])
            first_ms.append(k["first_ms"])
            note(f"relay to Kafka: {k}")
            if r == 0:
                size = dump(broker.messages(topic), messages)
                note(f"dumped {size / 1e6:.1f} MB")
            broker.delete(topic)
            for mode in ("base", "future"):
                b = bare(tansu, broker, f"bench-p{mode}{r}", messages, mode)
                rates[mode].append(b["rate"])
                cpu[mode].append(b["us"])
                connects.append(b["connect_s"])
                note(f"bare producer, {mode}: {b}")
            nats = BrokerCpu(server.proc.pid)
            rates["a"].append(worker_drain(c, server, 1100 + r, meter=nats))
            cpu["a"].append(nats.spent * 1e6 / BACKLOG)
            rates["e"].append(worker_drain(c, server, 1200 + r, sink_url="discard://floor"))
            note(f"JetStream {rates['a'][-1]:,.0f}/s, floor {rates['e'][-1]:,.0f}/s")
        achieved, client, db, per_round, parts = latency(c, tansu, broker, counties, "bench-latency")
        note(f"latency: client {client}, database {db}, rounds {per_round}, parts {parts}")
        # The broker's own send-to-acknowledgement time at the same rate, the same consumer reading.
        floor = bare(tansu, broker, "bench-paced", messages, "paced", str(RATE), str(RATE * LATENCY_S), consumer=True)
        note(f"bare producer paced: {floor}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    p_mode = "p₁, BaseProducer" if med["base"] >= med["future"] else "p₂, FutureProducer"
    p = max(med["base"], med["future"])
    version = subprocess.run([PG_BIN / "postgres", "--version"], capture_output=True, text=True).stdout.split()[2]
    kafka_note = "" if KAFKA_BACKLOG == BACKLOG else f"; the Kafka rows drain {KAFKA_BACKLOG:,} (BENCH_KAFKA_BACKLOG)"
    print(f"{os.cpu_count()} cores, release build, PostgreSQL {version}; tansu 0.6.0 (a Kafka-compatible broker, SQLite "
          f"storage) and nats-server -js on loopback; 1 relay worker, batch_size 1000. A {BACKLOG:,}-row backlog of county "
          f"events{kafka_note}. Median of {REPEATS} runs, min – max in brackets.")
    print()
    busy = lambda k: statistics.median(cpu[k]) * med[k] / 1e6  # noqa: E731 - CPU per event x events/s
    print("| drain | events/s | broker CPU µs/event | broker busy, cores |")
    print("|---|---|---|---|")
    print(f"| (k) feature_outbox, 1 worker, to Kafka | {spread(rates['k'])} | {spread(cpu['k'])} | {busy('k'):.2f} |")
    print(f"| (k′) the same drains, from their first batch's mark to their last | {spread(rates['steady'])} | | |")
    print(f"| (p₁) bare producer: rdkafka 0.39 BaseProducer, polled, no database | {spread(rates['base'])} | "
          f"{spread(cpu['base'])} | {busy('base'):.2f} |")
    print(f"| (p₂) bare producer: FutureProducer, the reports awaited together as the relay does | {spread(rates['future'])} | "
          f"{spread(cpu['future'])} | {busy('future'):.2f} |")
    print(f"| (a) feature_outbox, 1 worker, to JetStream | {spread(rates['a'])} | {spread(cpu['a'])} (nats-server) | {busy('a'):.2f} |")
    print(f"| (e) in-worker floor: the worker's claim and mark, discard sink | {spread(rates['e'])} | | |")
    print()
    print(f"k/p = {med['k'] / p:.2f} (target ≥ 0.8; p = {p_mode}, the faster), k′/p = {med['steady'] / p:.2f}; "
          f"a/e = {med['a'] / med['e']:.2f}.")
    print(f"The relay marked its first batch {statistics.median(first_ms):,.0f} ms (median; {min(first_ms):,.0f} – "
          f"{max(first_ms):,.0f}) after it was pointed at the broker (a new producer each drain); each batch of 1,000 then "
          f"took {1000 / med['steady'] * 1000:,.0f} ms, the bare producer {1000 / p * 1000:,.0f} ms per 1,000.")
    print(f"Both Kafka producers: one topic of {PARTITIONS} partition{'s' if PARTITIONS > 1 else ''}, made before the "
          f"drain, fresh per run; acks=all, idempotence, murmur2_random, linger.ms 1. The bare producer sends the relay's "
          f"own {KAFKA_BACKLOG:,} messages, read back from the relay's first topic (keys, values and headers: "
          f"{size / 1e6:,.0f} MB, {size / max(1, KAFKA_BACKLOG):,.0f} bytes a message), all in flight, timed from the first "
          f"send to the last delivery report (making the producer and a warm-up message took "
          f"{statistics.median(connects) * 1000:.0f} ms more); the relay is timed from the moment it is pointed at the "
          f"broker until the outbox is drained. Every run counted its {KAFKA_BACKLOG:,} messages in its own topic (end "
          f"offsets). tansu's storage has an index added on its header table (none in 0.6.0: reading a topic back "
          f"scanned every stored header for each message).")
    print()
    print(f"Commit-to-acknowledgement latency: county polygons at {RATE:,} edits/s for {LATENCY_S} s "
          f"({achieved:,.0f}/s achieved), 1 worker, wake_at_commit on, one topic of {PARTITIONS} partition{'s' if PARTITIONS > 1 else ''}:")
    print()
    print("| clock | p50 ms | p95 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    print("| database: `published_at - created_at` (marked after the broker's acknowledgement) | "
          + " | ".join(f"{v:.2f}" for v in db[:3]) + f" | {db[3]:.1f} |")
    print(f"| client: edit_feature's return to a kafka-python consumer's receipt (fetch_max_wait_ms {FETCH_WAIT_MS}) | "
          + " | ".join(f"{v:.2f}" for v in client[:3]) + f" | {client[3]:.1f} |")
    print(f"| bare producer alone, {RATE:,} of the relay's messages/s: send to delivery report (the broker's own) | "
          + " | ".join(f"{floor[k]:.2f}" for k in ("p50_ms", "p95_ms", "p99_ms")) + f" | {floor['max_ms']:.1f} |")
    print()
    print(f"Target: p99 ≤ 10 ms. The relay marked the run's rows in {per_round[0]:,} rounds of {per_round[1]:.0f} rows (median), "
          f"{per_round[2]:.1f} ms apart (median; p99 {per_round[3]:.1f} ms): a row committed during a round waits for the next. "
          "The client figure in parts, by the wall clock (the relay's send is the message's producer timestamp, in whole ms), "
          "p50 / p99 ms: " + ", ".join(f"{name} {p50:.1f} / {p99:.1f}" for name, (p50, p99) in parts.items()) + ". "
          "The consumer reads the topic during both the relay's run and the bare producer's.")
    print()
    print(f"Run time: {(time.monotonic() - t0) / 60:.1f} min.")


if __name__ == "__main__":
    main()
