"""The cache destination of expire outputs (issue 40) against real servers: Martin 1.14.0 serving the
layer's table behind Debian's Varnish running the VCL of docs/src/tile-caches.md, and hitch for TLS.
After 100 edits of every kind, every warmed tile fetched through Varnish equals the same tile fetched
from Martin directly (decoded), and the cached tiles the edits did not expire are still cache hits.
A cache that refuses purges (4xx) parks the edits; one that answers 5xx is retried and loses none."""

import http.server
import threading

import pytest

from conftest import RUN_DIR
from relay_harness import configure, make_tls, nats_fixture, wait_for
from tile_cache_harness import Hitch
from tile_cache_run import DB, OUTPUT, SOURCE, apply, drained, plan, run, stack_for

nats_server = nats_fixture("nats_tile_cache")


@pytest.fixture(scope="module")
def stack(nats_server):
    with stack_for("tile_cache", nats_server.url) as s:
        yield s


def backlog(stack):
    with stack.c.connect(DB) as conn:
        return conn.execute(f"""SELECT waiting_edits, parked_edits, purge_requests, last_error
                                  FROM feature_outbox.expire_backlog WHERE output = '{OUTPUT}'""").fetchone()


def test_every_warmed_tile_through_varnish_equals_a_fresh_render(stack):
    r = run(stack, edits=100, sample=300)
    assert r.checked > 500 and r.expired > 0, r
    assert set(r.kinds) == {"created", "moved", "updated", "retired"}, r.kinds
    assert not r.stale, f"{len(r.stale)} of {r.checked} tiles stale through Varnish, e.g. {r.stale[:5]}"
    # Nothing else thrown away: the cached tiles outside the expired set are still cache hits.
    assert r.kept > 100 and r.kept_hits >= 0.99 * r.kept, f"{r.kept_hits} of {r.kept} unexpired tiles still cached"
    # xkey: many tiles per request.
    assert 0 < r.purge_requests < r.expired, r
    assert r.parked == 0


def test_a_refused_purge_parks_the_edits_and_retry_parked_sends_them(stack):
    """A wrong secret: Varnish answers 403, each edit counts a failure, and at max_attempts (2 here)
    the edits park; expire_backlog shows them. With the secret fixed, retry_parked() delivers."""
    wrong = RUN_DIR / "tile_cache" / "wrong-secret"
    wrong.write_text("not-the-secret\n")
    configure(stack.c, max_attempts=2, cache_secret_file=str(wrong))
    try:
        import time
        time.sleep(0.5)
        apply(stack, plan(stack, 5, __import__("random").Random(11)))
        wait_for(lambda: backlog(stack)[1] > 0, 30, "the refused edits to park")
        waiting, parked, _, error = backlog(stack)
        assert parked > 0 and "403" in error, (waiting, parked, error)
        configure(stack.c, cache_secret_file=str(RUN_DIR / "tile_cache" / "cache-secret"))
        time.sleep(0.5)
        with stack.c.connect(DB) as conn:
            assert conn.execute("SELECT feature_outbox.retry_parked()").fetchone()[0] >= parked
            wait_for(lambda: drained(conn), 30, "the parked edits to be purged after retry_parked()")
        assert backlog(stack)[1] == 0
    finally:
        configure(stack.c, max_attempts=None, cache_secret_file=str(RUN_DIR / "tile_cache" / "cache-secret"))


class Flaky(http.server.BaseHTTPRequestHandler):
    """Answers PURGE with 503 (Retry-After: 1) the first `fail` times, then 200; counts requests."""
    fail = 3
    seen = []

    def do_PURGE(self):
        Flaky.seen.append(self.headers.get("xkey-purge", ""))
        status = 503 if len(Flaky.seen) <= Flaky.fail else 200
        self.send_response(status)
        if status == 503:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_cache_answering_503_is_retried_and_nothing_parks(stack):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Flaky.seen = []
    url = f"http://127.0.0.1:{server.server_address[1]}/{SOURCE}/{{z}}/{{x}}/{{y}}"
    with stack.c.connect(DB) as conn:
        conn.execute(f"SELECT feature_outbox.define_expire_output('flaky', 14, cache_url => %s)", (url,))
        conn.execute(f"SELECT feature_outbox.expire_layer('{SOURCE}', 'flaky')")
    try:
        apply(stack, plan(stack, 3, __import__("random").Random(12)))
        with stack.c.connect(DB) as conn:
            wait_for(lambda: drained(conn), 60, "the flaky cache to take the purges")
            row = conn.execute("""SELECT parked_edits, purge_requests, last_error FROM feature_outbox.expire_backlog
                                   WHERE output = 'flaky'""").fetchone()
        assert row[0] == 0 and row[1] > 0 and "503" in row[2], row
        assert len(Flaky.seen) > Flaky.fail and all(Flaky.seen), len(Flaky.seen)
    finally:
        with stack.c.connect(DB) as conn:
            conn.execute("SELECT feature_outbox.drop_expire_output('flaky')")
        server.shutdown()


def test_purges_over_tls_through_hitch_with_a_private_ca(stack):
    ca, cert, key = make_tls(RUN_DIR / "tile_cache_tls")
    hitch = Hitch(RUN_DIR / "tile_cache_hitch", cert, key, stack.varnish.port)
    hitch.start()
    try:
        configure(stack.c, tls_ca_file=str(ca))
        with stack.c.connect(DB) as conn:
            conn.execute(f"SELECT feature_outbox.define_expire_output('{OUTPUT}', 14, cache_url => %s, "
                         "\"table\" => 'public.cache_tiles')", (hitch.url(SOURCE),))
        r = run(stack, edits=20, sample=100, seed=21)
        assert not r.stale and r.expired > 0 and r.purge_requests > 0, r
    finally:
        configure(stack.c, tls_ca_file=None)
        with stack.c.connect(DB) as conn:
            conn.execute(f"SELECT feature_outbox.define_expire_output('{OUTPUT}', 14, cache_url => %s, "
                         "\"table\" => 'public.cache_tiles')", (stack.varnish.url(SOURCE),))
        hitch.stop()


def test_cache_method_purge_sends_one_purge_per_tile_url(stack):
    """cache_method 'purge': Varnish's built-in purge of one URL per request, through the same VCL."""
    with stack.c.connect(DB) as conn:
        conn.execute(f"SELECT feature_outbox.define_expire_output('{OUTPUT}', 14, cache_url => %s, cache_method => 'purge', "
                     "\"table\" => 'public.cache_tiles')", (stack.varnish.url(SOURCE),))
    try:
        r = run(stack, edits=8, sample=100, seed=41)
        assert not r.stale and r.expired > 0, r
        with stack.c.connect(DB) as conn:
            tiles = conn.execute("SELECT count(*) FROM public.cache_tiles").fetchone()[0]
        # One request per tile of each chunk: every distinct expired tile at least once (a tile two
        # chunks expire is purged twice).
        assert r.purge_requests >= tiles > 0, (r.purge_requests, tiles)
    finally:
        with stack.c.connect(DB) as conn:
            conn.execute(f"SELECT feature_outbox.define_expire_output('{OUTPUT}', 14, cache_url => %s, "
                         "\"table\" => 'public.cache_tiles')", (stack.varnish.url(SOURCE),))
