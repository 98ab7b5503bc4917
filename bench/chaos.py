"""Chaos on loopback: kvtier engines and a kvtier indexer under client load, hurt one way at a time.

Starts ``--engines`` ``kvtier engine`` processes (each replays a builtin chat trace, then idles answering replay
and dump requests), a ``kvtier indexer`` process subscribed to them (with dumps) and to one more PUB socket this
script binds itself (the hostile peer), and ``--clients`` threads sending ``/query`` and ``/route`` (then
``finish``) for the engines' own prompts. Then, one after the other:

  baseline       nothing happens
  sigkill        one engine SIGKILLed, left dead for a while, then started again on its addresses
  sigstop        one engine SIGSTOPped for a while, then SIGCONTinued
  engine-restart one engine stopped (SIGTERM) and started again at once
  indexer-restart the indexer stopped (SIGTERM, it writes its snapshot) and started again from it
  hostile-frames garbage frames, a seq of 2**63-1, malformed msgpack and bad events on the hostile PUB socket
  http-flood     many threads hammering /query with large prompts, and idle sockets held open

Each prints one row: the clients' requests and errors during the scenario, ``/route`` answers that picked the
hurt engine once it had been gone past the liveness timeout, how long from the end of the fault (restart,
SIGCONT, last frame) until ``/health`` said ``ok`` again, and whether the index (read from the snapshot the
indexer writes every second) equals what every engine holds (asked by state dump) once the engines are idle.
A scenario that cannot get back to healthy says so; nothing is retried or hidden. Everything runs on
127.0.0.1 with free ports, and every process started is stopped at the end (engines also exit by themselves
when this script dies: ``--parent-pid``).

    python bench/chaos.py [--engines 3] [--clients 4] [--down-s 8] [--only sigkill,sigstop]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from benchargs import count, positive

from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.service import persist
from kvtier.sim.experiment import resolve_trace
from kvtier.sim.trace import TokenBank
from kvtier.wire import AllBlocksCleared, BlockRemoved, EventBatch, StorageTier, decode_payload, encode_payload
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import EngineHash, WorkerId
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16  # the engines' page size and the indexer's block size
SPEED = 20.0  # the engines replay their trace this much faster than its timestamps
TRACE = "builtin:chat:80"  # about 8 s of publishing at SPEED, then the engine idles
HEALTHY_WITHIN_S = 60.0  # a scenario not healthy by then is reported as such
SETTLE_WITHIN_S = 40.0  # how long the index may take to equal the engines once healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- processes -----------------------------------------------------------------------------


@dataclass
class Engine:
    name: str
    seed: int
    pub: int = field(default_factory=free_port)
    rep: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # when its process was last started
    span_s: float = 0.0  # how long its trace takes to replay (it idles afterwards)

    @property
    def spec(self) -> str:
        return f"{self.name}=tcp://127.0.0.1:{self.pub},replay=tcp://127.0.0.1:{self.rep},dump"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kvtier", "engine", "--name", self.name, "--seed", str(self.seed),
               "--endpoint", f"tcp://127.0.0.1:{self.pub}", "--replay", f"tcp://127.0.0.1:{self.rep}",
               "--trace", TRACE, "--speed", str(SPEED), "--page-size", str(BLOCK), "--device-pages", "2048",
               "--hold", "3600",
               "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.started = time.monotonic()

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped process acts on nothing else)
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def dump(self, timeout_s: float = 10.0) -> dict[StorageTier, set[EngineHash]] | None:
        """What the engine holds, per tier, asked on its replay socket as a state dump; None without an answer."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.rep}")
        index = TieredIndex(BLOCK)
        stream = StreamId(WorkerId(self.name))
        index.add_worker(stream)
        try:
            sock.send_multipart([b"", DUMP_REQUEST])
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return None
                frames = sock.recv_multipart()
                if frames[-2] == END_SEQ:
                    return index.worker_hashes(stream)
                index.apply_events(stream, decode_payload(frames[-1], packed_tokens=True).events)
        finally:
            sock.close(linger=0)


