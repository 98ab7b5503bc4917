"""Four engine processes publish over real ZMQ while replaying traces; one is killed and restarted.

At the end the indexer service's view of every worker equals that worker's residency, which each
engine process dumps to a file when its trace is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvtier.indexer.service.app import IndexerService, ServiceConfig
from kvtier.wire import StorageTier
from kvtier.wire.transport.subscriber import EndpointConfig

ROOT = Path(__file__).resolve().parent.parent


ANY_PORT = "tcp://127.0.0.1:0"


def free_ports(n: int = 1) -> list[int]:
    """``n`` distinct ports free right now, for a process to bind later (other tests' helpers; this test lets its
    engines bind port 0 instead). Held together while found: ports found one after another may be the same one."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def start(name: str, seed: int, residency: Path, pub: str = ANY_PORT,
          rep: str = ANY_PORT) -> tuple[subprocess.Popen[bytes], str, str]:
    """Starts an engine process and waits until it publishes; returns it and its publish and replay
    endpoints. Engines bind port 0 on their first start: a port picked here and bound later could be taken
    in between (an outgoing connection's source port), and the engine would exit before publishing."""
    cmd = [sys.executable, "-m", "kvtier.sim.live", "--name", name, "--endpoint", pub,
           "--replay", rep, "--trace", "builtin:chat:150", "--seed", str(seed),
           "--speed", "60", "--device-pages", "384", "--disk-pages", "2048", "--residency", str(residency),
           "--parent-pid", str(os.getpid())]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    for raw in p.stdout:
        found = re.search(r"publishing on (\S+), replay (\S+),", raw.decode(errors="replace"))
        if found:
            # Keep reading what it prints, so a full pipe never stalls it.
            threading.Thread(target=p.stdout.read, daemon=True).start()
            return p, found[1], found[2]
    raise AssertionError(f"engine {name} exited {p.wait()} before publishing: "
                         f"{p.stderr.read().decode(errors='replace')[-2000:] if p.stderr else ''}")


def read_residency(path: Path) -> dict[StorageTier, set[int]] | None:
    if not path.exists():
        return None
    return {StorageTier[k]: set(v) for k, v in json.loads(path.read_text()).items()}


def engine_states(procs: dict[str, subprocess.Popen[bytes]]) -> dict[str, str]:
    """Each engine process: running, or its exit code and the end of its stderr (so a failure says why an
    engine never wrote its residency)."""
    out = {}
    for n, p in procs.items():
        code = p.poll()
        if code is None:
            out[n] = "running"
        else:
            err = p.stderr.read().decode(errors="replace") if p.stderr else ""
            out[n] = f"exited {code}: {err[-2000:]}"
    return out


def test_engines_killed_and_restarted_converge(tmp_path: Path) -> None:
    names = [f"w{i}" for i in range(4)]
    files = {n: tmp_path / f"{n}.json" for n in names}
    started = {n: start(n, seed=i, residency=files[n]) for i, n in enumerate(names)}
    procs = {n: p for n, (p, _, _) in started.items()}
    eps = [EndpointConfig(n, pub, rep, supports_dump=True) for n, (_, pub, rep) in started.items()]
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
        _, pub, rep = started[victim]
        procs[victim] = start(victim, seed=99, residency=files[victim], pub=pub, rep=rep)[0]
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
        assert not mismatch, (mismatch, engine_states(procs))
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


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped counts: a container's init may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_engine_exits_when_the_parent_it_was_given_dies() -> None:
    """A harness that crashes leaves no engine behind: given ``--parent-pid``, an engine whose parent died exits
    (on its own, it would serve until SIGTERM)."""
    launcher = (
        "import subprocess, sys, os\n"
        "p = subprocess.Popen([sys.executable, '-m', 'kvtier.sim.live', '--endpoint', 'tcp://127.0.0.1:0',\n"
        "    '--replay', 'tcp://127.0.0.1:0', '--trace', 'builtin:chat:3', '--speed', '1000', '--l3', 'none',\n"
        "    '--hold', '3600', '--parent-pid', str(os.getpid())], stdout=subprocess.PIPE,\n"
        "    stderr=subprocess.DEVNULL)\n"
        "p.stdout.readline()\n"  # publishing: the engine runs, then its parent dies without a word
        "print(p.pid, flush=True)\n"
        "os._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", launcher], cwd=ROOT, capture_output=True, text=True, timeout=120)
    pid = int(out.stdout)
    deadline = time.monotonic() + 30
    while not gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the engine outlived its parent by 30 s")
        time.sleep(0.1)
