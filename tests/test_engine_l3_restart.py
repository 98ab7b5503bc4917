"""`kvtier engine --l3 disk --l3-dir DIR`: real page files, an engine killed mid-write comes back warm.

The first engine process is SIGKILLed while its copy thread writes pages. The restarted one (same
--name, smaller --disk-pages) removes what the dead one left half-written, adopts what fits, and
announces it: an indexer service subscribed to it ends with exactly the engine's residency, and
every page file left on disk is a sound page the engine holds and the router knows.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtier.engine.l3 import pagedir
from kvtier.engine.l3.pagefile import Layout, read_header
from kvtier.indexer.service.app import IndexerService, ServiceConfig
from kvtier.wire import StorageTier
from kvtier.wire.transport.subscriber import EndpointConfig
from tests.test_multiprocess import ROOT, read_residency

LAYOUT = Layout("kvtier-live", 16, kv_bytes_per_token=1024)  # `kvtier engine`'s defaults


def engine(l3_dir: Path, *extra: str, name: str = "w0", l3: str = "disk") -> subprocess.Popen[bytes]:
    """An engine process binding port 0 for both endpoints: a port picked here and bound later could be taken in
    between, and the engine would exit before publishing. It prints the endpoints it bound."""
    cmd = [sys.executable, "-m", "kvtier", "engine", "--name", name, "--endpoint", "tcp://127.0.0.1:0",
           "--replay", "tcp://127.0.0.1:0", "--l3", l3, "--l3-dir", str(l3_dir), "--page-size", "16",
           "--device-pages", "1024", "--host-ratio", "2", "--parent-pid", str(os.getpid()), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def test_engine_killed_mid_write_restarts_warm(tmp_path: Path) -> None:
    base = tmp_path / LAYOUT.tag()
    first = engine(tmp_path, "--trace", "builtin:chat:400", "--speed", "20")
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(base / "pages")) < 300 if (base / "pages").exists() else True:
            assert time.monotonic() < deadline and first.poll() is None, "the engine wrote too few pages"
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    held = len(os.listdir(base / "refs" / "w0"))
    assert held >= 300
    (base / (pagedir.tmp_prefix(first.pid) + "torn")).write_bytes(b"KVTP half a page")  # what a kill mid-write leaves

    residency = tmp_path / "res.json"
    second = engine(tmp_path, "--trace", "builtin:chat:3", "--speed", "1000", "--disk-pages", "200",
                    "--residency", str(residency), "--hold", "60")
    svc = None
    try:
        assert second.stdout is not None
        line = second.stdout.readline().decode()
        found = re.search(r"adopted (\d+) pages; removed (\d+) temporary", line)
        assert found and int(found[1]) == 200 and int(found[2]) >= 1, line  # the torn write is gone
        line = second.stdout.readline().decode()
        bound = re.search(r"publishing on (\S+), replay (\S+),", line)
        assert bound, line
        svc = IndexerService(ServiceConfig(endpoints=[EndpointConfig("w0", bound[1], bound[2], supports_dump=True)],
                                           block_size=16, listen="127.0.0.1:0", replay_timeout_s=1.0))
        svc.start()
        deadline = time.monotonic() + 60
        while (truth := read_residency(residency)) is None or svc.view(svc.config.endpoints[0].stream) != truth:
            assert time.monotonic() < deadline, "the indexer did not converge on the restarted engine"
            assert second.poll() is None, "the restarted engine exited"
            time.sleep(0.1)
        on_disk = {read_header(str(base / "pages" / f), f, LAYOUT.tag()).event_hash
                   for f in os.listdir(base / "pages")}
        assert len(on_disk) <= 200 and not [f for f in os.listdir(base) if f.startswith(".tmp")]
        assert on_disk == truth[StorageTier.DISK]  # every file is a page the engine and the router know
        assert json.loads(residency.read_text())["DISK"]
    finally:
        if svc is not None:
            svc.stop()
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=10)


def test_engines_sharing_a_pool_never_delete_each_others_pages(tmp_path: Path) -> None:
    """Two engine processes share one --l3 external directory and write the same prompts; one is killed and
    restarted with a capacity far below what it held. Every page the other holds stays, sound."""
    base = tmp_path / LAYOUT.tag()
    common = ("--trace", "builtin:sysprompt:60", "--speed", "200", "--l3-sync", "batch")
    a = engine(tmp_path, *common, "--hold", "60", name="a", l3="external")
    b = engine(tmp_path, *common, "--hold", "0", name="b", l3="external")
    try:
        assert b.wait(timeout=120) == 0
        held_by_b = sorted(os.listdir(base / "refs" / "b"))
        shared = set(held_by_b) & set(os.listdir(base / "refs" / "a"))
        assert len(held_by_b) > 50 and shared, "the engines should have written some of the same pages"
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=10)
        again = engine(tmp_path, "--trace", "builtin:chat:1", "--disk-pages", "5",
                       "--hold", "0", name="a", l3="external")
        assert again.wait(timeout=60) == 0
        assert len(os.listdir(base / "refs" / "a")) <= 5 + 5  # what fits, plus the one new prompt's chain
        for name in held_by_b:  # b's pages, the ones a dropped included, are all there and sound
            key = name.replace("_", ":", 1) if name.startswith("d_") else name
            read_header(str(base / "pages" / name), key, LAYOUT.tag())
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