@dataclass
class Indexer:
    engines: list[Engine]
    hostile_port: int
    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.snapshot = self.workdir / "index.snap"
        self.config = self.workdir / "indexer.toml"
        self.log = self.workdir / "indexer.log"
        lines = [f'listen = "127.0.0.1:{self.port}"', f"block_size = {BLOCK}", f'snapshot_path = "{self.snapshot}"',
                 "snapshot_interval_s = 1.0"]
        for e in self.engines:
            lines += ["[[endpoints]]", f'worker = "{e.name}"', f'endpoint = "tcp://127.0.0.1:{e.pub}"',
                      f'replay_endpoint = "tcp://127.0.0.1:{e.rep}"', "supports_dump = true"]
        lines += ["[[endpoints]]", 'worker = "hostile"', f'endpoint = "tcp://127.0.0.1:{self.hostile_port}"']
        self.config.write_text("\n".join(lines) + "\n")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kvtier", "indexer", "--config", str(self.config)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def died(self) -> int | None:
        """The indexer process's exit code if it ended by itself."""
        return None if self.proc is None else self.proc.poll()

    def view(self) -> dict[str, dict[StorageTier, set[EngineHash]]] | None:
        """The index as its last snapshot holds it (written every second), per worker; None if unreadable."""
        try:
            index, _ = persist.load(self.snapshot, BLOCK)
        except (OSError, ValueError):
            return None
        return {str(s): index.worker_hashes(s) for s in index.streams}


# --- HTTP ----------------------------------------------------------------------------------


def http(url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    """(status, parsed JSON or text); status 0 with the error's text when no answer came."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, ValueError) as e:  # refused, reset, timed out, a broken answer
        return 0, f"{type(e).__name__}: {e}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def health(url: str) -> dict[str, Any] | None:
    status, body = http(url + "/health", timeout=2.0)
    return body if status in (200, 503) and isinstance(body, dict) else None


def wait_until(cond: Callable[[], bool], limit_s: float, every_s: float = 0.1) -> float | None:
    """Seconds until ``cond`` held, None if it did not within ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None


# --- client load ---------------------------------------------------------------------------


@dataclass
class Window:
    """What the clients saw over one scenario."""

    requests: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # error kind -> count
    routes: list[tuple[float, str]] = field(default_factory=list)  # (when, worker) of each /route answer


class Load:
    """``n`` client threads: /query, then /route and /finish, on the engines' own prompts, paced lightly."""

    def __init__(self, url: str, prompts: list[list[int]], n: int, seed: int) -> None:
        self.url, self.prompts = url, prompts
        self._lock = threading.Lock()
        self._window = Window()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True) for i in range(n)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.ident is not None:  # (started)
                t.join(timeout=10)

    def take(self) -> Window:
        """The window so far, and a new one started."""
        with self._lock:
            w, self._window = self._window, Window()
        return w

    def _note(self, status: int, body: Any, worker: str | None = None) -> None:
        with self._lock:
            w = self._window
            w.requests += 1
            if status != 200:
                w.errors += 1
                kind = str(status) if status else str(body).split(":")[0]
                w.kinds[kind] = w.kinds.get(kind, 0) + 1
            elif worker is not None:
                w.routes.append((time.monotonic(), worker))

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while not self._stop.is_set():
            prompt = rng.choice(self.prompts)
            status, body = http(self.url + "/query", {"token_ids": prompt})
            self._note(status, body)
            n += 1
            rid = f"c{seed}-{n}"
            status, body = http(self.url + "/route", {"token_ids": prompt, "request_id": rid})
            self._note(status, body, body.get("worker") if status == 200 and isinstance(body, dict) else None)
            if status == 200:
                status, body = http(self.url + f"/requests/{rid}/finish", {"output_tokens": 64})
                self._note(status, body)
            self._stop.wait(0.02)


# --- hostile peer --------------------------------------------------------------------------


def hostile_frames(sock: zmq.Socket[bytes], seq: int) -> int:
    """Sends every kind of bad frame on the hostile PUB socket; returns the next seq for well-formed ones."""
    rng = random.Random(7)
    topic = b"kv"
    bad: list[list[bytes]] = [
        [topic],  # wrong frame count
        [topic, b"\x00\x01", b"x"],  # seq frame of 2 bytes
        [topic, struct.pack(">q", 2**63 - 1), encode_payload(EventBatch(ts=0.0, events=[]))],  # no seq can follow
        [topic, struct.pack(">q", -5), b""],  # negative seq
        [topic, pack_seq(seq), b"\xc1\xc1\xc1 not msgpack"],
        [topic, pack_seq(seq + 1), b"\x93\xcb" + b"\xff" * 8 + b"\x91\x95"],  # a truncated msgpack array
        [topic, pack_seq(seq + 2), encode_payload(EventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=[12345], medium="GPU"), AllBlocksCleared()]))],  # removal of an unknown block
    ]
    seq += 3
    for _ in range(200):  # random bytes, each with the next seq: decode errors, never a gap
        bad.append([topic, pack_seq(seq), rng.randbytes(rng.randint(0, 300))])
        seq += 1
    bad.append([topic, b"\x00" * 8, b"", b"extra"])  # four frames
    for frames in bad:
        sock.send_multipart(frames)
    return seq


