"""A Kafka-compatible broker for the tests: tansu (cargo install tansu@0.6.0 --features libsql, built into
the per-machine tool cache by scripts/tools.sh), with SQLite storage so that a stopped broker keeps
its topics, and a reader that shares no code with the relay's producer (kafka-python, whose
partitioner is the Java client's murmur2)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.partitioner.default import murmur2

from conftest import free_port, tools
from drills import port_open
from relay_harness import wait_for



LOG_LIMIT = 20 * 1024 * 1024


def keep_log(pipe, path: Path) -> None:
    """Copies the broker's output to `path`, up to LOG_LIMIT bytes, and drops the rest: tansu can
    log an error per request in a loop (a client that keeps retrying), tens of GB in minutes."""
    kept = 0
    with open(path, "ab") as out:
        for line in iter(pipe.readline, b""):
            if kept < LOG_LIMIT:
                out.write(line)
                out.flush()
                kept += len(line)


class Tansu:
    """One broker on its own port; `start` after `stop` serves the same storage again.
    `authentication`: clients must log in with SASL/SCRAM (`add_user`). `advertise`: the address
    the broker hands out in metadata, for a broker behind a proxy (TlsProxy)."""

    def __init__(self, directory: Path, authentication: bool = False, advertise: str | None = None):
        self.binary = tools("tansu")["tansu"]
        self.dir = directory
        self.port = free_port()
        self.proc = None
        self.authentication = authentication
        self.advertise = advertise
        # What a kafka-python client needs to talk to this broker (SASL once users exist).
        self.client: dict = {}
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.address}"

    def start(self) -> None:
        listener = f"tcp://{self.address}"
        advertised = f"tcp://{self.advertise or self.address}"
        log = self.dir / "tansu.log"
        before = log.read_text().count("ready in") if log.exists() else 0
        # The storage URL is relative to the broker's working directory.
        self.proc = subprocess.Popen([self.binary, "broker", "--listener-url", listener, "--advertised-listener-url", advertised,
                                      "--storage-engine", "sqlite://tansu.db",
                                      *(["--authentication"] if self.authentication else [])], cwd=self.dir,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=keep_log, args=(self.proc.stdout, log), daemon=True).start()
        wait_for(lambda: log.exists() and log.read_text().count("ready in") > before, 20, "tansu to start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL: the broker dies mid-request; its SQLite storage keeps what it acknowledged."""
        if self.proc:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers, as a broker behind a dead network."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def add_user(self, name: str, password: str) -> None:
        """A SCRAM-SHA-512 user, stored by the broker (tansu's own `user create`). tansu takes it only
        from an unauthenticated client, so a broker that requires SASL is restarted without it for
        the moment; its storage keeps the credentials."""
        required = self.authentication
        if required:
            self.stop()
            self.authentication = False
            self.start()
        try:
            subprocess.run([self.binary, "user", "create", "--broker", f"tcp://{self.address}", "--mechanism", "scram512", name, password],
                           check=True, capture_output=True, timeout=30)
        finally:
            if required:
                self.stop()
                self.authentication = True
                self.start()
        self.client = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                       "sasl_plain_username": name, "sasl_plain_password": password}

    def topics(self) -> list[str]:
        admin = KafkaAdminClient(bootstrap_servers=self.address, **self.client)
        try:
            return sorted(admin.list_topics())
        finally:
            admin.close()

    def messages(self, topic: str, timeout: float = 60) -> list:
        """Every message of `topic`, partition by partition in offset order: read up to each
        partition's end offset as the broker reports it. assign(), not a group: tansu's group
        coordination is slow to hand out partitions."""
        import time
        # A producer's record batch can be larger than kafka-python's 1 MB per partition, and tansu
        # returns nothing rather than the first batch whole (Kafka's KIP-74 rule): fetch more.
        consumer = KafkaConsumer(bootstrap_servers=self.address, auto_offset_reset="earliest", group_id=None,
                                 max_partition_fetch_bytes=16 * 1024 * 1024, fetch_max_bytes=64 * 1024 * 1024,
                                 **self.client)
        try:
            deadline = time.time() + timeout
            parts = None
            while not parts and time.time() < deadline:
                parts = consumer.partitions_for_topic(topic)
                if not parts:
                    time.sleep(0.2)
            tps = [TopicPartition(topic, p) for p in sorted(parts or ())]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            ends = consumer.end_offsets(tps)
            out = []
            while any(consumer.position(tp) < ends[tp] for tp in tps):
                if time.time() > deadline:
                    raise TimeoutError(f"reading {topic}: {[(tp.partition, consumer.position(tp), ends[tp]) for tp in tps]}")
                for batch in consumer.poll(timeout_ms=500).values():
                    out.extend(batch)
            return sorted(out, key=lambda m: (m.partition, m.offset))
        finally:
            consumer.close()


def java_partition(key: bytes, partitions: int) -> int:
    """The partition Java's default partitioner gives a keyed message (murmur2, positive, modulo)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class TlsProxy:
    """nginx's stream module terminating TLS in front of a broker that serves none (tansu), with a
    certificate of a private CA. The broker must advertise the proxy's address, so that clients
    come back through it after reading metadata."""

    def __init__(self, directory: Path, cert: Path, key: Path):
        self.dir = directory
        self.port = free_port()
        self.cert, self.key = cert, key
        self.proc = None
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, upstream: str) -> None:
        module = next(p for p in ("/usr/lib/nginx/modules/ngx_stream_module.so", "/usr/share/nginx/modules/ngx_stream_module.so")
                      if Path(p).exists())
        conf = self.dir / "nginx.conf"
        conf.write_text(f"""load_module {module};
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log info;
events {{ worker_connections 256; }}
stream {{
    server {{
        listen 127.0.0.1:{self.port} ssl;
        ssl_certificate {self.cert};
        ssl_certificate_key {self.key};
        proxy_pass {upstream};
    }}
}}
""")
        self.proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(self.dir), "-e", str(self.dir / "error.log")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "stderr.log", "a"))
        wait_for(lambda: port_open(self.port), 10, "nginx's TLS proxy to listen")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
