"""Four engine processes publish over real ZMQ while replaying traces; one is killed and restarted.

At the end the indexer service's view of every worker equals that worker's residency, which each
engine process dumps to a file when its trace is done.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvtier.indexer.service import IndexerService, ServiceConfig
from kvtier.wire import StorageTier
from kvtier.wire.subscriber import EndpointConfig

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(name: str, pub: int, rep: int, seed: int, residency: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvtier.sim.live", "--name", name, "--endpoint", f"tcp://127.0.0.1:{pub}",
           "--replay", f"tcp://127.0.0.1:{rep}", "--trace", "builtin:chat:150", "--seed", str(seed),
           "--speed", "60", "--device-pages", "384", "--disk-pages", "2048", "--residency", str(residency)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def read_residency(path: Path) -> dict[StorageTier, set[int]] | None:
    if not path.exists():
        return None
    return {StorageTier[k]: set(v) for k, v in json.loads(path.read_text()).items()}


def test_engines_killed_and_restarted_converge(tmp_path: Path) -> None:
    names = [f"w{i}" for i in range(4)]
    ports = {n: (free_port(), free_port()) for n in names}
    files = {n: tmp_path / f"{n}.json" for n in names}
    procs = {n: start(n, *ports[n], seed=i, residency=files[n]) for i, n in enumerate(names)}
    eps = [EndpointConfig(n, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", supports_dump=True)
           for n, (p, r) in ports.items()]
    svc = IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", replay_timeout_s=1.0))
    svc.start()
    try:
        victim = "w2"
        deadline = time.monotonic() + 30
        while svc.metrics()["workers"][victim]["events_applied"] < 50:  # mid-trace: it has state to lose
            assert time.monotonic() < deadline, "the engine published nothing"
            time.sleep(0.05)
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        procs[victim] = start(victim, *ports[victim], seed=99, residency=files[victim])
        deadline = time.monotonic() + 60
        mismatch: dict[str, object] = {}
        while time.monotonic() < deadline:
            mismatch = {}
            for ep in eps:
                truth = read_residency(files[ep.worker])
                seen = svc.view(ep.stream)
                if truth is None or any(seen[t] != truth[t] for t in StorageTier):
                    mismatch[ep.worker] = "no residency yet" if truth is None else {
                        t.name: len(seen[t] ^ truth[t]) for t in StorageTier}
            if not mismatch:
                break
            time.sleep(0.25)
        assert not mismatch, mismatch
        m = svc.metrics()["workers"]
        assert m[victim]["restarts"] + m[victim]["resyncs"] >= 1, m[victim]
        for n in names:
            res = read_residency(files[n])
            assert res is not None and res[StorageTier.DEVICE] and res[StorageTier.DISK], n
    finally:
        svc.stop()
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
