"""Disaggregated prefill and decode: the simulated pools, the KV handoff, decode memory, conditional disaggregation,
every policy's (prefill, decode) pair, and the CLI's flags."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.config import WritePolicy
from kvtier.hardware.latency import LATENCY_PRESETS
from kvtier.hardware.latency import PRESETS as MODELS
from kvtier.hardware.links import KV_LINKS
from kvtier.indexer.routing.disagg import KvLinkCost, decode_cost, prefill_cost, prefills_locally
from kvtier.indexer.routing.load import WorkerLoad
from kvtier.indexer.routing.policies import POLICIES, RoutingSettings
from kvtier.indexer.routing.scoring import SLO_MISS_MS, SloCost
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.core import Environment
from kvtier.sim.disagg import DisaggPolicy
from kvtier.sim.experiment import grid_jobs, parse_grid
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.kvlink import KvLink
from kvtier.sim.metrics import RequestRecord, SummaryBuilder, summarize
from kvtier.sim.policies import KvPolicy
from kvtier.sim.run import RunConfig, routing_settings, simulate
from kvtier.sim.trace import Request
from kvtier.util.fields import ConfigError
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.protocol import StorageTier

PD = ClusterConfig.of(prefill_workers=1, decode_workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
BYTES = MODELS["llama-3.1-8b"].bytes_per_token


def req(rid: str, t: float, tokens: int, out: int, blocks: list[int], session: str | None = None) -> Request:
    """A request of ``tokens`` prompt tokens made of 512-token blocks ``blocks`` (the trace's hash ids)."""
    return Request(rid, t, tokens, out, blocks, session=session)


def _spy_policies(monkeypatch: pytest.MonkeyPatch) -> list[DisaggPolicy]:
    """The disaggregated policies the simulator builds from now on, as it builds them."""
    import kvtier.sim.run as run_module

    seen: list[DisaggPolicy] = []

    class Spy(DisaggPolicy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(run_module, "DisaggPolicy", Spy)
    return seen


def test_a_lone_requests_ttft_is_its_prefill_the_transfer_and_one_decode_step() -> None:
    """The KV moves after the prefill (not layer by layer beside it), over the named link, and the decode worker's
    first step makes the first token: all three are in TTFT, to the float."""
    n = 3000
    one = [req("a", 0.0, n, 5, [1, 2, 3, 4, 5, 6])]
    res = simulate(one, PD, RunConfig("round_robin"))
    rec = res.records[0]
    lat = PD.latency
    prefill = lat.prefill_ms(n) / 1000
    transfer = n * BYTES / (KV_LINKS["rdma-400g"].gbps * 1e9)
    step = lat.decode_ms(n / PD.capacity_tokens()) / 1000
    assert rec.worker == 0 and rec.decode_worker == 1
    assert rec.prefill_end == pytest.approx(prefill, rel=1e-12)
    assert rec.transferred_tokens == n and rec.decode_cached_tokens == 0
    assert rec.ttft == pytest.approx(prefill + transfer + step, rel=1e-9)
    assert rec.finish > rec.first_token and rec.recomputed_tokens == n
    # The link is the one named: twice the bandwidth halves the transfer.
    fast = simulate(one, PD.replace(kv_gbps=100.0), RunConfig("round_robin"))
    assert fast.records[0].ttft == pytest.approx(prefill + transfer / 2 + step, rel=1e-9)


@pytest.mark.parametrize("n", [3000, 700])
def test_a_hybrid_models_transfer_carries_the_window_kv_of_the_prompts_last_window(n: int) -> None:
    """A hybrid model's decode worker needs the sliding-window layers' KV of the prompt's last window beside every
    token's full-attention KV, as a load from host does (SGLang's trailing pages): the link carried the full KV
    alone, a TTFT too short by the window's bytes. The router prices the same bytes."""
    model = MODELS["gemma-3-27b"]
    swa = PD.replace(model="gemma-3-27b", device_tokens=131_072)
    rec = simulate([req("a", 0.0, n, 5, list(range(1, 1 + -(-n // 512))))], swa, RunConfig("round_robin")).records[0]
    nbytes = n * model.bytes_per_token + min(n, model.window_tokens) * model.window_bytes_per_token
    assert rec.transferred_tokens == n
    lat = swa.latency
    step = lat.decode_ms(n / swa.capacity_tokens()) / 1000
    assert rec.ttft == pytest.approx(rec.prefill_end + nbytes / (KV_LINKS["rdma-400g"].gbps * 1e9) + step, rel=1e-9)
    price = KvLinkCost.of(routing_settings(swa, RunConfig("round_robin")))
    assert price.transfer_ms(n) == pytest.approx(nbytes / (KV_LINKS["rdma-400g"].gbps * 1e6), rel=1e-12)


def test_a_later_turn_whose_context_is_on_its_decode_worker_transfers_only_the_new_part() -> None:
    trace = [req("a", 0.0, 2048, 4, [1, 2, 3, 4], "s"), req("b", 5.0, 2748, 4, [1, 2, 3, 4, 5, 6], "s")]
    a, b = simulate(trace, PD, RunConfig("round_robin")).records
    assert a.transferred_tokens == 2048
    held = 2048  # the first prompt's pages joined the decode worker's radix cache
    assert b.decode_cached_tokens == held and b.transferred_tokens == 2748 - held
    # the prefill worker hit its own cache too: the two sides are separate caches
    assert b.device_tokens == held


@pytest.mark.parametrize("cluster", [
    PD.replace(prefill_workers=2, decode_workers=2, device_tokens=32_768, host_ratio=1.0, l3="disk",
                        l3_tokens=131_072),
    PD.replace(prefill_workers=2, decode_workers=1, device_tokens=32_768, host_ratio=2.0,
                        l3="external", l3_tokens=262_144, local_prefill_tokens=7000),
    PD.replace(prefill_workers=2, decode_workers=2, device_tokens=32_768, host_ratio=1.0, l3="disk",
                        l3_tokens=131_072, write_policy=WritePolicy.WRITE_BACK),
    PD.replace(prefill_workers=2, decode_workers=2, device_tokens=32_768, host_ratio=1.0, l3="disk",
                        l3_tokens=131_072, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE),
])
@pytest.mark.parametrize("policy", ["round_robin", "min_ttft"])
def test_tokens_by_tier_and_by_side_sum_to_the_prompt(cluster: ClusterConfig, policy: str) -> None:
    """Every prefilled prompt is booked once by tier on the worker that computed it (device + host + storage +
    recomputed), and, when its KV moved, once on the decode side (held there + transferred)."""
    trace = generate(dataclasses.replace(PRESETS["agentic"], requests=200), 3)
    res = simulate(trace, cluster, RunConfig(policy))
    assert res.summary.requests + res.summary.rejected == 200 and res.summary.unfinished == 0
    moved = local = 0
    for r in res.records:
        if r.rejected:
            continue
        assert r.device_tokens + r.host_tokens + r.storage_tokens + r.recomputed_tokens == r.input_tokens
        assert cluster.role(r.decode_worker) == "decode"
        if r.prefill_end >= 0:
            moved += 1
            assert cluster.role(r.worker) == "prefill"
            assert r.decode_cached_tokens + r.transferred_tokens == r.input_tokens
        else:
            local += 1
            assert r.worker == r.decode_worker and r.transferred_tokens == 0
    assert moved > 0
    assert (local > 0) == (cluster.local_prefill_tokens > 0)
    assert res.summary.hit_host + res.summary.hit_storage > 0  # the prefill pool's tiers are used
    # The summary's shares of what moved over the link, and of what the decode side held already
    done = [r for r in res.records if r.finish >= 0]
    handed = [r for r in done if r.prefill_end >= 0]
    assert res.summary.kv_transferred == sum(r.transferred_tokens for r in done) / sum(r.input_tokens for r in done)
    assert res.summary.decode_cached == (sum(r.decode_cached_tokens for r in handed)
                                         / sum(r.input_tokens for r in handed)) > 0
    agg = simulate(trace[:20], cluster.replace(prefill_workers=0, decode_workers=0, workers=2), RunConfig(policy))
    assert math.isnan(agg.summary.kv_transferred) and math.isnan(agg.summary.decode_cached)


def test_decode_admission_waits_for_memory_and_requests_never_vanish() -> None:
    """A decode worker admits a request once its prompt and whole output fit: the others wait (their first token
    comes late), none is lost, and a run stopped early counts the waiting ones unfinished."""
    cluster = PD.replace(device_tokens=4096)
    trace = [req(f"r{i}", 0.0, 1500, 500, [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(4)]
    res = simulate(trace, cluster, RunConfig("round_robin"))
    assert res.summary.requests == 4 and res.summary.unfinished == 0
    # The decode worker holds two at a time (2 x 2,000 tokens of 4,096): the later two waited for the first two.
    firsts = sorted(r.first_token for r in res.records)
    finishes = sorted(r.finish for r in res.records)
    assert firsts[2] > finishes[1] > firsts[1]
    cut = simulate(trace, cluster, RunConfig("round_robin", until_s=(finishes[1] + firsts[2]) / 2))
    assert cut.summary.unfinished == 2 and cut.summary.requests == 2
    # One that could never fit is rejected, not queued forever.
    big = simulate([req("x", 0.0, 3000, 2000, [1, 2, 3, 4, 5, 6])], cluster, RunConfig("round_robin"))
    assert big.summary.rejected == 1 and big.records[0].rejected
    # Nor one that fills a device with no output: its prefill worker reserves a token more than the prompt (as
    # a prefill request with max_tokens=1 does), so it fits nowhere; and the request behind it runs.
    full = simulate([req("x", 0.0, 4096, 0, list(range(8))), req("y", 0.1, 100, 5, [100])], cluster,
                    RunConfig("round_robin"))
    assert (full.summary.rejected, full.summary.requests, full.summary.unfinished) == (1, 1, 0)
    assert [r.rejected for r in full.records] == [True, False]
    # An aggregated worker of that device alike: a request asking for no output generates one token all the same.
    agg = cluster.replace(prefill_workers=0, decode_workers=0, workers=1)
    for out in (0, 1):
        alone = simulate([req("x", 0.0, 4096, out, list(range(8)))], agg, RunConfig("round_robin"))
        assert alone.summary.rejected == 1, out


def test_short_uncached_prompts_prefill_on_their_decode_worker() -> None:
    cluster = PD.replace(local_prefill_tokens=512)
    rec = simulate([req("a", 0.0, 300, 3, [1])], cluster, RunConfig("round_robin")).records[0]
    assert rec.worker == rec.decode_worker == 1 and rec.prefill_end == -1.0 and rec.transferred_tokens == 0
    assert rec.ttft == pytest.approx(cluster.latency.prefill_ms(300) / 1000, rel=1e-12)
    long = simulate([req("a", 0.0, 2000, 3, [1, 2, 3, 4])], cluster, RunConfig("round_robin")).records[0]
    assert long.worker == 0 and long.transferred_tokens == 2000
    assert prefills_locally(1000, 600, 512) and not prefills_locally(1000, 400, 512)
    assert not prefills_locally(10, 0, 0)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_prefills_a_turn_whose_context_its_decode_worker_holds_there(policy: str) -> None:
    """Conditional disaggregation reads the decode worker's device overlap from the index whatever the policy, as
    the service's pool does: a second turn whose 2,048-token context is on its (only) decode worker lacks 300
    tokens there, under the threshold, so it prefills there, for a policy that keeps no index of its own too
    (round robin, least loaded, an incumbent's plugin, the routing history, the oracle)."""
    trace = [req("t0", 0.0, 2048, 4, [1, 2, 3, 4], "s"), req("t1", 5.0, 2348, 4, [1, 2, 3, 4, 5], "s")]
    res = simulate(trace, PD.replace(local_prefill_tokens=512), RunConfig(policy))
    first, second = res.records
    assert first.worker == 0 and first.transferred_tokens == 2048  # the first turn: nothing cached, transferred
    assert second.worker == second.decode_worker == 1 and second.prefill_end == -1.0
    assert (second.device_tokens, second.recomputed_tokens) == (2048, 300)


def test_a_conditional_pools_prefill_side_learns_only_what_went_there() -> None:
    """Round robin over 2 prefill workers and 1 decode worker, conditional: the second turn prefills on its decode
    worker, so the prefill turn stays where it was, as the service's pool keeps it (its round robin moves at
    ``routed``): the cold third request goes to w1 (it went to w0 again when the turn moved for the second)."""
    trace = [req("t0", 0.0, 2048, 4, [1, 2, 3, 4], "s"), req("t1", 5.0, 2348, 4, [1, 2, 3, 4, 5], "s"),
             req("c", 10.0, 2048, 4, [7, 8, 9, 10])]
    res = simulate(trace, PD.replace(prefill_workers=2, local_prefill_tokens=512), RunConfig("round_robin"))
    assert [(r.worker, r.decode_worker) for r in res.records] == [(0, 2), (2, 2), (1, 2)]


def test_the_wait_for_room_on_a_decode_worker_is_recorded_reported_and_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt computed on its prefill worker waits for room (its prompt and output) on its decode worker before its
    KV moves: that wait is its ``decode_queue`` (``receive_start - prefill_end``), in requests.csv and summarized in
    summary.json, and a run whose median request spent most of its TTFT there is named overloaded: the decode pool is
    short, which the prefill queue (``queue``) does not show."""
    cluster = PD.replace(device_tokens=4096)
    trace = [req(f"r{i}", 0.0, 1500, 500, [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(4)]
    res = simulate(trace, cluster, RunConfig("round_robin"))
    recs = sorted(res.records, key=lambda r: r.first_token)
    transfer = 1500 * BYTES / (KV_LINKS["rdma-400g"].gbps * 1e9)
    for r in recs:  # the wait, then the transfer, then the first decode step: all in TTFT
        assert r.prefill_end >= 0 and r.receive_start >= r.prefill_end
        assert r.decode_queue == r.receive_start - r.prefill_end
        assert r.first_token > r.receive_start + transfer
    # The first two are received at once; the later two waited for them to finish on the decode worker.
    assert recs[0].decode_queue == recs[1].decode_queue == 0.0
    assert min(r.decode_queue for r in recs[2:]) >= min(r.finish for r in recs[:2]) - max(r.prefill_end
                                                                                          for r in recs[2:])
    waits = sorted(r.decode_queue for r in recs)
    assert res.summary.decode_queue_p50 == pytest.approx((waits[1] + waits[2]) / 2)
    assert res.summary.decode_queue_p99 <= waits[3] and res.summary.decode_queue_p90 > waits[1]
    # An aggregated run hands nothing off: no wait to report.
    agg = simulate(trace, cluster.replace(prefill_workers=0, decode_workers=0, workers=2), RunConfig("round_robin"))
    assert all(r.receive_start == -1.0 and math.isnan(r.decode_queue) for r in agg.records)
    assert math.isnan(agg.summary.decode_queue_p50)
    # The CLI: a decode pool of one behind three prefill workers, arrivals faster than it decodes.
    assert cli(["replay", "--trace", "builtin:chat:200", "--time-scale", "0.2", "--open-loop",
                "--prefill-workers", "3", "--decode-workers", "1", "--device-tokens", "65536",
                "--policy", "round_robin", "--no-plots", "--out", str(tmp_path)]) == 0
    _, err = capsys.readouterr()
    assert "3 prefill + 1 decode workers" in err
    assert "round_robin: overloaded: the median request handed to a decode worker waited" in err
    assert "there for room (the median TTFT: " in err
    summary = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert summary["queue_p50"] < 1.0 < summary["decode_queue_p50"]
    # A decode wait over a second at the median is the decode pool's shortage even where it is under half the TTFT
    # (the rest: long prefills in crowded batches), as round robin's 3.6 s of a 7.6 s TTFT on 2 + 2 workers, beside
    # policies with longer waits.
    from kvtier.sim.report import overloaded

    assert overloaded(dataclasses.replace(res.summary, queue_p50=0.007, decode_queue_p50=3.6, ttft_p50=7.6))
    assert overloaded(dataclasses.replace(res.summary, queue_p50=0.007, decode_queue_p50=0.9, ttft_p50=1.5)) is None
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    done = [r for r in rows if r["e2e"]]
    assert all(float(r["decode_queue"]) >= 0 and float(r["prefill_end"]) >= float(r["queue"]) for r in done)
    waited = sorted(float(r["decode_queue"]) for r in done)
    assert summary["decode_queue_p50"] == pytest.approx(statistics.median(waited), abs=2e-6)


def test_a_summary_of_a_disaggregated_runs_records_is_the_runs() -> None:
    """:func:`summarize` over a disaggregated run's records, told its prefill pool, gives the run's own summary (the
    load imbalance the worse pool's, not the whole cluster's: round robin balances each pool, 6 decode workers
    beside 2 prefill ones)."""
    cluster = PD.replace(prefill_workers=2, decode_workers=6, device_tokens=32_768)
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=120, system_tokens=1024, user_tokens=600), 1)
    res = simulate(trace, cluster, RunConfig("round_robin"))
    again = summarize("round_robin", res.records, cluster.workers, total=len(trace), prefill_workers=2)
    # (the run adds its event counts as extra; NaN where a figure does not apply: compared as text)
    assert repr(again) == repr(dataclasses.replace(res.summary, extra={}))
    assert res.summary.load_imbalance == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_picks_a_prefill_and_a_decode_worker(policy: str) -> None:
    cluster = PD.replace(prefill_workers=2, decode_workers=2, device_tokens=32_768, host_ratio=1.0)
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=120, system_tokens=1024, user_tokens=600), 1)
    res = simulate(trace, cluster, RunConfig(policy))
    assert res.summary.requests == 120 and res.summary.unfinished == 0
    assert {r.worker for r in res.records} <= {0, 1} and {r.decode_worker for r in res.records} <= {2, 3}
    assert len({r.decode_worker for r in res.records}) == 2  # both decode workers are used
    if policy == "round_robin":  # each pool in turn: the imbalance is the worse pool's, not the idle other pool's
        assert res.summary.load_imbalance == pytest.approx(1.0, abs=0.05)


def test_dynamo_picks_decode_by_load_and_min_ttft_by_the_kv_it_need_not_move() -> None:
    """Sessions one after another on an idle cluster of two decode workers: Dynamo's decode router weighs no
    overlap, so a later turn lands on either (ties at random); kvtier's time cost sends it back to the decode worker
    holding its context, which then receives only the new part."""
    cluster = PD.replace(decode_workers=2)
    trace = []
    for s in range(12):
        base = [100 * s + k for k in range(6)]
        for turn in range(3):
            trace.append(req(f"s{s}t{turn}", 10.0 * s + 3.0 * turn, 512 * (4 + turn), 4, base[:4 + turn], f"s{s}"))
    same: dict[str, int] = {}
    for name in ("dynamo", "min_ttft"):
        recs = simulate(trace, cluster, RunConfig(name)).records
        first = {r.request_id[:-2]: r.decode_worker for r in recs if r.request_id.endswith("t0")}
        later = [r for r in recs if not r.request_id.endswith("t0")]
        same[name] = sum(r.decode_worker == first[r.request_id[:-2]] for r in later)
        if name == "min_ttft":
            assert all(r.decode_cached_tokens == r.input_tokens - 512 for r in later)
    assert same["min_ttft"] == 24
    assert 4 <= same["dynamo"] <= 20  # by load alone: ties at random, wherever the context is


def test_goodput_checks_its_tpot_bound_on_the_decode_side() -> None:
    """A decode worker whose batch would pass the TPOT bound costs more than any that meets it; the prefill side of
    goodput keeps the TTFT bound only (a prefill worker does not decode the request)."""
    settings = RoutingSettings(capacity_tokens=100_000, slo_ttft_ms=500.0, slo_tpot_ms=12.0)
    dec = decode_cost("goodput", settings)
    pre = prefill_cost("goodput", settings)
    assert isinstance(dec, KvLinkCost) and dec.tpot_ms == 12.0
    assert isinstance(pre, SloCost) and pre.tpot_ms is None and pre.ttft_ms == 500.0
    none = TierOverlap(0, 0, 0, 0)
    busy = WorkerLoad(running=100, context_tokens=90_000)
    idle = WorkerLoad()
    assert dec.cost(4096, 64, none, busy) >= SLO_MISS_MS > dec.cost(4096, 64, none, idle)
    assert decode_cost("min_ttft", settings).cost(4096, 64, none, busy) < SLO_MISS_MS


@pytest.mark.parametrize("name", ["kv_all", "kv_swa"])
@pytest.mark.parametrize("cost", ["credit", "ttft"])
def test_the_decode_side_credits_no_shared_pool(name: str, cost: str) -> None:
    """A decode worker receives the KV it lacks on its own tiers over the link, a shared pool's blocks included. The
    pool was credited, and a tier's credit counts the blocks past the tier above it, so of two decode workers the
    one holding less of the prompt on device gained more (in a 2+2 run with a pool, 92 of 250 requests went to
    another decode worker than the one the decode engines' own state picks)."""
    dec = decode_cost(name, RoutingSettings(cost=cost))
    for own in (TierOverlap(0, 0, 0, 0), TierOverlap(16, 16, 16, 16), TierOverlap(10, 20, 30, 30)):
        pooled = TierOverlap(own.device, own.host, own.disk, 45)
        assert dec.cost(4096, 64, pooled, WorkerLoad()) == dec.cost(4096, 64, own, WorkerLoad())


def test_kv_link_cost_prices_the_missing_kv_in_time() -> None:
    c = KvLinkCost(BYTES, 50.0)
    none, half = TierOverlap(0, 0, 0, 0), TierOverlap(32, 32, 32, 32)
    assert c.cost(4096, 64, none, WorkerLoad()) == pytest.approx(4096 * BYTES / 50e6)
    assert c.cost(4096, 64, half, WorkerLoad()) == pytest.approx(2048 * BYTES / 50e6)


def test_pool_flags_sweep_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = parse_grid(["prefill_workers=2,1", "decode_workers=2"])
    jobs = grid_jobs(generate(dataclasses.replace(PRESETS["chat"], requests=5), 0), ClusterConfig.of(workers=4),
                     RunConfig("round_robin"), grid)
    assert [(j.cluster.prefill_workers, j.cluster.workers) for j in jobs] == [(2, 4), (1, 3)]
    splits = grid_jobs(generate(dataclasses.replace(PRESETS["chat"], requests=5), 0), ClusterConfig.of(workers=16),
                       RunConfig("round_robin"), parse_grid(["pools=agg,8:8,4:12"]))
    assert [(j.cluster.prefill_workers, j.cluster.decode_workers, j.cluster.workers) for j in splits] == [
        (0, 0, 16), (8, 8, 16), (4, 12, 16)]
    with pytest.raises(ValueError, match="not P:D"):
        parse_grid(["pools=8:0"])
    for argv, expected in (
        (["--prefill-workers", "2"], "give both"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--workers", "3"], "--workers 3"),
        (["--prefill-workers", "1", "--decode-workers", "1", "--kv-link-gbps", "0"], "--kv-link-gbps"),
        (["--prefill-workers", "-1", "--decode-workers", "1"], "--prefill-workers: -1"),
    ):
        try:
            rc = cli(["replay", "--trace", "builtin:chat:3", "--out", str(tmp_path), *argv])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and len(err) == 1 and expected in err[0], (argv, err)
    rc = cli(["replay", "--trace", "builtin:chat:20", "--out", str(tmp_path), "--prefill-workers", "1",
              "--decode-workers", "2", "--kv-link", "tcp-100g", "--policy", "dynamo"])
    assert rc == 0


def test_both_pools_publish_through_the_codec_and_the_index_knows_their_roles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill workers announce what they computed (and backed up to host), decode workers what they received: one
    index hears both, through the real codec, each worker with its role; the router sees the prefill side's tiers
    and the decode side's device overlap apart."""
    seen = _spy_policies(monkeypatch)
    cluster = PD.replace(decode_workers=2, host_ratio=1.0, device_tokens=32_768)
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=80, system_tokens=1024, user_tokens=600), 1)
    res = simulate(trace, cluster, RunConfig("kv_all"))
    assert res.events_published > 0 and res.summary.extra["events_lost"] == 0
    kv = seen[0].kv
    assert kv is not None
    index = kv.index
    assert [index.role(s) for s in kv.streams] == ["prefill", "decode", "decode"]
    assert index.block_counts(kv.streams[0])[StorageTier.HOST] > 0  # the prefill side's tiers
    for s in kv.streams[1:]:  # what the decode workers received, on their device only
        counts = index.block_counts(s)
        assert counts[StorageTier.DEVICE] > 0 and counts[StorageTier.HOST] == 0
    assert routing_settings(cluster, RunConfig("kv_all")).kv_gbps == KV_LINKS["rdma-400g"].gbps


def test_lost_events_of_either_pool_are_recovered_by_dumps() -> None:
    """Batches of prefill and decode workers lost on the way are replayed or dumped from their engines: the index
    ends as it would have without loss, and every request completes."""
    cluster = PD.replace(prefill_workers=2, decode_workers=2, device_tokens=32_768, host_ratio=1.0)
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=150, system_tokens=1024, user_tokens=600), 2)
    res = simulate(trace, cluster, RunConfig("min_ttft", event_loss=0.1, loss_burst=3, replay_buffer=2, seed=1))
    assert res.events_lost > 0 and res.wire.dumps > 0
    assert res.summary.requests == 150 and res.summary.unfinished == 0


def test_a_decode_side_with_its_own_index_hears_the_events_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """llm-d's precise scorer runs once per pool, each over its own index: both indexes hear both pools."""
    seen = _spy_policies(monkeypatch)
    cluster = PD.replace(decode_workers=2, host_ratio=1.0, device_tokens=32_768)
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=60, system_tokens=1024, user_tokens=600), 1)
    simulate(trace, cluster, RunConfig("llmd_precise"))
    dec = seen[0].decode
    assert isinstance(dec, KvPolicy) and dec.index is not seen[0].prefill.index  # type: ignore[attr-defined]
    assert all(dec.index.block_counts(s)[StorageTier.DEVICE] > 0 for s in dec.streams)
    assert [dec.index.role(s) for s in dec.streams] == ["prefill", "decode", "decode"]


def test_a_request_prefilled_on_its_decode_worker_counts_there_once() -> None:
    """Disaggregated, a request counts on its prefill and its decode worker; prefilled locally (conditional
    disaggregation) they are one worker, which it loads once: per-worker counts and the imbalance say so."""
    b = SummaryBuilder(4)
    b.split = 2  # workers 0-1 prefill, 2-3 decode

    def done(i: int, worker: int, decode: int) -> RequestRecord:
        r = RequestRecord(f"r{i}", worker, 0.0, 100, 10)
        r.prefill_start, r.first_token, r.finish, r.recomputed_tokens, r.decode_worker = 0.0, 0.1, 1.0, 100, decode
        return r

    for r in (done(0, 0, 2), done(1, 1, 3), done(2, 2, 2)):  # r2 prefilled on its decode worker, 2
        b.add(r)
    assert b.per_worker == [1, 1, 2, 1]
    assert b.summary("x").load_imbalance == pytest.approx(max(2 / 1.5, 1.0))


def test_a_plugin_policy_routes_a_disaggregated_cluster_from_start_to_end() -> None:
    """A user's plugin picks both sides of the pair, a second instance of it over the decode pool (as the service
    builds it): the run completes every request, where the decode rule's lookup used to stop it mid-run with
    'unknown policy'."""
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=30), 1)
    cfg = PD.replace(prefill_workers=2, decode_workers=2)
    plugin = str(Path(__file__).resolve().parent.parent / "examples" / "fresh_first_policy.py") + ":FreshFirst"
    res = simulate(reqs, cfg, RunConfig(plugin))
    assert res.summary.requests == len(reqs) and res.summary.unfinished == 0
    assert {r.worker for r in res.records} <= {0, 1} and {r.decode_worker for r in res.records} <= {2, 3}


def test_a_sweep_over_splits_takes_the_link_options(tmp_path: Path) -> None:
    """The link's options with a grid whose points split the cluster apply to every split point: the sweep ran every
    point, then refused them for the aggregated cluster its options alone describe, exit 2 and nothing written."""
    out = tmp_path / "s"
    assert cli(["sweep", "--trace", "builtin:chat:6", "--workers", "4", "--no-plots", "--kv-link", "tcp-100g",
                "--local-prefill-tokens", "64", "--grid", "pools=2:2,1:3", "--out", str(out)]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [run["pools"] for run in sweep["runs"]] == ["2:2", "1:3"]
    assert sweep["meta"]["cluster"]["local_prefill_tokens"] == 64


def test_an_aggregated_point_of_a_link_axis_runs_once_tagged_not_applicable(tmp_path: Path) -> None:
    """``pools=agg,2:2`` crossed with ``kv_link``: the aggregated point has no link, so it runs once, not once per
    link, its link tagged None (null in sweep.json, empty in sweep.csv); the split point runs per link. The plots
    draw it as a level across the link axis."""
    grid = parse_grid(["kv_link=tcp-100g,rdma-400g", "pools=agg,2:2"])
    jobs = grid_jobs(generate(dataclasses.replace(PRESETS["chat"], requests=5), 0), ClusterConfig.of(workers=4),
                     RunConfig("round_robin"), grid)
    assert [(j.tag["kv_link"], j.tag["pools"]) for j in jobs] == [
        (None, "agg"), ("tcp-100g", "2:2"), ("rdma-400g", "2:2")]
    agg = jobs[0].cluster
    assert not agg.disaggregated and agg.kv_link == ClusterConfig.of(workers=4).kv_link
    pools = grid_jobs(generate(dataclasses.replace(PRESETS["chat"], requests=5), 0), ClusterConfig.of(workers=4),
                      RunConfig("round_robin"), parse_grid(["pools=agg,2:2", "decode_max_running=4,8"]))
    assert [(j.tag["pools"], j.tag["decode_max_running"], j.cluster.decode_config().max_running if
             j.cluster.disaggregated else None) for j in pools] == [("agg", None, None), ("2:2", 4, 4), ("2:2", 8, 8)]
    out = tmp_path / "s"
    assert cli(["sweep", "--trace", "builtin:chat:6", "--workers", "4", "--grid", "kv_link=tcp-100g,rdma-400g",
                "pools=agg,2:2", "local_prefill_tokens=0,64", "--out", str(out)]) == 0
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["kv_link"], r["pools"], r["local_prefill_tokens"]) for r in runs] == [
        (None, "agg", None), ("tcp-100g", "2:2", 0), ("tcp-100g", "2:2", 64), ("rdma-400g", "2:2", 0),
        ("rdma-400g", "2:2", 64)]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert (rows[0]["kv_link"], rows[0]["pools"], rows[0]["local_prefill_tokens"]) == ("", "agg", "")
    assert (out / "sweep_hit_rate.png").stat().st_size > 0


def test_the_decode_pool_is_sized_apart() -> None:
    """``decode_device_tokens`` and ``decode_max_running`` size the decode workers alone (as Dynamo's mocker takes
    decode engine args apart): their caches, their batch, and the rejection of a request no decode device could
    hold. Unset, the decode pool is the prefill pool's size."""
    cfg = PD.replace(decode_device_tokens=8192, decode_max_running=1)
    dec = cfg.decode_config()
    assert (dec.device_tokens, dec.max_running, dec.workers, dec.disaggregated) == (8192, 1, 1, False)
    assert (PD.decode_config().device_tokens, PD.decode_config().max_running) == (PD.device_tokens, PD.max_running)
    with pytest.raises(ConfigError, match="--decode-device-tokens: 128 holds fewer than 4 pages"):
        PD.replace(decode_device_tokens=128)
    # fits the prefill worker's 65,536 tokens, not the decode worker's 8,192 (prompt and whole output): rejected
    reqs = [Request(f"r{i}", 0.01 * i, 2048, 64, [10 * i + k for k in range(4)]) for i in range(6)]
    reqs.append(Request("big", 0.1, 8192, 64, list(range(1000, 1016))))
    # no output, its prompt the decode device's size: the one token every request generates does not fit either
    reqs.append(Request("full", 0.1, 8192, 0, list(range(2000, 2016))))
    res = simulate(reqs, cfg, RunConfig("kv_host"))
    by_id = {r.request_id: r for r in res.records}
    assert by_id["big"].rejected and by_id["full"].rejected
    assert res.summary.rejected == 2 and res.summary.unfinished == 0
    assert simulate(reqs, PD, RunConfig("kv_host")).summary.rejected == 0
    # one request at a time in the decode worker's batch: its decodes never overlap
    def overlapping(records: list[RequestRecord]) -> bool:
        spans = sorted((r.receive_start, r.finish) for r in records if not r.rejected)
        return any(b[0] < a[1] for a, b in itertools.pairwise(spans))
    assert not overlapping(res.records) and overlapping(simulate(reqs[:6], PD, RunConfig("kv_host")).records)


def test_a_runs_decode_side_prices_with_the_decode_pools_capacity_and_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's router prices its decode side on the decode pool (its capacity, and a latency fit that states its
    pool rescaled to that capacity), its prefill side on the prefill pool: the policy a run builds is the one read."""
    built = _spy_policies(monkeypatch)
    cfg = PD.replace(decode_device_tokens=16_384, latency=LATENCY_PRESETS["h200-llama-3.1-8b"])
    reqs = [Request(f"r{i}", 0.01 * i, 1024, 8, [10 * i + k for k in range(2)]) for i in range(4)]
    assert simulate(reqs, cfg, RunConfig("min_ttft")).summary.unfinished == 0
    (policy,) = built
    assert policy.decode_router is not None
    link = policy.decode_router.cost_model
    assert isinstance(link, KvLinkCost) and link.capacity_tokens == 16_384
    assert link.latency == cfg.latency.for_pool(16_384) != cfg.latency.for_pool(65_536)
    prefill = policy.kv.router.cost_model if policy.kv is not None else None
    assert prefill is not None and getattr(prefill, "capacity_tokens", None) == 65_536


def test_the_kv_link_shares_each_nic_among_the_transfers_it_carries() -> None:
    """``kv_link_sharing="nic"``: transfers into one decode worker share its NIC, as do transfers out of one prefill
    worker, each at its bottleneck's fair share, recomputed as transfers start and end; ``none`` moves each at the whole
    bandwidth (Dynamo's mocker)."""
    def ends(sharing: str, starts: list[tuple[float, int, int]]) -> list[float]:
        env = Environment()
        link = KvLink(env, 1.0, sharing)  # 1 GB/s
        out = [math.nan] * len(starts)
        for k, (t, src, dst) in enumerate(starts):
            def go(k: int = k, src: int = src, dst: int = dst) -> None:
                link.start(src, dst, 1e9, lambda: out.__setitem__(k, env.now))
            env.at(t, go)
        env.run()
        assert link.in_flight == 0
        return out
    # two into worker 9 share its NIC; one from 2 into 8 has both NICs alone
    assert ends("nic", [(0, 0, 9), (0, 1, 9), (0, 2, 8)]) == pytest.approx([2.0, 2.0, 1.0])
    assert ends("none", [(0, 0, 9), (0, 1, 9), (0, 2, 8)]) == pytest.approx([1.0, 1.0, 1.0])
    # the second starts halfway through the first: 0.5 GB each at half speed, then the rest alone
    assert ends("nic", [(0, 0, 9), (0.5, 1, 9)]) == pytest.approx([1.5, 2.0])
    # the same at a clock past 2e7 s (a trace in Unix time), where a nanosecond is below its resolution
    epoch = 1.7e9
    assert ends("nic", [(epoch, 0, 9), (epoch + 0.5, 1, 9)]) == pytest.approx([epoch + 1.5, epoch + 2.0], abs=1e-6)
    # one prefill worker sending to two decode workers shares its own NIC
    assert ends("nic", [(0, 0, 8), (0, 0, 9)]) == pytest.approx([2.0, 2.0])
    with pytest.raises(ValueError, match="kv_link_sharing 'bus'"):
        KvLink(Environment(), 1.0, "bus")


def test_nic_sharing_slows_the_transfers_that_meet_and_no_lone_one() -> None:
    """Two prefill workers handing prompts to one decode worker over a slow link: shared, the transfers that overlap
    take longer and TTFT grows; a lone request is timed as without sharing, to the float."""
    cfg = ClusterConfig.of(prefill_workers=2, decode_workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0,
                           kv_gbps=1.0)
    reqs = [Request(f"r{i}", 0.0, 4096, 8, [10 * i + k for k in range(8)]) for i in range(8)]
    alone, shared = (simulate(reqs, cfg.replace(kv_link_sharing=s), RunConfig("round_robin")) for s in ("none", "nic"))
    assert shared.summary.requests == alone.summary.requests == 8 and shared.summary.unfinished == 0
    assert shared.summary.ttft_p50 > alone.summary.ttft_p50
    lone = [Request("a", 0.0, 4096, 8, list(range(8)))]
    assert simulate(lone, cfg.replace(kv_link_sharing="nic"), RunConfig("round_robin")).records[0].ttft == \
        simulate(lone, cfg, RunConfig("round_robin")).records[0].ttft


def test_kv_link_cost_counts_a_prefix_in_flight_there_as_held() -> None:
    """The decode side lacks the prompt's KV past its device overlap or past the prefix its in-flight requests
    hold, whichever is longer."""
    c = KvLinkCost(BYTES, 50.0)
    none = TierOverlap(0, 0, 0, 0)
    assert c.lacking_ms(4096, 64, none, shared_blocks=48) == pytest.approx(1024 * BYTES / 50e6)
    assert c.cost(4096, 64, TierOverlap(16, 16, 16, 16), WorkerLoad(), 48) == pytest.approx(1024 * BYTES / 50e6)


def test_a_prompt_lacking_exactly_the_threshold_on_its_decode_worker_is_not_prefilled_there() -> None:
    """Conditional disaggregation prefills locally what lacks under ``local_prefill_tokens`` tokens, not at it."""
    assert not prefills_locally(1000, 488, 512) and prefills_locally(1000, 489, 512)


def test_kv_link_cost_reads_a_full_worker_at_its_full_step_and_blind_headroom() -> None:
    """The decode step is read at most at a full worker's utilisation (the latency fit is not extrapolated past it),
    and while no output length is known the worker counts as full at ``blind_headroom`` of its capacity."""
    lat = LATENCY_PRESETS["dynamo-mocker"]
    c = KvLinkCost(BYTES, 50.0, lat, capacity_tokens=10_000, decode_weight=1.0, memory_wait_ms=10_000.0)
    over = WorkerLoad(running=50, context_tokens=30_000)
    assert c.step_ms(over, 4096) == pytest.approx(lat.decode_ms(1.0))
    none = TierOverlap(0, 0, 0, 0)
    base = c.lacking_ms(8000, 64, none) + c.step_ms(WorkerLoad(), 8000)
    # 8,000 of 10,000 tokens: past the blind headroom (0.7) by 0.1, within the informed one (0.9)
    assert c.cost(8000, 64, none, WorkerLoad()) == pytest.approx(base + 0.1 * 10_000.0)
    assert c.cost(8000, 64, none, WorkerLoad(), output_tokens=500.0) == pytest.approx(
        base + max(0.0, 0.85 - 0.9) * 10_000.0)


def test_conditional_disaggregation_reads_only_the_decode_workers_device_overlap() -> None:
    """Whether a prompt prefills on its decode worker depends on what that worker holds on device: KV it holds on
    host only is not counted as held there (nor booked as such)."""
    from kvtier.indexer.index.keys import block_keys
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.sim.policies import RouteInput
    from kvtier.wire import BlockStored, WorkerId
    from kvtier.wire.notices import StreamId
    from kvtier.wire.protocol import pack_tokens

    bs, toks = 16, list(range(1000, 1000 + 64 * 16))
    pol = DisaggPolicy("kv_all", prefill=1, decode=1, block_size=bs, loads=LoadTracker(bs),
                       decode_loads=LoadTracker(bs), caches=lambda: [], settings=RoutingSettings(),
                       local_prefill_tokens=512)
    assert pol.kv is not None
    pol.kv.index.apply(StreamId(WorkerId("w1")), BlockStored(block_hashes=list(range(1, 65)), parent_block_hash=None,
                                                            token_ids=toks, block_size=bs, medium="CPU_PINNED"))
    pair = pol.choose(RouteInput("r", pack_tokens(toks), len(toks), block_keys(toks, bs), 0.0))
    assert pair.decode == 1 and pair.decode_cached == 0 and not pair.local
