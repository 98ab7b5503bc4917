"""Simulator fidelity: every request accounted, tokens booked to the right tier, time charged as an
engine spends it. Each test here checks one requirement of issue 18."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier.engine.cache import WritePolicy
from kvtier.hardware.latency import (
    MockerLatency,
    TransferModel,
    decode_run_ms,
    fit_latency,
    latency_from_json,
    latency_to_json,
)
from kvtier.hardware.links import GPU_LINKS, STORAGE_LINKS
from kvtier.indexer.routing.load import WorkerLoad
from kvtier.indexer.routing.scoring import TtftCost
from kvtier.sim.cli import _cluster, build_parser
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.trace import Request, load_mooncake, write_mooncake
from kvtier.wire.overlap import TierOverlap


def chat(n: int, seed: int = 1) -> list[Request]:
    return generate(dataclasses.replace(PRESETS["chat"], requests=n, system_tokens=1024, user_tokens=600), seed)


def test_write_back_finishes_every_request_when_host_copies_cannot_be_allocated() -> None:
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=16_384, host_ratio=0.1,
                        write_policy=WritePolicy.WRITE_BACK)
    res = simulate(chat(300), cfg, RunConfig("round_robin"))
    assert res.summary.unfinished == 0, f"{res.summary.unfinished} of 300 requests never finished"
    assert res.summary.requests == 300


def test_unfinished_requests_are_counted_not_dropped() -> None:
    reqs = chat(200)
    cfg = ClusterConfig.of(workers=2, page_size=64, device_tokens=32_768, host_ratio=1.0)
    full = simulate(reqs, cfg, RunConfig("round_robin")).summary
    cut = simulate(reqs, cfg, RunConfig("round_robin", until_s=reqs[100].arrival)).summary
    assert full.unfinished == 0 and full.requests == 200
    assert cut.unfinished > 0
    assert cut.requests + cut.unfinished + cut.rejected == 200


def test_cli_fails_when_requests_never_finish_unless_allowed(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", "--trace", "builtin:chat:80", "--policy", "round_robin", "--workers", "1",
            "--device-tokens", "32768", "--until", "30", "--no-plots", "--out", str(tmp_path)]
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert "did not finish" in err
    assert cli([*args, "--allow-unfinished"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["runs"][0]["unfinished"] > 0


def test_a_sweep_whose_grid_stops_its_runs_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A grid's until_s stops its points as --until does: the reason named is that stop, not requests that "never
    completed"."""
    args = ["sweep", "--trace", "builtin:chat:80", "--workers", "1", "--device-tokens", "32768", "--grid",
            "until_s=30", "--jobs", "1", "--no-plots", "--out", str(tmp_path)]
    assert cli(args) == 1
    err = capsys.readouterr().err
    assert "did not finish under until_s=30.0 (the run stopped at until_s=30 s)" in err, err


def test_a_request_at_the_latest_arrival_taken_sees_the_latencies_one_at_zero_does() -> None:
    """The clock is seconds in a float: at the 1e15 ms a timestamp could reach, or 1e6 times a trace's span through
    --time-scale, a request's latencies came out quantised to 0.1 ms, or 0. At the latest arrival taken now they keep
    their microseconds, and a trace or a scale past it is refused (tests/test_bad_input.py)."""
    from kvtier.sim.trace import MAX_ARRIVAL_S

    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=32_768)
    reqs = [Request("early", 0.0, 1000, 10, list(range(2))), Request("late", MAX_ARRIVAL_S, 1000, 10,
                                                                      list(range(100, 102)))]
    res = simulate(reqs, cfg, RunConfig("round_robin"))
    assert res.summary.requests == 2
    (ttft0, ttft1), (tpot0, tpot1), (e2e0, e2e1) = res.ttft, res.tpot, res.e2e
    assert ttft0 > 0.001 and tpot0 > 0.001
    for early, late in ((ttft0, ttft1), (tpot0, tpot1), (e2e0, e2e1)):
        assert abs(early - late) < 1e-7, (early, late)