# --- HTTP flood ----------------------------------------------------------------------------


def flood(url: str, threads: int, seconds: float, idle_sockets: int) -> int:
    """``threads`` threads posting /query with 20k-token prompts back to back, and ``idle_sockets`` connections
    opened and left silent, for ``seconds``; returns the requests sent."""
    host, port = url.removeprefix("http://").split(":")
    idle = []
    for _ in range(idle_sockets):
        try:
            s = socket.create_connection((host, int(port)), timeout=2)
            s.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            idle.append(s)
        except OSError:
            break
    sent = [0]
    body = json.dumps({"token_ids": list(range(20_000))}).encode()
    stop = time.monotonic() + seconds

    def hammer() -> None:
        while time.monotonic() < stop:
            http(url + "/query", body, timeout=5)
            sent[0] += 1

    ts = [threading.Thread(target=hammer, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=seconds + 30)
    for s in idle:
        s.close()
    return sent[0]


# --- the scenarios -------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    requests: int = 0
    errors: int = 0
    error_kinds: str = ""
    to_gone: str = "-"  # /route answers that picked the hurt engine after it was gone past the timeout
    detect_s: str = "-"  # from the fault until /health no longer said ok
    healthy_s: str = "-"  # from the end of the fault until /health said ok
    index_equal: str = "-"
    note: str = ""


class Chaos:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.engines = [Engine(f"e{i}", seed=i + 1) for i in range(args.engines)]
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.hostile = ctx.socket(zmq.PUB)
        self.hostile.setsockopt(zmq.LINGER, 0)
        hostile_port = self.hostile.bind_to_random_port("tcp://127.0.0.1")
        self.hostile_seq = 0
        self.indexer = Indexer(self.engines, hostile_port, workdir)
        prompts = []
        for e in self.engines:  # the engines' own prompts (the same trace and token bank as theirs)
            bank = TokenBank(seed=e.seed)
            trace = resolve_trace(TRACE, seed=e.seed, time_scale=1.0 / SPEED)
            e.span_s = trace[-1].arrival
            for req in trace[:: max(1, len(trace) // 40)]:
                packed = bank.packed(req)
                prompts.append(list(struct.unpack(f"<{len(packed) // 4}I", packed)))
        self.load = Load(self.indexer.url, prompts, args.clients, seed=args.seed)
        self.liveness_s = 5.0  # the indexer's default liveness_timeout_s (this script does not change it)

    # -- helpers --

    def healthy(self) -> bool:
        h = health(self.indexer.url)
        return h is not None and h.get("status") == "ok"

    def degraded(self) -> bool:
        h = health(self.indexer.url)
        return h is None or h.get("status") != "ok"

    def idle_engines(self) -> None:
        """Waits until every engine replayed its trace (it idles afterwards: its state no longer changes)."""
        for e in self.engines:
            left = e.started + e.span_s + 3.0 - time.monotonic()  # (3 s: start-up and the last copies)
            if left > 0:
                time.sleep(left)

    def index_equal(self) -> tuple[str, str]:
        """('yes' / 'NO' / '?', note): the snapshot's index against every engine's dump, polled until equal."""
        self.idle_engines()
        last: list[str] = []

        def same() -> bool:
            view = self.indexer.view()
            if view is None:
                last[:] = ["no snapshot readable"]
                return False
            wrong = []
            for e in self.engines:
                truth = e.dump()
                if truth is None:
                    wrong.append(f"{e.name}: no dump")
                    continue
                if not any(truth.values()):  # (an engine that holds nothing proves nothing: a wrong page size)
                    wrong.append(f"{e.name}: its dump holds no block")
                    continue
                got = view.get(e.name, {})
                diff = sum(len(truth[t] ^ got.get(t, set())) for t in StorageTier)
                if diff:
                    wrong.append(f"{e.name}: {diff} (block, tier) differ")
            last[:] = wrong
            return not wrong

        took = wait_until(same, SETTLE_WITHIN_S, every_s=1.0)
        return ("yes", "") if took is not None else ("NO", "; ".join(last))

    def finish_row(self, row: Row, fault_end: float, gone: str | None = None, gone_since: float | None = None,
                   gone_until: float | None = None) -> Row:
        took = wait_until(self.healthy, HEALTHY_WITHIN_S)
        row.healthy_s = f"{time.monotonic() - fault_end:.1f}" if took is not None else f">{HEALTHY_WITHIN_S:.0f}"
        if (code := self.indexer.died()) is not None:
            row.note += f" indexer exited {code};"
        row.index_equal, why = self.index_equal()
        if why:
            row.note += f" {why};"
        w = self.load.take()
        row.requests, row.errors = w.requests, w.errors
        row.error_kinds = ",".join(f"{k}x{n}" for k, n in sorted(w.kinds.items()))
        if gone is not None and gone_since is not None and gone_until is not None:
            lo = gone_since + self.liveness_s + 1.0  # a second's grace past the timeout
            picked = sum(1 for t, who in w.routes if lo <= t <= gone_until and who == gone)
            total = sum(1 for t, _ in w.routes if lo <= t <= gone_until)
            # (none routed in the window, e.g. a fault shorter than the liveness timeout: nothing measured)
            row.to_gone = f"{picked}/{total}" if total else "-"
        return row

    def detect(self, t0: float, row: Row) -> None:
        took = wait_until(self.degraded, self.args.down_s)
        row.detect_s = f"{time.monotonic() - t0:.1f}" if took is not None else f">{self.args.down_s:.0f}"

    def hold(self, until: float) -> None:
        left = until - time.monotonic()
        if left > 0:
            time.sleep(left)

    # -- scenarios --

    def baseline(self) -> Row:
        row = Row("baseline")
        time.sleep(self.args.down_s)
        return self.finish_row(row, time.monotonic())

    def sigkill(self) -> Row:
        e = self.engines[-1]
        row = Row(f"sigkill {e.name}")
        t0 = time.monotonic()
        e.stop(signal.SIGKILL)
        self.detect(t0, row)
        self.hold(t0 + self.args.down_s)
        back = time.monotonic()
        e.start()
        return self.finish_row(row, back, gone=e.name, gone_since=t0, gone_until=back)

    def sigstop(self) -> Row:
        e = self.engines[0]
        row = Row(f"sigstop {e.name}")
        t0 = time.monotonic()
        e.send(signal.SIGSTOP)
        self.detect(t0, row)
        self.hold(t0 + self.args.down_s)
        back = time.monotonic()
        e.send(signal.SIGCONT)
        return self.finish_row(row, back, gone=e.name, gone_since=t0, gone_until=back)

    def engine_restart(self) -> Row:
        e = self.engines[min(1, len(self.engines) - 1)]
        row = Row(f"engine-restart {e.name}")
        t0 = time.monotonic()
        e.stop(signal.SIGTERM)
        e.start()
        self.detect(t0, row)
        return self.finish_row(row, t0)

    def indexer_restart(self) -> Row:
        row = Row("indexer-restart")
        t0 = time.monotonic()
        self.indexer.stop()
        if not self.indexer.snapshot.exists():
            row.note += " no snapshot written on stop;"
        self.indexer.start()
        return self.finish_row(row, t0)

    def hostile_frames(self) -> Row:
        row = Row("hostile-frames")
        for _ in range(3):
            self.hostile_seq = hostile_frames(self.hostile, self.hostile_seq)
            time.sleep(0.2)
        end = time.monotonic()
        time.sleep(1.0)
        if self.indexer.died() is not None:
            row.note += " the indexer died on hostile frames;"
        else:
            status, m = http(self.indexer.url + "/metrics?format=json")
            if status == 200 and isinstance(m, dict) and "hostile" in m.get("workers", {}):
                h = m["workers"]["hostile"]
                row.note += (f" hostile stream: {h.get('malformed')} malformed, {h.get('events_rejected')} events "
                             f"rejected, {h.get('unknown_removals')} unknown removals, partial {h.get('partial')};")
        return self.finish_row(row, end)

    def http_flood(self) -> Row:
        row = Row("http-flood")
        sent = flood(self.indexer.url, self.args.flood_threads, self.args.flood_s, self.args.idle_sockets)
        row.note += f" flood sent {sent} requests, {self.args.idle_sockets} idle sockets;"
        return self.finish_row(row, time.monotonic())

    def run(self) -> list[Row]:
        scenarios: dict[str, Callable[[], Row]] = {
            "baseline": self.baseline, "sigkill": self.sigkill, "sigstop": self.sigstop,
            "engine-restart": self.engine_restart, "indexer-restart": self.indexer_restart,
            "hostile-frames": self.hostile_frames, "http-flood": self.http_flood}
        assert list(scenarios) == SCENARIOS
        chosen = [s for s in SCENARIOS if not self.args.only or s in self.args.only.split(",")]
        for e in self.engines:
            e.start()
        self.indexer.start()
        up = wait_until(lambda: health(self.indexer.url) is not None, 60)
        if up is None:
            raise SystemExit(f"chaos: the indexer did not answer within 60 s (log: {self.indexer.log})")
        self.load.start()
        wait_until(self.healthy, HEALTHY_WITHIN_S)
        self.load.take()
        rows = []
        for name in chosen:
            if self.indexer.died() is not None:  # a scenario killed it: the next ones need one
                self.indexer.start()
                wait_until(self.healthy, HEALTHY_WITHIN_S)
                self.load.take()
            print(f"chaos: {name} ...", file=sys.stderr, flush=True)
            rows.append(scenarios[name]())
            print_row(rows[-1], file=sys.stderr)
        return rows

    def close(self) -> None:
        self.load.stop()
        self.indexer.stop()
        for e in self.engines:
            e.stop()
        self.hostile.close(linger=0)


SCENARIOS = ["baseline", "sigkill", "sigstop", "engine-restart", "indexer-restart", "hostile-frames", "http-flood"]
COLUMNS = [("scenario", 22), ("requests", 8), ("errors", 6), ("to gone", 8), ("detect s", 8), ("healthy s", 9),
           ("index=engines", 13)]


def print_row(r: Row, file: Any = sys.stdout) -> None:
    cells = [r.scenario, r.requests, r.errors, r.to_gone, r.detect_s, r.healthy_s, r.index_equal]
    line = "  ".join(f"{c!s:<{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True))
    extra = " ".join(x for x in (f"errors: {r.error_kinds}" if r.error_kinds else "", r.note.strip()) if x)
    print(line + (f"  {extra}" if extra else ""), file=file, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=3, choices=[2, 3, 4])
    p.add_argument("--clients", type=count(), default=4, help="client threads sending /query and /route")
    p.add_argument("--down-s", type=positive, default=20.0,
                   help="how long a killed or stopped engine stays down; the default outlasts the indexer's replay "
                        "and dump attempts on a killed engine (about 12 s), so it is given up before it comes back")
    p.add_argument("--flood-threads", type=count(), default=32)
    p.add_argument("--flood-s", type=positive, default=4.0)
    p.add_argument("--idle-sockets", type=count(0), default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated scenarios (default: all, in order)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, snapshot, config)")
    args = p.parse_args()
    if args.only and (unknown := set(args.only.split(",")) - set(SCENARIOS)):
        p.error(f"--only: unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-chaos-"))
    chaos = Chaos(args, workdir)
    t0 = time.monotonic()
    try:
        rows = chaos.run()
    except BaseException:
        print(f"chaos: failed; logs and snapshot kept in {workdir}", file=sys.stderr)
        raise
    finally:
        chaos.close()
    print(f"kvtier chaos: {args.engines} engines ({TRACE} at {SPEED:g}x), {args.clients} clients, engines down "
          f"{args.down_s:g} s, liveness timeout {chaos.liveness_s:g} s (the indexer's default); "
          f"{time.monotonic() - t0:.0f} s in all")
    print("  ".join(f"{name:<{w}}" for name, w in COLUMNS) + "  notes")
    for r in rows:
        print_row(r)
    print("to gone: /route answers that picked the hurt engine from the liveness timeout + 1 s after the fault "
          "until it came back, of all answers then (-: none then, as when the fault is shorter); detect: fault to "
          "/health not ok; healthy: end of the fault to "
          "/health ok; index=engines: the indexer's snapshot equals every engine's state dump once they idle")
    missed = [r.scenario for r in rows if r.healthy_s.startswith(">") or r.index_equal != "yes"]
    print(f"target: healthy again within {HEALTHY_WITHIN_S:.0f} s and index=engines in every scenario: "
          + (f"MISS ({', '.join(missed)})" if missed else "MET"))
    if args.keep:
        print(f"work directory: {workdir}")
    else:
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
