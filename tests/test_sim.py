"""The simulator: validity against theory, kv_all == oracle, timing, determinism, CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
import types
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import cast

import pytest

from kvtier.hardware.latency import MockerLatency, decode_run_ms
from kvtier.sim import experiment, transport
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig, Job, SimWorker, _DecodeRun
from kvtier.sim.core import Environment
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.trace import Request, prefix_reuse
from kvtier.sim.transport import SimWire, WireConfig
from kvtier.wire.protocol import EventBatch
from tests.test_multiprocess import ROOT, gone

SMALL = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0, l3="disk", l3_tokens=131_072)


def chat(n: int, seed: int = 1) -> list[Request]:
    return generate(dataclasses.replace(PRESETS["chat"], requests=n, system_tokens=1024, user_tokens=600), seed)


def test_unbounded_single_worker_hit_rate_equals_theoretical_reuse() -> None:
    reqs = chat(120)
    spaced = [dataclasses.replace(r, arrival=i * 1000.0) for i, r in enumerate(reqs)]  # no overlap in time
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=10_000_000, host_ratio=0.0)
    res = simulate(spaced, cfg, RunConfig("round_robin"))
    assert res.summary.requests == len(reqs)
    assert res.summary.hit_rate == pytest.approx(prefix_reuse(spaced, 64), abs=1e-12)
    assert res.summary.hit_host == 0.0


def _one_step_runs(self: SimWorker, decoders: list[Job]) -> None:
    """A decode run of one iteration, whatever could be merged: what the simulator's merged runs stand for."""
    u0, du = self._utilisation(), len(decoders) / self.capacity_tokens
    timer = self.env.after(decode_run_ms(self.latency, u0, du, 1) / 1000.0, self._end_decode_run)
    self._decode = _DecodeRun(self.env.now, u0, du, 1, timer)


@pytest.mark.parametrize("disagg", [False, True])
@pytest.mark.parametrize("policy", ["least_loaded", "kv_all", "min_ttft", "goodput", "dynamo", "llmd_kv"])
def test_merging_decode_steps_changes_no_routing_decision(policy: str, disagg: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode iterations merged into one event (a speed device) route every request as one-step iterations do: the
    router sees each worker's tokens as they stream back, not as of the merged run's start. (Before, a run told its
    progress only when it ended: least_loaded and kv_all decided 57 and 60 of 150 requests otherwise, min_ttft
    disaggregated 29, its decode side 51.)"""
    cfg = dataclasses.replace(SMALL, workers=4, prefill_workers=2, decode_workers=2) if disagg else SMALL
    reqs = chat(150)
    merged = simulate(reqs, cfg, RunConfig(policy))
    monkeypatch.setattr(SimWorker, "_start_decode_run", _one_step_runs)
    stepped = simulate(reqs, cfg, RunConfig(policy))
    assert merged.decisions == stepped.decisions
    assert [r.decode_worker for r in merged.records] == [r.decode_worker for r in stepped.records]
    assert merged.summary.hit_rate == stepped.summary.hit_rate
    assert [r.finish for r in merged.records] == pytest.approx([r.finish for r in stepped.records], rel=1e-9)


@pytest.mark.parametrize("disagg", [False, True])
@pytest.mark.parametrize("l3", ["disk", "external"])
@pytest.mark.parametrize("cost", ["credit", "ttft"])
def test_kv_all_decides_exactly_like_the_oracle_without_delay(cost: str, l3: str, disagg: bool) -> None:
    """The index, fed every event, knows what the engines hold: ``kv_all`` routes as the oracle, which reads the
    engines. Disaggregated too, on both sides of each pair: the decode pool's overlap (the KV that need not cross the
    link) is the decode engines' own. (The oracle priced the decode pool seeing no overlap there, so nothing checked
    the decode side's index: of 250 requests, 92-125 went to another decode worker than kv_all's.)"""
    reqs = chat(250)
    cfg = dataclasses.replace(SMALL, l3=l3, l3_tokens=SMALL.l3_tokens // 3 if l3 == "external" else SMALL.l3_tokens)
    if disagg:
        cfg = dataclasses.replace(cfg, workers=4, prefill_workers=2, decode_workers=2)
    a = simulate(reqs, cfg, RunConfig("kv_all", cost=cost))
    o = simulate(reqs, cfg, RunConfig("oracle", cost=cost))
    assert [r.decode_worker for r in a.records] == [r.decode_worker for r in o.records]
    assert a.decisions == o.decisions
    assert a.summary.hit_rate == o.summary.hit_rate
    # The index predicts exactly what the engines held when each request was routed (accuracy at
    # admission may still be below 1: the cache changes while a request queues).
    assert [r.predicted_blocks for r in a.records] == [r.predicted_blocks for r in o.records]
    assert a.summary.events_rejected == 0
    assert a.summary.hit_host > 0 or a.summary.hit_storage > 0  # the lower tiers were exercised


def test_event_delay_and_loss_degrade_the_index_gracefully() -> None:
    reqs = chat(250)
    lossy = simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.3, seed=3, recovery="none"))
    assert lossy.summary.requests == len(reqs)
    assert lossy.events_lost > 0 and lossy.wire.replay_requests == 0
    assert lossy.summary.index_exact < 1.0
    late = simulate(reqs, SMALL, RunConfig("kv_all", event_delay_s=5.0))
    assert late.summary.requests == len(reqs) and late.summary.index_exact < 1.0


def test_the_event_paths_time_is_counted_where_events_are_heard() -> None:
    """``wire.seconds`` is the part of a run's wall spent encoding, decoding and applying batches (bench/sim_bench.py
    prints the rest beside it): none for a policy that hears no events, part of the run for one that does, replays
    and dumps included."""
    reqs = chat(250)
    blind = simulate(reqs, SMALL, RunConfig("round_robin"))
    assert blind.wire.seconds == 0.0 and blind.summary.extra["event_blocks"] > 0
    t0 = time.perf_counter()
    heard = simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.5, seed=3, recovery="dump", replay_buffer=1))
    wall = time.perf_counter() - t0
    assert heard.wire.dumps > 0 and 0.0 < heard.wire.seconds < wall


@pytest.mark.parametrize(("seed", "delay_s"), [(0, 0.0), (1, 0.0), (0, 0.05), (1, 0.05)])
def test_the_event_paths_time_is_the_routers_work_counted_once(seed: int, delay_s: float,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the router's work advances this clock (a second for each batch of deliveries it applies), so the event
    path's seconds are exactly that work: applied live, from a replay or a dump, or released when a gap's deadline
    passes, each inside a span."""
    clock = [0.0]
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    env = Environment()
    applied: list[int] = []

    def sink(deliveries: list[object]) -> None:
        applied.append(len(deliveries))
        clock[0] += 1.0

    wire = SimWire(env, WireConfig(loss=0.3, burst=2, buffer=2, delay_s=delay_s, timeout_s=0.5), 1,
                   random.Random(seed), sink, lambda _: [])
    for k in range(40):
        env.after(k * 0.25, lambda: wire.publish(0, EventBatch(ts=env.now, events=[])))
    env.run(until=30.0)
    assert wire.counters.lost > 0 and applied
    assert wire.counters.seconds == len(applied)


