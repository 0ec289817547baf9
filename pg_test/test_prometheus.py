"""Monitoring end to end with real parts (issue 53): Debian's Prometheus scraping Debian's
prometheus-postgres-exporter, each configured with the Monitoring page's own blocks (queries.yaml,
the exporter's command line, prometheus.yml) and loading prometheus/feature_outbox.rules.yml, against
a primary serving two databases and its streaming standby. Healthy, no alert is pending or firing
on either member; with the relay's sink (NATS) stopped, sink down and relay stalled fire for both
databases of the primary and nothing fires for the standby.

The short form (make test) changes only ports, paths, intervals (1 s) and the rules' `for` windows
and stall threshold (to seconds), so the whole runs in about a minute. The full form (make faults,
FEATURE_OUTBOX_ALERTS_FULL=1) runs the shipped rules and the page's intervals unchanged: about 15
minutes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import RUN_DIR, Cluster, free_port, tools
from docs_examples import DOCS, blocks
from drills import port_open
from relay_harness import NatsServer, wait_for
from standby_harness import make_standby, wait_replayed

DATABASES = ("gis", "parcels")
RULES = Path(__file__).resolve().parents[1] / "prometheus" / "feature_outbox.rules.yml"
FULL = os.environ.get("FEATURE_OUTBOX_ALERTS_FULL") == "1"
STALL_SECONDS = 300 if FULL else 5   # the shipped rules' stall threshold, or the short form's
WINDOW_SECONDS = 120 if FULL else 3  # the longest `for` window of the shipped rules, or the short form's


def page_block(lang: str, flags: str) -> str:
    [block] = [b.body for b in blocks(DOCS / "monitoring.md") if b.lang == lang and b.flags.startswith(flags)]
    return block


def short_rules(directory: Path) -> Path:
    """The shipped rules with seconds for minutes: each `for` window WINDOW_SECONDS, the stall
    threshold STALL_SECONDS. Everything else as shipped. The full form takes them as shipped."""
    if FULL:
        return RULES
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{WINDOW_SECONDS}s"
            if rule["alert"] == "FeatureOutboxRelayStalled":
                assert "> 300" in rule["expr"]
                rule["expr"] = rule["expr"].replace("> 300", f"> {STALL_SECONDS}")
    path = directory / "feature_outbox.rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


class Exporter:
    """prometheus-postgres-exporter beside one member, started with the page's command line."""

    def __init__(self, directory: Path, member: Cluster, queries: Path):
        self.port = free_port()
        command = page_block("sh", "norun: a long-running server").replace("\\\n", " ")
        command = (command.replace("port=5432", f"port={member.port}")
                   .replace("/etc/prometheus/feature_outbox-queries.yaml", str(queries))
                   .replace("--web.listen-address=:9187", f"--web.listen-address=127.0.0.1:{self.port}"))
        assert f"port={member.port}" in command and str(queries) in command and str(self.port) in command, command
        self.log = directory / f"exporter-{self.port}.log"
        # exec env: the page's VAR=value prefix, and the exporter as the process stop() signals
        self.proc = subprocess.Popen(["bash", "-c", f"exec env {command}"], stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        wait_for(lambda: port_open(self.port), 20, "the exporter to listen")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def scrape(self) -> str:
        return urllib.request.urlopen(f"http://{self.target}/metrics", timeout=10).read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Prometheus:
    """Debian's prometheus with the page's prometheus.yml: its targets, intervals and rule file set
    for the test."""

    def __init__(self, directory: Path, targets: list[str], rules: Path):
        binary = tools("prometheus")["prometheus"]
        self.port = free_port()
        config = yaml.safe_load(page_block("yaml", "prometheus.yml"))
        if not FULL:
            config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(rules)]
        [job] = config["scrape_configs"]
        job["static_configs"] = [{"targets": targets}]
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen([binary, f"--config.file={directory / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={directory / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=open(directory / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        wait_for(lambda: port_open(self.port), 30, "Prometheus to listen")

    def api(self, path: str) -> dict:
        body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/v1/{path}", timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query?query=" + urllib.request.quote(expr))["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


@pytest.fixture
def stack():
    run = RUN_DIR / "prometheus"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    started = []
    nats = NatsServer(run / "nats")
    nats.start()
    primary = Cluster(run / "primary", free_port())
    primary.start(f"feature_outbox.database = '{','.join(DATABASES)}'", f"feature_outbox.endpoint = '{nats.url}'",
                  "feature_outbox.poll_interval = '1s'", "feature_outbox.retry_backoff_max = '1s'")
    started.append(primary)
    try:
        for db in DATABASES:
            primary.create_db(db)
            with primary.connect(db) as conn:
                conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        standby = make_standby(primary, run / "standby")
        started.append(standby)
        queries = run / "feature_outbox-queries.yaml"
        queries.write_text(page_block("yaml", "queries.yaml"))
        exporters = [Exporter(run, primary, queries), Exporter(run, standby, queries)]
        started += exporters
        prometheus = Prometheus(run, [e.target for e in exporters], short_rules(run))
        started.append(prometheus)
        yield {"nats": nats, "primary": primary, "standby": standby, "exporters": exporters, "prometheus": prometheus}
    finally:
        for part in reversed(started):
            part.stop()
        nats.stop()


def edit(c: Cluster, db: str, first: int, n: int) -> None:
    with c.connect(db) as conn:
        conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,45]}', i %% 170), 'created')
                          FROM generate_series(%s::bigint, %s::bigint) i""", (first, first + n - 1))


def test_healthy_members_fire_nothing_and_a_stopped_sink_fires_on_the_primary_alone(stack):
    prometheus, primary, standby = stack["prometheus"], stack["primary"], stack["standby"]
    [on_primary, on_standby] = [e.target for e in stack["exporters"]]

    # One scrape per member carries both databases, in valid exposition (promtool check metrics).
    promtool = Path(tools("prometheus")["prometheus"]).with_name("promtool")
    for exporter in stack["exporters"]:
        text = exporter.scrape()
        check = subprocess.run([promtool, "check", "metrics"], input=text, text=True, capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert {m for m in re.findall(r'^outbox_unpublished_rows\{database="(\w+)"', text, re.M)} == set(DATABASES), text
        assert "pg_exporter_last_scrape_error 0" in text, text

    # Healthy, with edits relayed: both members scraped, nothing pending or firing for 3 windows.
    for db in DATABASES:
        edit(primary, db, 1, 20)
    wait_for(lambda: len(prometheus.query("outbox_server_in_recovery")) == 4, 60, "Prometheus to scrape both members")
    roles = {(r["metric"]["instance"], r["metric"]["database"]): r["value"][1] for r in prometheus.query("outbox_server_in_recovery")}
    assert roles == {(on_primary, db): "0" for db in DATABASES} | {(on_standby, db): "1" for db in DATABASES}
    assert {(r["metric"]["instance"], r["metric"]["database"]) for r in prometheus.query("outbox_sink_up")} == \
        {(on_primary, db) for db in DATABASES}, "sink samples come from the primary alone"
    quiet_until = time.monotonic() + 2 * WINDOW_SECONDS + (60 if FULL else STALL_SECONDS)
    while time.monotonic() < quiet_until:
        assert prometheus.alerts() == [], prometheus.alerts()
        time.sleep(0.5)

    # NATS stops; edits go on in both databases.
    stopped = time.monotonic()
    stack["nats"].stop()
    for db in DATABASES:
        edit(primary, db, 101, 10)
    wait_replayed(primary, standby)
    want = {(alert, db) for alert in ("FeatureOutboxSinkDown", "FeatureOutboxRelayStalled") for db in DATABASES}

    def firing() -> set:
        got = [a for a in prometheus.alerts() if a["state"] == "firing"]
        assert all(a["labels"]["instance"] == on_primary for a in got), got
        return {(a["labels"]["alertname"], a["labels"]["database"]) for a in got}
    # Within the stall threshold, its window and a few scrape and evaluation intervals.
    bound = STALL_SECONDS + WINDOW_SECONDS + (60 if FULL else 15)
    while not firing() >= want:
        assert time.monotonic() - stopped < bound, f"after {bound} s firing only {firing()}"
        time.sleep(0.5)
    took = time.monotonic() - stopped
    print(f"\nsink down and stalled firing {took:.1f} s after NATS stopped (stall {STALL_SECONDS} s, for {WINDOW_SECONDS} s)")
    assert took < bound
    assert firing() == want, firing()
    # At least the stall threshold and a window passed: the alerts did not fire early.
    assert took >= STALL_SECONDS
