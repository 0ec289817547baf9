"""The alert rules that ship (prometheus/feature_outbox.rules.yml) pass promtool check rules and
promtool test rules (Debian's prometheus, installed by scripts/tools.sh), and every series the unit
tests feed them is one that metrics() really prints, with the same labels: a rule tested on a series
that does not exist would never fire."""

import re
import subprocess
from pathlib import Path

import yaml

from conftest import ROOT, tools

RULES = ROOT / "prometheus" / "feature_outbox.rules.yml"
RULE_TESTS = ROOT / "prometheus" / "feature_outbox.rules.test.yml"
SCRAPE_LABELS = {"instance", "job"}


def promtool(*args: str) -> str:
    binary = Path(tools("prometheus")["prometheus"]).with_name("promtool")
    out = subprocess.run([binary, *args], cwd=RULES.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, out.stdout
    return out.stdout


def test_promtool_check_rules():
    assert "SUCCESS: 10 rules found" in promtool("check", "rules", RULES.name)


def test_promtool_test_rules():
    assert "SUCCESS" in promtool("test", "rules", RULE_TESTS.name)


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    checks = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    for alert in alerts:
        assert any(c["alertname"] == alert and c["exp_alerts"] for c in checks), f"{alert} is never shown firing"
        assert any(c["alertname"] == alert and not c["exp_alerts"] for c in checks), f"{alert} is never shown quiet"


def parse_series(text: str) -> tuple[str, frozenset[str]]:
    m = re.fullmatch(r"(\w+)\{(.*)\}", text.strip())
    assert m, text
    return m[1], frozenset(re.findall(r'(\w+)="', m[2]))


def test_the_tested_series_are_what_metrics_prints(cluster):
    cluster.create_db("alerts")
    with cluster.connect("alerts") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        text = conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
    typed = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    printed = {parse_series(line.split(" ")[0]) for line in text.splitlines() if line and not line.startswith("#")}
    fed = {parse_series(s["series"]) for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for s in t["input_series"]}
    for name, labels in sorted(fed):
        assert name in typed, f"the rule tests feed {name}, which metrics() does not print"
        assert SCRAPE_LABELS <= labels, f"{name} in the rule tests lacks the labels a scrape adds"
        real = {l for n, l in printed if n == name}
        # A series with no sample here (a sink's last success before any) is checked by its sibling.
        assert not real or labels - SCRAPE_LABELS in real, f"{name}: rule tests use {sorted(labels)}, metrics() {real}"
    # The rules themselves name only series that metrics() prints.
    used = set(re.findall(r"\b(outbox_\w+)", RULES.read_text()))
    assert used <= typed, f"the rules use series metrics() does not print: {sorted(used - typed)}"