def test_the_event_paths_time_counts_a_dumps_publishing_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump flushes the engine's pending events inside the answer's span, and publishing them opens spans of
    their own: only the outermost span is counted. The clock ticks one second a read and a span reads it twice,
    so counted once, the seconds are half the reads; a nested span counted too adds its ticks again."""
    ticks = itertools.count()
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    env = Environment()
    flushed: list[int] = []

    def dump(worker: int) -> list[EventBatch]:
        for _ in range(3):
            flushed.append(worker)
            wire.publish(worker, EventBatch(ts=env.now, events=[]))
        return []

    wire = SimWire(env, WireConfig(loss=0.5, buffer=1), 1, random.Random(0), lambda _: None, dump)
    for k in range(20):
        env.after(k * 0.5, lambda: wire.publish(0, EventBatch(ts=env.now, events=[])))
    env.run(until=10.0)
    assert wire.counters.dumps > 0 and flushed
    assert wire.counters.seconds * 2 == next(ticks)


def _job_or_stall(job: object, *, progress: bool = False) -> object:
    """A stand-in for :func:`kvtier.sim.experiment.execute` in a pool's workers: job 0 ends at once (failing if
    it says so), the others stall far past any test's patience."""
    if job == "fail":
        raise ValueError("run 0 failed")
    if job == "ok":
        return {"job": 0}, None
    if job == "die":
        os._exit(9)  # (as the kernel's OOM killer ends a process: no exception, no result)
    time.sleep(120)
    return {"job": job}, None


@pytest.mark.parametrize("how", ["a run fails", "Ctrl-C", "a worker dies"])
def test_a_pool_stops_at_once_when_a_run_fails_or_is_interrupted(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed run (or Ctrl-C, which reaches the parent as KeyboardInterrupt) was raised only once every other
    run had finished: the pool's exit waited for them, and its workers, each interrupted in turn, went on to
    the next run. The runs under way are ended, those not started never start; a worker that dies breaks the
    pool (a pool that replaced it would wait for ever for its run)."""
    monkeypatch.setattr(experiment, "execute", _job_or_stall)
    # A SIGTERM handler in this process, inherited by the workers it forks, swallows a terminate(): the pool still
    # stops (a test process can hold one; before kvtier engine gave its handlers back, one left behind did).
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _stop_a_pool(how)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_a_pool(how: str) -> None:
    first = {"a run fails": "fail", "Ctrl-C": "ok", "a worker dies": "die"}[how]
    jobs = cast(list[experiment.RunSpec], [first, "stall", "stall", "stall"])

    def interrupt(tag: dict[str, object], result: object) -> None:
        raise KeyboardInterrupt

    t0 = time.monotonic()
    raised = {"a run fails": ValueError, "Ctrl-C": KeyboardInterrupt, "a worker dies": BrokenProcessPool}[how]
    with pytest.raises(raised):
        experiment.run_jobs(jobs, processes=2, on_done=interrupt)
    assert time.monotonic() - t0 < 60  # (the stalled runs would take 120 s each)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_pool_runs_under_every_start_method(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool workers took a parent other than the process that made the pool for a dead one, which holds only where
    workers are forked: under forkserver (Python 3.14's default on Linux) or spawn each exited at start, and every
    run with --jobs 2 failed with a broken pool."""
    real = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda how=None: real(how or method))
    jobs = [experiment.RunSpec(experiment.as_source(chat(20)), SMALL, RunConfig(p), {"policy": p})
            for p in ("round_robin", "kv_all")]
    got = experiment.run_jobs(jobs, processes=2)
    assert [tag["policy"] for tag, _ in got] == ["round_robin", "kv_all"]
    assert all(res.summary.requests == 20 for _, res in got)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.skipif(not Path(f"/proc/self/task/{os.getpid()}/children").exists(), reason="reads /proc's children")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_compare_stopped_by_a_signal_leaves_no_workers_and_no_parts(tmp_path: Path, sig: int) -> None:
    """``kill`` (SIGTERM) of a ``kvtier compare`` killed the parent alone, mid-run: its pool's workers, blocked on
    the pipe it held, stayed for good (a Mooncake run's two held 750 MiB each), its hidden parts stayed in --out,
    and nothing was said. SIGTERM is now taken as Ctrl-C is (the pool stopped, the parts removed, one line, the
    signal's status); a parent killed outright (SIGKILL) takes its workers with it."""
    out, log = tmp_path / "out", tmp_path / "err"
    with log.open("w") as err:  # (a file, not a pipe: a worker left behind would hold a pipe open)
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "compare", "--trace", "builtin:chat:20000",
                                 "--policies", "round_robin,kv_all", "--jobs", "2", "--no-plots", "--out", str(out)],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 or len([p for p in out.glob(".requests.*.csv") if p.stat().st_size]) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            workers = _children(proc.pid)
            time.sleep(0.05)
        proc.send_signal(sig)  # both runs under way (each takes many seconds more)
        assert proc.wait(timeout=60) == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not all(gone(w) for w in workers):
            assert time.monotonic() < deadline, "a pool worker outlived its parent"
            time.sleep(0.05)
        if sig == signal.SIGTERM:
            assert log.read_text().splitlines()[-1] == "kvtier: stopped by SIGTERM"
            assert list(out.iterdir()) == []  # (no part, no output claiming to be whole)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid in workers:  # (only one still running: a pid reaped long ago may be another process's by now)
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_lost_events_are_recovered_by_the_routers_stream_tracker() -> None:
    """The same loss with the tracker a deployed router runs: gaps are replayed from the engines'
    buffers and the index is exact again; past a tiny buffer, dumps (kvtier engines) or partial
    marks (engines that cannot dump) take over."""
    reqs = chat(250)
    replayed = simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.3, seed=3, recovery="replay"))
    assert replayed.events_lost > 0 and replayed.wire.replay_requests > 0
    assert replayed.wire.partial_marks == 0 and replayed.summary.index_exact == 1.0
    tiny = simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.5, seed=3, recovery="replay", replay_buffer=1))
    assert tiny.wire.partial_marks > 0 and tiny.wire.dumps == 0
    dumped = simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.5, seed=3, recovery="dump", replay_buffer=1))
    assert dumped.wire.dumps > 0 and dumped.summary.requests == len(reqs)


