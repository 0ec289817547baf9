"""Event content is the committed row (issue 20, item 1). Four connections edit their own features,
one transaction per edit (created, then moved), while two relay workers, woken at each commit,
publish to a real nats-server. Every event that arrives is checked against what the editors
committed: its geometry and properties are the row as committed at its geometry_version, that
version is never below the event's own, and nothing is null for a row that exists.

Before the fix, about 1 event in 50 arrived with geometry, properties, geometry_version and bbox
null: the claim saw an outbox row that the layer read, under an older snapshot, did not."""

import json
import random
import threading

import pytest

from relay_harness import all_published, consume, nats_fixture, relay_cluster, wait_for

DB = "content"
CONNECTIONS, EDITS = 4, 300
ROUNDS = 5

nats_server = nats_fixture("nats_content")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("content", DB, "feature_outbox.relay_workers = 2", "feature_outbox.wake_at_commit = on",
                      "feature_outbox.poll_interval = '60s'", f"feature_outbox.endpoint = '{nats_server.url}'",
                      setup=("CREATE SCHEMA app",
                             """CREATE TABLE app.parcels (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                                                          version integer NOT NULL DEFAULT 0, name text)""",
                             "SELECT feature_outbox.register_layer('parcels', 'app.parcels', properties => '{name}')"))
    yield c
    c.stop()


def edit_all(c, layer: str, first: int) -> dict:
    """CONNECTIONS threads, each EDITS one-transaction edits of its own features: created, then moved.
    Returns {(feature_id, version): (coordinates, properties)} of every committed version."""
    committed = {}
    lock = threading.Lock()
    errors = []

    def editor(n: int):
        rng = random.Random(first + n)
        ids = [first + n * EDITS + i for i in range(EDITS // 2)]
        try:
            with c.connect(DB) as conn:
                for step in range(EDITS):
                    fid = ids[step % len(ids)]
                    event = "created" if step < len(ids) else "moved"
                    xy = [round(rng.uniform(-170, 170), 6), round(rng.uniform(-70, 70), 6)]
                    geometry = json.dumps({"type": "Point", "coordinates": xy})
                    if layer == "features":
                        [(version,)] = conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, %s)",
                                                    (fid, geometry, event)).fetchall()
                        props = {}
                    else:
                        props = {"name": f"parcel {fid} {event} {step}"}
                        [(version,)] = conn.execute("SELECT feature_outbox.edit_feature(%s, %s, %s::text, %s, %s)",
                                                    (layer, fid, geometry, event, json.dumps(props))).fetchall()
                    with lock:
                        committed[(fid, version)] = (xy, props)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=editor, args=(n,)) for n in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return committed


@pytest.mark.parametrize("round_", range(ROUNDS))
@pytest.mark.parametrize("layer", ["parcels", "features"])
def test_every_event_carries_its_row_as_committed(relay, nats_server, layer, round_):
    first = 1_000_000 * (1 + round_) + (0 if layer == "features" else 500_000)
    committed = edit_all(relay, layer, first)
    assert len(committed) == CONNECTIONS * EDITS
    with relay.connect(DB) as conn:
        wait_for(lambda: all_published(conn), 60, "the relay to publish every edit")
        outbox = {str(r[0]): (r[1], r[2]) for r in conn.execute(
            "SELECT event_id, feature_id, feature_version FROM feature_outbox.outbox WHERE layer = %s AND feature_id >= %s",
            (layer, first))}
    events = [m["event"] for m in consume([nats_server.url], [f"features.{layer}.*.>"])
              if m["subject"].split(".")[2] != "departed" and m["event"]["layer"] == layer and int(m["event"]["feature_id"]) >= first
              and int(m["event"]["feature_id"]) < first + CONNECTIONS * EDITS]
    assert sorted(e["event_id"] for e in events) == sorted(outbox), "every outbox row arrived, once"
    bad = []
    for e in events:
        fid, version = outbox[e["event_id"]]
        assert int(e["feature_id"]) == fid and e["event_version"] == version
        gv = e["geometry_version"]
        if gv is None or e["geometry"] is None or e["properties"] is None or e["bbox"] is None:
            bad.append(f"{e['action']} {fid} v{version}: content null for a row that exists")
            continue
        if gv < version:
            bad.append(f"{e['action']} {fid} v{version}: geometry_version {gv} is below the event's")
            continue
        xy, props = committed[(fid, gv)]
        if e["geometry"] != {"type": "Point", "coordinates": xy} or e["properties"] != props:
            bad.append(f"{e['action']} {fid} v{version}: content {e['geometry']} {e['properties']} "
                       f"is not version {gv} as committed ({xy} {props})")
        elif e["bbox"] != [xy[0], xy[1], xy[0], xy[1]]:
            bad.append(f"{e['action']} {fid} v{version}: bbox {e['bbox']} is not the point's")
    assert not bad, f"{len(bad)} of {len(events)} events are wrong:\n" + "\n".join(bad[:20])
