"""A tile server behind an HTTP cache, for the cache destination's tests (issue 40): Martin 1.14.0
(built by scripts/tools.sh into the per-machine tool cache, its own tile cache off), Debian's
Varnish with the VCL of docs/src/tile-caches.md (only its backend port changed), and Debian's hitch
for TLS in front of Varnish. Tiles are compared decoded (mapbox-vector-tile): Martin's query has no
ORDER BY, so a layer's features are compared as a multiset."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import mapbox_vector_tile

from conftest import free_port, tools
from drills import port_open
from docs_examples import DOCS, blocks
from relay_harness import wait_for

SECRET = "change-me"  # the documented VCL's


def lon_lat_to_tile(lon: float, lat: float, z: int) -> tuple[int, int]:
    """The XYZ tile (x, y) at zoom `z` holding a point in degrees (slippy-map math, clamped to the grid)."""
    n = 2 ** z
    x = int((lon + 180.0) / 360.0 * n)
    y = int((1.0 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2.0 * n)
    return min(max(x, 0), n - 1), min(max(y, 0), n - 1)


def documented_vcl(backend_port: int) -> str:
    """The one `vcl` block of the Tile caches page, its backend pointed at `backend_port`."""
    [vcl] = [b.body for b in blocks(DOCS / "tile-caches.md") if b.lang == "vcl"]
    assert '.port = "3000";' in vcl, "the documented VCL's backend is Martin's default port"
    return vcl.replace('.port = "3000";', f'.port = "{backend_port}";')


class Martin:
    """Martin serving one table as a source of its name, its tile cache off, with the feature id and
    the properties named (Martin would publish every column, the layer's version among them: that
    column changes wherever a feature lies at each edit; see docs/src/tile-caches.md)."""

    def __init__(self, directory: Path, dsn: str, table: str, properties: dict[str, str], srid: int = 4326,
                 id_column: str = "id"):
        self.binary = tools("martin")["martin"]
        self.dir, self.dsn = directory, dsn
        self.port = free_port()
        self.proc = None
        directory.mkdir(parents=True, exist_ok=True)
        props = "".join(f"        {k}: {v}\n" for k, v in properties.items())
        (directory / "martin.yaml").write_text(f"""listen_addresses: '127.0.0.1:{self.port}'
cache_size_mb: 0
worker_processes: 2
postgres:
  connection_string: '{dsn}'
  auto_publish: false
  auto_bounds: skip
  tables:
    {table}:
      schema: public
      table: {table}
      srid: {srid}
      geometry_column: geom
      geometry_type: GEOMETRY
      id_column: {id_column}
      properties:
{props}""")

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--config", str(self.dir / "martin.yaml")],
                                     stdout=open(self.dir / "martin.log", "a"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "RUST_LOG": "warn"})
        wait_for(lambda: port_open(self.port), 30, "martin to listen")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


class Varnish:
    """varnishd -F with the documented VCL, a malloc store, its own working directory."""

    def __init__(self, directory: Path, backend_port: int):
        tools("varnish")
        self.dir = directory
        self.port = free_port()
        self.backend_port = backend_port
        self.proc = None
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        (directory / "tiles.vcl").write_text(documented_vcl(backend_port))

    def start(self) -> None:
        self.proc = subprocess.Popen(["varnishd", "-F", "-n", str(self.dir / "work"), "-a", f"127.0.0.1:{self.port}",
                                      "-f", str(self.dir / "tiles.vcl"), "-s", "malloc,256m", "-j", "none",
                                      "-p", "vsl_space=1M"],
                                     stdout=open(self.dir / "varnish.log", "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_for(lambda: port_open(self.port), 30, "varnishd to listen")

    def stop(self) -> None:
        if self.proc:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP to varnishd and its child: connections are accepted by the kernel and never
        answered, and the cache keeps its tiles (a restart would empty it)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def url(self, source: str) -> str:
        return f"http://127.0.0.1:{self.port}/{source}/{{z}}/{{x}}/{{y}}"


class Hitch:
    """hitch terminating TLS in front of Varnish, with a private CA's certificate."""

    def __init__(self, directory: Path, cert: Path, key: Path, backend_port: int):
        tools("varnish")
        self.dir = directory
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        pem = directory / "hitch.pem"
        pem.write_text(key.read_text() + cert.read_text())
        (directory / "hitch.conf").write_text(
            f'frontend = "[127.0.0.1]:{self.port}"\nbackend = "[127.0.0.1]:{backend_port}"\npem-file = "{pem}"\n'
            f'workers = 1\ndaemon = off\nuser = "nobody"\n')
        self.proc = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["hitch", "--config", str(self.dir / "hitch.conf")],
                                     stdout=open(self.dir / "hitch.log", "a"), stderr=subprocess.STDOUT)
        wait_for(lambda: port_open(self.port), 20, "hitch to listen")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def url(self, source: str) -> str:
        return f"https://127.0.0.1:{self.port}/{source}/{{z}}/{{x}}/{{y}}"


def fetch(base: str, source: str, z: int, x: int, y: int) -> tuple[bytes, str]:
    """A tile's body (gunzipped) and the cache's X-Cache header ('' from Martin itself)."""
    req = urllib.request.Request(f"{base}/{source}/{z}/{x}/{y}", headers={"Accept-Encoding": "gzip"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            if r.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            return body, r.headers.get("X-Cache", "")
    except urllib.error.HTTPError as e:
        if e.code == 204:
            return b"", e.headers.get("X-Cache", "")
        raise


def decoded(tile: bytes) -> dict:
    """A tile as {layer: Counter of its features}, each feature its geometry and properties as
    canonical JSON: equal for two renders of the same rows, whatever their order."""
    if not tile:
        return {}
    out = {}
    for name, layer in mapbox_vector_tile.decode(tile).items():
        out[name] = Counter(json.dumps({"g": f["geometry"], "p": f["properties"]}, sort_keys=True) for f in layer["features"])
    return out