def test_an_outage_longer_than_the_buffer_needs_a_dump() -> None:
    reqs = chat(250)
    runs = {rec: simulate(reqs, SMALL, RunConfig("kv_all", event_loss=0.05, seed=3, recovery=rec, replay_buffer=8,
                                                 loss_burst=12)) for rec in ("replay", "dump")}
    assert runs["replay"].wire.partial_marks > 0 and runs["replay"].wire.dumps == 0
    assert runs["dump"].wire.dumps > 0 and runs["dump"].wire.partial_marks == 0
    assert runs["replay"].events_lost >= 12 and runs["dump"].summary.index_exact > runs["replay"].summary.index_exact


def test_single_request_timing_in_closed_form() -> None:
    lat = MockerLatency()
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0, prefill_budget=8192)
    req = Request("r0", 0.0, 3000, 50, [1, 2, 3, 4, 5, 6])
    rec = simulate([req], cfg, RunConfig("round_robin")).records[0]
    ttft = lat.prefill_ms(3000) / 1000
    assert rec.ttft == pytest.approx(ttft)
    # each decode step at its own utilisation: one more token of KV per step
    decode = sum(lat.decode_ms((3000 + 1 + k) / 65_536) for k in range(49)) / 1000
    assert rec.e2e == pytest.approx(ttft + decode, rel=1e-12)


@pytest.mark.parametrize("policy", ["round_robin", "kv_all"])  # events unheard, and heard through the codec
def test_event_blocks_count_the_blocks_the_events_name(policy: str) -> None:
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
    req = Request("r0", 0.0, 3000, 50, [1, 2, 3, 4, 5, 6])
    extra = simulate([req], cfg, RunConfig(policy)).summary.extra
    assert extra["event_blocks"] == 3000 // 64  # its whole pages, stored once and never evicted
    # stored on device, then evicted by a second prompt that needs the whole device
    small = ClusterConfig.of(workers=1, page_size=64, device_tokens=4096, host_ratio=0.0)
    two = [Request("a", 0.0, 4000, 1, list(range(8))), Request("b", 100.0, 4000, 1, list(range(100, 108)))]
    extra = simulate(two, small, RunConfig(policy)).summary.extra
    assert extra["event_blocks"] == 62 + 62 + 62  # a stored, a removed, b stored


def test_chunked_prefill_splits_long_prompts() -> None:
    lat = MockerLatency()
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0, prefill_budget=2048)
    req = Request("r0", 0.0, 5000, 1, list(range(10)))
    rec = simulate([req], cfg, RunConfig("round_robin")).records[0]
    assert rec.ttft == pytest.approx((2 * lat.prefill_ms(2048) + lat.prefill_ms(904)) / 1000)


def test_runs_are_deterministic() -> None:
    reqs = chat(150)
    a = simulate(reqs, SMALL, RunConfig("random", seed=5))
    b = simulate(reqs, SMALL, RunConfig("random", seed=5))
    assert a.records == b.records


def test_every_policy_completes() -> None:
    reqs = chat(120)
    from kvtier.sim.policies import POLICIES

    for p in POLICIES:
        s = simulate(reqs, SMALL, RunConfig(p)).summary
        assert s.requests == len(reqs), p
        assert 0.0 <= s.hit_rate <= 1.0