def test_pages_cached_by_a_concurrent_request_are_device_hits_not_storage() -> None:
    # b is admitted while a prefills (nothing cached yet) and starts once a's pages are on device.
    ids = list(range(20))
    reqs = [Request("a", 0.0, 10_000, 20, ids), Request("b", 0.001, 10_000, 20, ids)]
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=16_384, host_ratio=0.0, max_running=2)
    s = simulate(reqs, cfg, RunConfig("round_robin")).summary
    assert s.hit_storage == 0.0
    assert s.hit_device == pytest.approx(10_000 // 64 * 64 / 20_000)


def test_tokens_by_tier_add_up_to_the_prompt_for_every_request() -> None:
    cfg = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0, l3="disk",
                        l3_tokens=131_072)
    for policy in ("round_robin", "kv_all"):
        res = simulate(chat(250), cfg, RunConfig(policy))
        for r in res.records:
            parts = r.device_tokens + r.host_tokens + r.storage_tokens + r.recomputed_tokens
            assert parts == r.input_tokens, f"{policy} {r.request_id}: {parts} != {r.input_tokens}"


def test_decode_run_charges_each_step_at_its_own_utilisation() -> None:
    lat = MockerLatency()
    cap, prompt, steps = 4096, 200, 3000  # utilisation climbs from 5% to 78% while it decodes
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=cap, host_ratio=0.0)
    rec = simulate([Request("r0", 0.0, prompt, steps + 1, [0])], cfg, RunConfig("round_robin")).records[0]
    expected = sum(lat.decode_ms((prompt + 1 + k) / cap) for k in range(steps)) / 1000
    constant = steps * lat.decode_ms((prompt + 1) / cap) / 1000  # what main charged
    assert rec.finish - rec.first_token == pytest.approx(expected, rel=1e-9)
    assert expected > constant * 1.3


@pytest.mark.parametrize("u0,du,steps", [(0.1, 0.001, 300), (0.9, 0.01, 50), (1.2, 0.0, 7), (0.0, 0.0, 0)])
def test_decode_run_closed_form_equals_the_step_by_step_sum(u0: float, du: float, steps: int) -> None:
    lat = MockerLatency()
    assert decode_run_ms(lat, u0, du, steps) == pytest.approx(sum(lat.decode_ms(u0 + k * du) for k in range(steps)))


