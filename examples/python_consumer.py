"""A durable JetStream consumer of feature_outbox events, with nats-py (2.x).

Each event is applied once (by event_id: the relay delivers at least once, and a departure notice
carries the same body again), and per feature the highest version wins, keyed as the book says:
(database_id, layer, registration_id, feature_id) -- docs/src/events.md, "The consumer's key".
A consumer that leaves database_id out mixes up the features of two databases that relay into one
stream (a restored copy resolved as a new source, or two databases with the same layer).

    python examples/python_consumer.py nats://127.0.0.1:4222 [STREAM] [DURABLE]

The book includes this file (events.md); pg_test/test_identity.py runs it against a real stream.
"""

import asyncio
import json
import sys

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy


def key(event: dict) -> tuple:
    """The consumer's key: versions count per database, layer registration and feature."""
    return (event["database_id"], event["layer"], event["registration_id"], event["feature_id"])


def apply(event: dict, seen: set, latest: dict) -> bool:
    """Keeps `event` if it is new and the newest of its feature; True if it changed `latest`.
    In production `seen` and `latest` are tables, updated in the same transaction as the effect."""
    if event["event_id"] in seen:
        return False
    seen.add(event["event_id"])
    k = key(event)
    if k in latest and latest[k]["event_version"] >= event["event_version"]:
        return False  # stale: an older version arrived late
    latest[k] = event
    return True


async def consume(url: str, stream: str = "FEATURES", durable: str = "python-consumer",
                  seen: set | None = None, latest: dict | None = None, idle: float = 2.0) -> dict:
    """Reads the stream through the durable consumer `durable` (created if missing; a restart
    resumes after the last acknowledged message) until no message came for `idle` seconds."""
    seen = set() if seen is None else seen
    latest = {} if latest is None else latest
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_consumer(stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                                 deliver_policy=DeliverPolicy.ALL))
    sub = await js.pull_subscribe_bind(durable, stream)
    while True:
        try:
            msgs = await sub.fetch(100, timeout=idle)
        except nats.errors.TimeoutError:
            break
        for msg in msgs:
            apply(json.loads(msg.data), seen, latest)
            await msg.ack()  # after the effect: a crash before it redelivers, and apply skips it
    await nc.close()
    return latest


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222"
    latest = asyncio.run(consume(url, *sys.argv[2:4]))
    for (database_id, layer, registration_id, feature_id), e in sorted(latest.items()):
        print(f"{e['database']} ({database_id}) {layer}/{registration_id} feature {feature_id}: "
              f"version {e['event_version']} {e['action']}")