def test_cli_compare_writes_table_json_csv_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["compare", "--trace", "builtin:chat:120", "--policies", "round_robin,kv_all", "--workers", "2",
              "--device-tokens", "32768", "--jobs", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "kv_all" in out and "TTFT p50" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["policy"] for r in summary["runs"]] == ["round_robin", "kv_all"]
    assert (tmp_path / "requests.csv").read_text().count("\n") == 1 + 2 * 120
    for png in ("hit_rate_by_tier.png", "ttft_cdf.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_cli_sweep_gen_trace_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert cli(["gen-trace", "--kind", "agentic", "--requests", "80", "-o", str(trace)]) == 0
    rc = cli(["sweep", "--trace", str(trace), "--workers", "2", "--device-tokens", "32768",
              "--grid", "host_ratio=0,2", "policy=kv_device,kv_host", "--jobs", "2", "--out", str(tmp_path / "s")])
    assert rc == 0
    text = (tmp_path / "s" / "sweep.json").read_text()
    sweep = json.loads(text, parse_constant=lambda c: pytest.fail(f"sweep.json holds {c}: strict JSON refuses it"))
    rows = sweep["runs"]
    assert rows[0]["goodput"] is None  # (no SLO given)
    # What every grid point shares is kept beside them, as summary.json keeps it: the trace, the cluster, the run's
    # settings and the grid itself
    meta = sweep["meta"]
    assert meta["trace"] == str(trace) and meta["requests"] == 80 and meta["cluster"]["workers"] == 2
    assert meta["grid"] == {"host_ratio": [0.0, 2.0], "policy": ["kv_device", "kv_host"]}
    assert meta["run"]["closed_loop"] is True and "policy" not in meta["run"]
    csv_rows = (tmp_path / "s" / "sweep.csv").read_text().splitlines()
    assert csv_rows[0].startswith("host_ratio,policy,requests,") and len(csv_rows) == 5
    for measure in ("hit_rate", "ttft_p90", "tpot_p90"):
        assert (tmp_path / "s" / f"sweep_{measure}.png").stat().st_size > 5_000
    said = capsys.readouterr()
    assert "grid point" in said.out
    # (as compare's: how long it took and the memory it peaked at, with what it wrote)
    assert re.search(r"\nran in \d+\.\d s, peak memory [\d,]+ MiB \(largest process\); wrote .*sweep\.json", said.err)
    assert [(r["host_ratio"], r["policy"]) for r in rows] == [(0.0, "kv_device"), (0.0, "kv_host"),
                                                               (2.0, "kv_device"), (2.0, "kv_host")]
    assert cli(["replay", "--trace", str(trace), "--policy", "teleport"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert cli(["replay", "--trace", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert cli(["sweep", "--grid", "colour=blue"]) == 2


def test_sweep_on_ray_when_installed(tmp_path: Path) -> None:
    # Ray is a dev dependency where it has wheels (x86_64, aarch64): CI runs this on a local Ray cluster.
    pytest.importorskip("ray", reason="Ray has no wheel here; --ray is tested where it installs")
    # A trace file: each Ray task reads it streamed (kvtier.sim.source.MooncakeFile, index pickled).
    trace = tmp_path / "chat.jsonl"
    assert cli(["gen-trace", "--requests", "60", "-o", str(trace)]) == 0
    rc = cli(["sweep", "--trace", str(trace), "--workers", "2", "--device-tokens", "32768", "--ray",
              "--grid", "policy=round_robin,kv_all", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["policy"] for r in rows] == ["round_robin", "kv_all"] and all(r["requests"] == 60 for r in rows)


def test_cli_engine_replays_and_dumps_residency(tmp_path: Path) -> None:
    res = tmp_path / "res.json"
    rc = cli(["engine", "--trace", "builtin:sysprompt:30", "--speed", "1000", "--hold", "0",
              "--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--residency", str(res)])
    assert rc == 0
    tiers = json.loads(res.read_text())
    assert set(tiers) == {"DEVICE", "HOST", "DISK", "EXTERNAL"} and tiers["DEVICE"] and tiers["DISK"]


def test_dynamo_and_min_ttft_policies_use_their_own_cost_models() -> None:
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.indexer.routing.policies import RoutingSettings
    from kvtier.indexer.routing.scoring import DynamoCost, TtftCost
    from kvtier.sim.policies import KvPolicy, make_policy
    from kvtier.wire.protocol import StorageTier

    common = {"workers": 2, "block_size": 64, "loads": LoadTracker(64), "caches": list}
    dyn = make_policy("dynamo", settings=RoutingSettings(host_credit=0.5), **common)  # type: ignore[arg-type]
    ttft = make_policy("min_ttft", settings=RoutingSettings(prefill_budget=4096, capacity_tokens=65_536),
                       **common)  # type: ignore[arg-type]
    assert isinstance(dyn, KvPolicy) and isinstance(ttft, KvPolicy)
    assert isinstance(dyn.router.cost_model, DynamoCost) and dyn.router.cost_model.credits.host == 0.5
    cm = ttft.router.cost_model
    assert isinstance(cm, TtftCost) and (cm.prefill_budget, cm.capacity_tokens) == (4096, 65_536)
    assert dyn.max_tier == ttft.max_tier == StorageTier.EXTERNAL


def test_replay_progress_bar_shows_simulated_time_and_request_rate() -> None:
    from kvtier.sim.run import _progress

    bar = _progress(10, "kv_all", terminal=True)
    bar.sim_now = 1234.4
    bar.update(3)
    text = str(bar)
    bar.close()
    assert "3/10" in text and "req/s" in text and "sim 1,234 s" in text, text


def test_a_replay_piped_to_a_log_writes_lines_not_a_bar(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Without a terminal a replay's progress is a line now and then, not tqdm's bar: its carriage returns ran into
    the table's header in a log."""
    from kvtier.sim.run import _ProgressLines

    monkeypatch.setattr(_ProgressLines, "interval_s", 0.0)
    assert cli(["replay", "--trace", "builtin:chat:40", "--workers", "2", "--no-plots", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "req/s" not in err
    assert re.search(r"^kvtier: kv_all: 40 of 40 requests done after \d+ s \(sim [\d,]+ s\)$", err, re.M), err


_KERNEL_CHECK = r"""
import dataclasses, json, sys
from numba.core.registry import CPUDispatcher
from kvtier.sim import ClusterConfig, RunConfig, load_kernels, simulate
from kvtier.sim.generators import PRESETS, generate

def loaded():
    return sorted(f"{m}.{n}:{len(d.overloads)}" for m, mod in list(sys.modules.items()) if m.startswith("kvtier.")
                  for n, d in vars(mod).items() if isinstance(d, CPUDispatcher) and d.overloads)

backends = load_kernels()
before = loaded()
reqs = generate(dataclasses.replace(PRESETS["chat"], requests=150, system_tokens=1024, user_tokens=600), 1)
for l3 in ("none", "disk", "external"):
    cfg = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=0.0 if l3 == "none" else 1.0,
                        l3=l3, l3_tokens=131_072)
    for policy in ("round_robin", "kv_host", "kv_all", "dynamo", "min_ttft"):
        simulate(reqs, cfg, RunConfig(policy))
print(json.dumps({"backends": backends, "before": before, "after": loaded()}))
"""


@pytest.mark.parametrize("jit", ["1", "0"])
def test_load_kernels_loads_every_kernel_a_run_calls(jit: str) -> None:
    # A fresh process: in this one other tests have loaded kernels already, and nothing would be left to miss.
    out = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env={**os.environ, "KVTIER_JIT": jit},
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = "numba" if jit == "1" else "python (KVTIER_JIT=0)"
    leaf = {k: v for k, v in got["backends"].items() if k != "index tables"}
    assert set(leaf.values()) == {want}, got["backends"]
    assert got["backends"]["index tables"] == "numba", "the index's tables have no Python path: KVTIER_JIT=0 or not"
    assert got["after"] == got["before"], "kernels loaded during the runs, after load_kernels"
    assert got["before"], "the index's tables at least"


def test_azure_traces_get_shared_prefixes_from_the_cli(tmp_path: Path, shared_dir: Path) -> None:
    """An Azure trace has lengths only: --shared-prefix-blocks gives each request its prefix group's leading
    blocks (as Dynamo mocker's trace_shared_prefix_ratio does), so routing has something to find; 0 keeps every
    prompt unique. A file named in capitals (``.CSV``) is an Azure trace too."""
    trace = shared_dir / "traces" / "azure_llm_2023_conv.csv"
    upper = tmp_path / "AZURE.CSV"
    upper.symlink_to(trace)
    hits = []
    for name, blocks in ((trace, "0"), (trace, "4"), (upper, "4")):
        out = tmp_path / f"{name.name}-{blocks}"
        assert cli(["replay", "--trace", str(name), "--limit", "200", "--shared-prefix-blocks", blocks,
                    "--prefix-groups", "4", "--policy", "kv_all", "--no-plots", "--out", str(out)]) == 0
        hits.append(json.loads((out / "summary.json").read_text())["runs"][0]["hit_rate"])
    assert hits[0] == 0.0 and hits[1] > 0.3 and hits[2] == hits[1]


def test_runs_that_take_long_are_not_silent(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """While no run finishes (runs of a long trace in worker processes take minutes), a line says how long it has
    been, every heartbeat_s."""
    from kvtier.sim.cli import _RunsProgress

    monkeypatch.setattr(_RunsProgress, "heartbeat_s", 0.05)
    seen = ""
    with _RunsProgress(3) as progress:
        assert progress.lines  # (stderr is no terminal here)
        deadline = time.monotonic() + 30
        while "kvtier: 0/3 runs done after" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().err
    assert "kvtier: 0/3 runs done after" in seen and "the others are running" in seen


def test_a_comparison_piped_to_a_log_reports_each_run(tmp_path: Path) -> None:
    """Without a terminal (CI, a pipe) tqdm's bar turns itself off: each finished run is a line instead, so a long
    comparison is never silent."""
    out = subprocess.run([sys.executable, "-m", "kvtier", "compare", "--trace", "builtin:chat:60", "--workers", "2",
                          "--policies", "round_robin,kv_all", "--no-plots", "--jobs", "1", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert "run 1/2 done (policy=round_robin; 60 requests)" in out.stderr
    assert "run 2/2 done (policy=kv_all; 60 requests)" in out.stderr


def test_an_overloaded_cluster_is_named_and_lost_batches_are_counted(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose requests mostly queue says so (routing cannot fix it), and a lossy wire's losses and recoveries
    appear in the table, not only in JSON."""
    assert cli(["replay", "--trace", "builtin:chat:300", "--time-scale", "0.02", "--workers", "1",
                "--device-tokens", "32768", "--policy", "kv_all", "--event-loss", "0.05", "--no-plots",
                "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "warning: kv_all: overloaded: the median request waited" in err
    head = out.splitlines()[0].split()
    assert head[-4:] == ["lost", "replays", "dumps", "partial"]
    summary = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert out.splitlines()[2].split()[-4] == str(summary["extra"]["events_lost"]) != "0"


def test_a_finished_job_frees_its_cluster() -> None:
    """A run's caches die in reference cycles; a process running job after job (compare's and sweep's pools)
    must not keep each finished run's cluster until a full collection happens to come. Automatic collection is
    off here, so nothing but the job itself can free them."""
    import gc

    from kvtier.engine.cache import TieredCache
    from kvtier.sim.experiment import RunSpec, execute

    def caches() -> int:
        return sum(isinstance(o, TieredCache) for o in gc.get_objects())

    gc.collect()
    before = caches()
    gc.disable()
    try:
        _, res = execute(RunSpec(chat(60), SMALL, RunConfig("kv_all"), {"policy": "kv_all"}))
        assert res.summary.requests == 60
        assert caches() == before
    finally:
        gc.enable()


def test_write_back_with_disk_loads_a_prefetched_chain_whose_backups_evict_host() -> None:
    """Under write_back, making device room for a chain an L3 prefetch brought in backs up device leaves, and their
    host pages evicted host-only leaves: the chain's own last node among them, then loaded without a host copy
    (an AssertionError in Copies.load). The chain is held while its pages are allocated; the run completes, every
    request accounted for."""
    from kvtier.sim.experiment import resolve_trace

    trace = resolve_trace("builtin:chat:400")
    cluster = ClusterConfig.of(workers=2, device_tokens=16_384, host_ratio=1.0, l3="disk", write_policy="write_back")
    s = simulate(trace, cluster, RunConfig("round_robin")).summary
    assert s.requests + s.unfinished + s.rejected == 400 and s.requests > 300
    assert s.hit_storage > 0  # the L3 tier served prompts: prefetches ran


@pytest.mark.parametrize("load_back", [True, False])
def test_a_host_hit_counts_only_where_it_was_loaded_back(load_back: bool) -> None:
    """A prompt's tokens are booked to the tier they came from. ``c`` and ``b`` find their prefix on host only
    (evicted from device, backed up). Loaded back, both take it from host. With load-back off nothing reaches
    the device from host: ``c`` computes the prefix, and ``b``, which waits for room behind it, takes it from the
    device and is booked to device, not to host."""
    cluster = ClusterConfig.of(workers=1, page_size=64, device_tokens=4096, host_ratio=2.0, load_back=load_back)
    trace = [Request("x", 0.0, 1024, 1, [1, 2]),  # the prefix, written through to host
             Request("filler", 1.0, 4000, 1, list(range(10, 18))),  # evicts it from device; host keeps it
             Request("c", 2.0, 1024, 3000, [1, 2]),  # takes most of the device
             Request("b", 2.0, 1024, 10, [1, 2])]
    res = simulate(trace, cluster, RunConfig("round_robin"))
    c, b = res.records[2], res.records[3]
    tiers = [(r.device_tokens, r.host_tokens, r.recomputed_tokens) for r in (c, b)]
    if load_back:
        assert tiers == [(0, 1024, 0), (0, 1024, 0)]
    else:
        assert b.prefill_start >= c.first_token  # b started after c had computed the prefix
        assert tiers == [(0, 0, 1024), (1024, 0, 0)] and res.summary.hit_host == 0


def test_throughput_counts_the_token_a_zero_output_request_generates() -> None:
    """A request asking for no output still generates one token (its first, from the prefill's logits), as its
    record's TTFT says: throughput counts it (it counted the length asked for, 0)."""
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
    res = simulate([Request("a", 0.0, 640, 0, [1, 2]), Request("b", 0.0, 640, 3, [3, 4])], cfg,
                   RunConfig("round_robin"))
    span = max(r.finish for r in res.records) - min(r.arrival for r in res.records)
    assert res.records[0].ttft > 0 and res.summary.throughput_tok_s == pytest.approx((1 + 3) / span, rel=1e-12)


def test_summary_meta_holds_every_setting_a_run_depends_on(tmp_path: Path) -> None:
    """Two runs with other trace and router settings have other results and say why in ``meta`` (it held the
    cluster and the event path only: runs of other seeds, credits or loop modes looked alike)."""
    base = ["replay", "--trace", "builtin:chat:30", "--no-plots", "--allow-unfinished"]
    other = ["--trace-seed", "3", "--seed", "7", "--host-credit", "0.5", "--temperature", "0.3", "--open-loop",
             "--slo-out-of-reach", "spread", "--until", "500", "--limit", "20"]
    metas = []
    for i, extra in enumerate(([], other)):
        assert cli([*base, *extra, "--out", str(tmp_path / str(i))]) == 0
        metas.append(json.loads((tmp_path / str(i) / "summary.json").read_text())["meta"])
    a, b = metas
    assert (a["run"]["seed"], b["run"]["seed"]) == (0, 7) and b["run"]["host_credit"] == 0.5
    assert (a["run"]["closed_loop"], b["run"]["closed_loop"]) == (True, False)
    assert (a["run"]["until_s"], b["run"]["until_s"]) == (None, 500.0)
    assert b["run"]["temperature"] == 0.3 and b["run"]["slo_out_of_reach"] == "spread"
    assert "policy" not in a["run"]  # (each run names its own)
    assert (a["trace_settings"]["seed"], b["trace_settings"]["seed"]) == (0, 3)
    assert (a["trace_settings"]["limit"], b["trace_settings"]["limit"]) == (None, 20)
    assert set(a["trace_settings"]) == {"limit", "seed", "time_scale", "shared_prefix_blocks", "prefix_groups"}
    assert a["slo_ms"] == {"ttft": None, "tpot": None, "e2e": None} and a["requests"] == 30


def test_plot_titles_and_labels_are_wrapped_inside_the_figure(tmp_path: Path) -> None:
    """Titles name the trace and cluster, labels the SLO: longer than a plot is wide, they ran off its edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.sim.report import _save

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([1, 2], [1, 2])
    ax.set_title("TTFT CDF: /data/traces/mooncake_conversation_trace.jsonl, 16 workers x 1,048,576 device tokens, "
                 "host x4, l3 external")
    ax.set_xlabel("SLO scale (1x: TTFT <= 93.7885 ms, TPOT <= 22.5365 ms, e2e <= 12228.3 ms, p90 of round_robin)")
    _save(fig, tmp_path / "p.png")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # (closed, the figure has no canvas of its own)
    for text in (ax.title, ax.xaxis.label):
        box = text.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and "\n" in text.get_text()


@pytest.mark.parametrize("how", ["mid-write", "signal"])
@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_ctrl_c_while_plotting_leaves_whole_plots_and_status_130(command: str, how: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each plot and a sweep's tables are written whole or not at all: an interrupt raised mid-write (it left a
    truncated PNG, 124 bytes, under its final name) removes the part file. A Ctrl-C while plotting is held until the
    plots are done, then raised: matplotlib's weakref callbacks printed and dropped it, and the command exited 0."""
    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig
    calls = []

    def savefig(self: matplotlib.figure.Figure, fname: Path, *args: object, **kwargs: object) -> None:
        calls.append(fname)
        if len(calls) == 2 and how == "mid-write":  # the second plot: half written, then interrupted
            Path(fname).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 116)
            raise KeyboardInterrupt
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C mid-plot
        real(self, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    argv = [command, "--trace", "builtin:chat:20", "--out", str(tmp_path)]
    if command == "sweep":
        argv += ["--grid", "policy=round_robin,kv_all", "--jobs", "1"]
    assert cli(argv) == 130
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith(".")], names  # no part file left
    pngs = [tmp_path / n for n in names if n.endswith(".png")]
    assert len(pngs) == (1 if how == "mid-write" else len(calls)), names
    assert all(p.read_bytes().endswith(b"IEND\xaeB`\x82") for p in pngs)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (given back)


def test_rejected_requests_are_named_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests that could never fit a worker's device are rejected: a run rejecting every one exited 0 with only a
    number in the table's rej column to say so."""
    assert cli(["replay", "--trace", "builtin:chat:20", "--device-tokens", "1024", "--no-plots",
                "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    rejected = json.loads((tmp_path / "summary.json").read_text())["runs"][0]["rejected"]
    assert rejected > 0
    assert (f"warning: kv_all: {rejected} of 20 requests rejected: their prompt and output do not fit a worker's "
            "device (--device-tokens)") in err
    assert cli(["replay", "--trace", "builtin:chat:20", "--no-plots", "--out", str(tmp_path)]) == 0
    assert "requests rejected" not in capsys.readouterr().err


def test_requests_rejected_for_the_decode_pool_name_its_option(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Disaggregated, a request may fit its prefill worker and no decode worker: the warning blamed --device-tokens
    for rejections --decode-device-tokens made, and summary.json did not tell the two apart."""
    base = ["replay", "--trace", "builtin:chat:60", "--prefill-workers", "1", "--decode-workers", "1", "--no-plots",
            "--device-tokens", "4096", "--allow-unfinished"]
    assert cli([*base, "--decode-device-tokens", "3000", "--out", str(tmp_path / "mixed")]) == 0
    run = json.loads((tmp_path / "mixed" / "summary.json").read_text())["runs"][0]
    decode, rejected = run["extra"]["rejected_decode"], run["rejected"]
    assert 0 < decode < rejected
    assert (f"warning: kv_all: {rejected} of 60 requests rejected: their prompt and output do not fit a worker's "
            f"device: {rejected - decode} a prefill worker's (--device-tokens), {decode} a decode worker's "
            "(--decode-device-tokens, which defaults to --device-tokens)") in capsys.readouterr().err
    assert cli([*base[:-3], "--device-tokens", "65536", "--decode-device-tokens", "256",
                "--out", str(tmp_path / "decode")]) == 0
    run = json.loads((tmp_path / "decode" / "summary.json").read_text())["runs"][0]
    assert run["rejected"] == run["extra"]["rejected_decode"] == 60
    assert ("warning: kv_all: 60 of 60 requests rejected: their prompt and output do not fit a decode worker's "
            "device (--decode-device-tokens") in capsys.readouterr().err
    # prefilled on the decode worker (conditional disaggregation), a prompt rejected there fits no decode worker
    assert cli([*base[:-3], "--device-tokens", "65536", "--decode-device-tokens", "256", "--local-prefill-tokens",
                "100000", "--out", str(tmp_path / "local")]) == 0
    run = json.loads((tmp_path / "local" / "summary.json").read_text())["runs"][0]
    assert run["rejected"] == run["extra"]["rejected_decode"] == 60
    capsys.readouterr()
    assert cli(["replay", "--trace", "builtin:chat:20", "--device-tokens", "1024", "--no-plots",
                "--out", str(tmp_path / "agg")]) == 0
    assert json.loads((tmp_path / "agg" / "summary.json").read_text())["runs"][0]["extra"]["rejected_decode"] == 0


def test_requests_csv_leaves_latencies_that_never_came_empty(tmp_path: Path) -> None:
    """A rejected request has no first token, no finish and no prefill start; an unfinished one lacks some of
    them: requests.csv leaves those cells empty (it wrote -1 minus the arrival: a negative latency a mean took in),
    and a finished one's cells are its latencies."""
    import csv

    assert cli(["replay", "--trace", "builtin:chat:200", "--time-scale", "0.3", "--device-tokens", "3072",
                "--host-ratio", "0", "--policy", "round_robin", "--until", "20", "--allow-unfinished", "--no-plots",
                "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    run = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert run["rejected"] > 0 and run["unfinished"] > 0 and run["requests"] > 0
    rejected = [r for r in rows if r["rejected"] == "1"]
    assert len(rejected) == run["rejected"] and all(r["ttft"] == r["e2e"] == r["queue"] == "" for r in rejected)
    done = [r for r in rows if r["e2e"]]
    assert len(done) == run["requests"]
    assert all(0 <= float(r["queue"]) <= float(r["ttft"]) <= float(r["e2e"]) for r in done)
    waiting = [r for r in rows if r["rejected"] == "0" and not r["e2e"]]
    # (unfinished counts the turns never released before --until too: they have no row)
    assert 0 < len(waiting) <= run["unfinished"] and any(not r["ttft"] for r in waiting)
    assert all(not r[c] or float(r[c]) >= 0 for r in rows for c in ("ttft", "e2e", "queue"))


def test_a_request_stopped_before_its_prefill_books_no_tokens() -> None:
    """Tokens are booked to tiers when a prefill starts: a request admitted but still waiting for device room when
    simulated time stops has 0 tokens on every tier in its record, as ``docs/outputs.md`` says, not the device
    prefix it found at admission."""
    from kvtier.sim.experiment import resolve_trace

    cluster = ClusterConfig.of(workers=2, device_tokens=8192)
    res = simulate(resolve_trace("builtin:chat:100"), cluster, RunConfig("round_robin", until_s=60.0))
    waiting = [r for r in res.records if r.prefill_start < 0 and r.actual_blocks > 0]
    assert waiting and res.summary.unfinished > 0  # some were admitted onto a cached prefix and never started
    assert all((r.device_tokens, r.host_tokens, r.storage_tokens, r.recomputed_tokens) == (0, 0, 0, 0)
               for r in waiting), [(r.request_id, r.device_tokens) for r in waiting]


def test_a_run_that_completes_nothing_reports_no_figures_not_zeros(tmp_path: Path) -> None:
    """Every prompt too big for the device: the run counts 20 rejected and completes none. Its shares, throughput,
    makespan and balance do not apply: null in summary.json, ``-`` in the table, as for its latencies, not a hit
    rate of 0 or a makespan of 0 s."""
    out = tmp_path / "out"
    assert cli(["replay", "--trace", "builtin:chat:20", "--workers", "2", "--device-tokens", "256", "--no-plots",
                "--out", str(out)]) == 0
    run = json.loads((out / "summary.json").read_text())["runs"][0]
    assert (run["requests"], run["rejected"], run["unfinished"]) == (0, 20, 0)
    for field in ("hit_rate", "hit_device", "recomputed", "throughput_tok_s", "makespan_s", "load_imbalance",
                  "ttft_p50"):
        assert run[field] is None, (field, run[field])


@pytest.mark.parametrize(("swa_ratio", "pools"), [(0.0, 0), (0.0078125, 0), (0.01, 0), (0.0, 2), (0.01, 2)])
def test_a_window_pool_of_a_few_windows_serves_every_request(swa_ratio: float, pools: int) -> None:
    """A hybrid model's window-KV pool of one to a few windows: a request whose own cached prefix holds the window
    it would read, beside the pool's other windows, with nothing running to free any, used to wait for ever (most of
    an agentic trace unfinished). As a last resort its path's window KV goes (recomputed), and every request ends;
    disaggregated too, where a prefill worker waits for its handed-off prompts' holds first."""
    reqs = generate(dataclasses.replace(PRESETS["agentic"], requests=200), 0)
    cfg = ClusterConfig(model="gemma-3-27b", swa_ratio=swa_ratio, prefill_workers=pools, decode_workers=pools)
    s = simulate(reqs, cfg, RunConfig("kv_all")).summary
    assert (s.requests, s.unfinished) == (len(reqs), 0)


def test_a_run_that_completes_nothing_plots_without_a_warning(tmp_path: Path) -> None:
    """Every request rejected (prompts past the device): the TTFT CDF has no line, and says so in the plot rather
    than in a matplotlib warning on stderr."""
    import warnings

    from kvtier.sim.cli import main as cli_main

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli_main(["compare", "--trace", "builtin:chat:30", "--workers", "2", "--device-tokens", "1024",
                         "--policies", "kv_all,round_robin", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0


def test_a_run_removes_the_plots_an_earlier_run_left_that_it_does_not_write(tmp_path: Path) -> None:
    """A compare with --no-plots after one with plots, and a sweep without an SLO after one with it, into the same
    --out: the earlier run's plots would pass for this run's results, so they go."""
    from kvtier.sim.cli import main as cli_main
    from kvtier.sim.report import PLOTS

    small = ["--trace", "builtin:chat:30", "--workers", "2", "--device-tokens", "16384", "--out", str(tmp_path)]
    assert cli_main(["compare", *small, "--policies", "kv_all,round_robin"]) == 0
    assert all((tmp_path / p).is_file() for p in PLOTS)
    assert cli_main(["compare", *small, "--policies", "dynamo", "--no-plots"]) == 0
    assert not any((tmp_path / p).exists() for p in PLOTS) and (tmp_path / "summary.json").is_file()
    sweep = ["sweep", *small, "--grid", "seed=1,2"]
    assert cli_main([*sweep, "--sla-ttft-ms", "500"]) == 0
    assert (tmp_path / "sweep_goodput.png").is_file() and (tmp_path / "sweep_hit_rate.png").is_file()
    assert cli_main(sweep) == 0
    assert not (tmp_path / "sweep_goodput.png").exists() and (tmp_path / "sweep_hit_rate.png").is_file()


def test_a_policy_is_labelled_with_the_cost_model_only_if_it_takes_one() -> None:
    """``--cost ttft`` chooses the cost model of the policies that price tiers by it; round_robin[ttft] read as a run
    other than round_robin's, though the cost changes nothing there."""
    assert RunConfig("kv_all", cost="ttft").label == "kv_all[ttft]"
    assert RunConfig("kv_all").label == "kv_all"
    for name in ("round_robin", "dynamo", "min_ttft", "llmd"):
        assert RunConfig(name, cost="ttft").label == name