@pytest.mark.parametrize("tokens", [3000, 40_000, 64_000])
def test_ttft_cost_of_an_idle_worker_equals_the_simulated_ttft(tokens: int) -> None:
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=262_144, host_ratio=0.0, prefill_budget=8192)
    rec = simulate([Request("r0", 0.0, tokens, 5, list(range(-(-tokens // 512))))], cfg,
                   RunConfig("round_robin")).records[0]
    cost = TtftCost(TransferModel(131072), prefill_budget=8192, capacity_tokens=262_144)
    assert cost.cost(tokens, 64, TierOverlap(0, 0, 0, 0), WorkerLoad()) / 1000 == pytest.approx(rec.ttft, rel=1e-9)


def test_ttft_cost_adds_a_decode_step_to_each_mixed_iteration() -> None:
    lat = MockerLatency()
    # decode_weight 1: the request's own TTFT (min_ttft weighs the steps more; test_scoring)
    cost = TtftCost(TransferModel(131072), prefill_budget=8192, capacity_tokens=100 * 64, decode_weight=1.0)
    busy = WorkerLoad(running=3, active_blocks=50, pending_prefill_tokens=10_000, prefilling=1,
                      context_tokens=50 * 64)
    step = lat.decode_ms(50 * 64 / (100 * 64))
    chunks = [8192, 10_000 + 1000 - 8192]
    expected = sum(lat.prefill_ms(c) + step for c in chunks)
    assert cost.cost(1000, 64, TierOverlap(0, 0, 0, 0), busy) == pytest.approx(expected)


def test_index_accuracy_is_measured_at_admission() -> None:
    ids = list(range(8))
    reqs = [Request("a", 0.0, 4096, 50, ids), Request("b", 0.001, 4096, 50, ids)]
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0, max_running=1)
    b = simulate(reqs, cfg, RunConfig("kv_all")).records[1]
    assert b.predicted_blocks == 0  # routed before a's prompt was cached
    assert b.actual_blocks == 4096 // 64  # admitted after it was


def test_multi_turn_sessions_are_closed_loop() -> None:
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=300, rate=20.0, think_s=0.5), 3)
    assert all(r.session is not None for r in reqs)
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=1.0)
    res = simulate(reqs, cfg, RunConfig("round_robin"))
    by_id = {r.request_id: r for r in res.records}
    last: dict[str, Request] = {}
    checked = 0
    for req in reqs:
        prev = last.get(req.session or "")
        if prev is not None:
            rec, before = by_id[req.request_id], by_id[prev.request_id]
            assert rec.arrival == pytest.approx(before.finish + (req.think_s or 0.0))
            checked += 1
        last[req.session or ""] = req
    assert checked > 100
    opened = simulate(reqs, cfg, RunConfig("round_robin", closed_loop=False))
    early = sum(1 for r in opened.records if r.arrival < by_id[r.request_id].arrival - 1e-9)
    assert early > 0  # open loop releases turns before their predecessor answered


def test_sessions_round_trip_through_jsonl(tmp_path: Path) -> None:
    reqs = generate(dataclasses.replace(PRESETS["agentic"], requests=40), 0)
    path = tmp_path / "t.jsonl"
    write_mooncake(reqs, path)
    back = load_mooncake(path)
    assert [(r.session, r.think_s) for r in back] == [(r.session, r.think_s) for r in reqs]


def test_l3_without_a_host_tier_is_an_error() -> None:
    with pytest.raises(ValueError, match="host"):
        ClusterConfig.of(l3="disk", host_ratio=0.0)


def test_fit_latency_recovers_the_coefficients_it_was_measured_with() -> None:
    truth = MockerLatency(3e-7, 0.02, 5.0, -20.0, 50.0, 6.0)
    prefill = [(float(t), truth.prefill_ms(t)) for t in (256, 1024, 4096, 8192, 16384)]
    decode = [(u, truth.decode_ms(u)) for u in (0.05, 0.3, 0.6, 0.95)]
    fit = fit_latency(prefill, decode)
    for got, want in zip(dataclasses.astuple(fit), dataclasses.astuple(truth), strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert latency_from_json(latency_to_json(fit)) == fit
    with pytest.raises(ValueError, match="at least 3"):
        fit_latency(prefill[:2], [])


def test_cli_fit_latency_then_replay_with_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slow = MockerLatency(8e-7, 0.03, 20.0)  # an engine twice as slow to prefill as the mocker fit
    rows = ["kind,x,ms"] + [f"prefill,{t},{slow.prefill_ms(t)}" for t in (512, 2048, 8192, 16384)]
    points = tmp_path / "points.csv"
    points.write_text("\n".join(rows) + "\n")
    fit = tmp_path / "lat.json"
    assert cli(["fit-latency", str(points), "-o", str(fit)]) == 0
    assert latency_from_json(fit.read_text()).prefill_ms(8192) == pytest.approx(slow.prefill_ms(8192))
    base = ["replay", "--trace", "builtin:sysprompt:40", "--policy", "round_robin", "--no-plots"]
    assert cli([*base, "--out", str(tmp_path / "a")]) == 0
    assert cli([*base, "--latency", str(fit), "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert b["runs"][0]["ttft_p50"] > 1.5 * a["runs"][0]["ttft_p50"]
    assert b["meta"]["cluster"]["latency"]["prefill_a"] == pytest.approx(8e-7)
    points.write_text("kind,x,ms\nprefill,512,fast\n")
    assert cli(["fit-latency", str(points), "-o", str(fit)]) == 2
    assert "points.csv:2" in capsys.readouterr().err


def test_hardware_presets_name_their_source_and_set_the_links() -> None:
    for preset in [*GPU_LINKS.values(), *STORAGE_LINKS.values()]:
        assert preset.gbps > 0 and preset.source, preset.name
    cfg = ClusterConfig()
    assert (cfg.h2d_gbps, cfg.storage_gbps) == (GPU_LINKS["h100-pcie5"].gbps, STORAGE_LINKS["nvme-gen4"].gbps)
    parser = build_parser()
    args = parser.parse_args(["replay", "--gpu-link", "a100-pcie4", "--storage-link", "nvme-gen5"])
    assert (_cluster(args).h2d_gbps, _cluster(args).storage_gbps) == (25.0, 14.5)
    args = parser.parse_args(["replay", "--gpu-link", "a100-pcie4", "--h2d-gbps", "40"])
    assert _cluster(args).h2d_gbps == 40.0
