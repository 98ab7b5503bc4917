"""What a user feels beyond the first token: time to second token, TPOT, inter-token gaps, end-to-end latency and
goodput under an SLO, per request and per run, and the CLI's report of them."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.hardware.latency import MockerLatency, TransferModel, decode_step_max_ms
from kvtier.indexer.routing.load import WorkerLoad
from kvtier.indexer.routing.scoring import SLO_MISS_MS, SloCost, TtftCost
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.metrics import RequestRecord, Slo, _pct, summarize
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.trace import Request
from kvtier.wire.overlap import TierOverlap

SMALL = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0, l3="disk", l3_tokens=131_072)


def chat(n: int) -> list[Request]:
    return generate(dataclasses.replace(PRESETS["chat"], requests=n, system_tokens=1024, user_tokens=600), 1)


@pytest.mark.parametrize("policy", ["round_robin", "kv_all", "min_ttft"])
def test_every_gap_adds_up_to_the_records_latencies(policy: str) -> None:
    """The gaps a run reports for a request are its tokens' times: as many as its tokens after the first, summing
    to its decode time, the first one ending at its second token, the longest its max ITL, their mean its TPOT."""
    gaps: dict[str, list[float]] = {}
    res = simulate(chat(150), SMALL, RunConfig(policy), itl_sink=lambda rid, g: gaps.__setitem__(rid, list(g)))
    assert len(gaps) == res.summary.requests == 150
    for rec in res.records:
        g, n = gaps[rec.request_id], max(rec.output_tokens, 1)
        assert len(g) == n - 1, rec.request_id
        if n == 1:
            assert math.isnan(rec.tpot) and math.isnan(rec.ttst) and rec.max_itl == -1.0
            continue
        assert sum(g) == pytest.approx(rec.finish - rec.first_token, abs=1e-6)
        assert rec.first_token + g[0] == pytest.approx(rec.second_token, abs=1e-9)
        assert max(g) == pytest.approx(rec.max_itl, abs=1e-9)
        assert rec.tpot == pytest.approx(sum(g) / len(g), rel=1e-9)
        assert min(g) > 0


def test_the_same_run_without_the_series_gives_the_same_records() -> None:
    """Keeping the gaps changes nothing else: the records and decisions are those of a run that keeps none."""
    reqs = chat(120)
    plain = simulate(reqs, SMALL, RunConfig("kv_all"))
    kept = simulate(reqs, SMALL, RunConfig("kv_all"), itl_sink=lambda rid, g: None)
    assert plain.records == kept.records and plain.decisions == kept.decisions


def test_one_request_decodes_at_the_latency_models_steps() -> None:
    """Alone on a worker, a request's gaps are the model's decode steps at the utilisation each token brings, and
    its max ITL the last (the published fit's step grows with utilisation)."""
    req = Request("r0", 0.0, 640, 40, hash_ids=list(range(10)))
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
    gaps: list[list[float]] = []
    res = simulate([req], cfg, RunConfig("round_robin"), itl_sink=lambda rid, g: gaps.append(list(g)))
    lat, cap = MockerLatency(), cfg.capacity_tokens()
    # After the first token the batch holds 640 + 1 tokens; each step adds one.
    want = [lat.decode_ms((640 + k) / cap) / 1000 for k in range(1, 40)]
    assert gaps[0] == pytest.approx(want, rel=1e-9)
    rec = res.records[0]
    assert rec.max_itl == pytest.approx(want[-1], rel=1e-9)
    assert rec.tpot == pytest.approx(sum(want) / 39, rel=1e-9)


def test_a_newcomers_prefill_shows_in_the_running_streams_max_itl() -> None:
    """A long prompt arriving while a stream decodes is prefilled in the same iterations (chunked prefill): that
    stream's gap then lasts a prefill chunk, which its max ITL must show (TPOT alone would average it away)."""
    first = Request("a", 0.0, 256, 200, hash_ids=list(range(4)))
    second = Request("b", 0.5, 8192, 10, hash_ids=list(range(100, 228)))
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0, prefill_budget=4096)
    res = simulate([first, second], cfg, RunConfig("round_robin"))
    a = res.records[0]
    chunk_ms = MockerLatency().prefill_ms(4096)
    assert a.max_itl * 1000 >= chunk_ms
    assert a.tpot * 1000 < chunk_ms / 4  # a few slow gaps among 199


def test_goodput_counts_requests_meeting_every_bound_over_the_whole_trace() -> None:
    """Goodput is the share of all requests of the trace (rejected and unfinished ones miss) that completed within
    every bound given; a one-token answer has no TPOT to miss."""
    def rec(rid: str, ttft: float, e2e: float, out: int) -> RequestRecord:
        r = RequestRecord(rid, 0, 0.0, 100, out, prefill_start=0.0, first_token=ttft, finish=e2e)
        return r
    records = [rec("fast", 0.1, 1.0, 11),  # TPOT 90 ms
               rec("slow-first", 0.6, 1.1, 11),  # TTFT 600 ms
               rec("slow-stream", 0.1, 3.1, 11),  # TPOT 300 ms
               rec("one-token", 0.2, 0.2, 1),
               RequestRecord("rejected", 0, 0.0, 100, 10, rejected=True)]
    s = summarize("p", records, workers=1, total=6, slo=Slo(ttft_s=0.5, tpot_s=0.1))  # one more never finished
    assert s.goodput == pytest.approx(2 / 6) and s.unfinished == 1 and s.slo == "TTFT <= 500 ms, TPOT <= 100 ms"
    assert s.goodput_rps == pytest.approx(2 / 3.1)
    assert summarize("p", records, workers=1, slo=Slo(e2e_s=1.05)).goodput == pytest.approx(2 / 5)
    assert math.isnan(summarize("p", records, workers=1).goodput)
    assert s.tpot_p50 == pytest.approx(0.09) and s.tpot_p99 == pytest.approx(0.3, rel=0.02)


def test_the_goodput_plot_bases_its_slo_on_a_run_that_completed_requests() -> None:
    """No SLO given: the plot's is the p90s of the first run that completed a request (a first policy that
    completed none gave an SLO without a bound, which counted one request, numpy's scalar True, for every policy
    at every scale); an SLO without a bound is met by every completed request."""
    from types import SimpleNamespace

    from kvtier.sim.metrics import goodput_count
    from kvtier.sim.report import base_slo, goodput_curve

    none = SimpleNamespace(ttft=[], tpot=[], e2e=[])
    some = SimpleNamespace(ttft=[0.1] * 40, tpot=[0.01] * 40, e2e=[1.0] * 40)
    base = base_slo(Slo(), [none, some])  # type: ignore[list-item]
    assert base == Slo(0.1, 0.01, 1.0)
    assert goodput_curve(base, some, 50)[-1] == pytest.approx(0.8)  # type: ignore[arg-type]
    assert goodput_curve(base, none, 50) == [0.0] * len(goodput_curve(base, none, 50))  # type: ignore[arg-type]
    assert goodput_count(Slo(), [0.1] * 40, [0.01] * 40, [1.0] * 40) == 40
    assert goodput_count(Slo(), [], [], []) == 0


def test_a_run_reports_goodput_under_its_slo() -> None:
    reqs = chat(150)
    loose = simulate(reqs, SMALL, RunConfig("kv_all", sla_ttft_ms=1e6, sla_tpot_ms=1e6, sla_e2e_ms=1e9)).summary
    tight = simulate(reqs, SMALL, RunConfig("kv_all", sla_tpot_ms=1e-3)).summary
    assert loose.goodput == 1.0 and tight.goodput == pytest.approx(
        sum(1 for r in reqs if r.output_length <= 1) / len(reqs))
    assert 0 < loose.tpot_p50 <= loose.tpot_p90 <= loose.tpot_p95 <= loose.tpot_p99 <= loose.itl_max_p99
    assert loose.ttft_p50 <= loose.ttst_p50 and loose.e2e_p90 <= loose.e2e_p99


@given(a=st.floats(-80, 80), b=st.floats(-80, 80), c=st.floats(0, 40), u0=st.floats(-0.2, 1.2),
       du=st.floats(0, 0.05), steps=st.integers(0, 300))
def test_the_longest_step_of_a_run_is_found_in_constant_time(a: float, b: float, c: float, u0: float, du: float,
                                                             steps: int) -> None:
    lat = MockerLatency(decode_a=a, decode_b=b, decode_c=c)
    want = max((lat.decode_ms(u0 + k * du) for k in range(steps)), default=0.0)
    assert decode_step_max_ms(lat, u0, du, steps) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_cli_reports_goodput_the_itl_series_and_their_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    series = tmp_path / "itl.jsonl"
    rc = cli(["compare", "--trace", "builtin:chat:80", "--policies", "round_robin,kv_all", "--workers", "2",
              "--device-tokens", "32768", "--jobs", "1", "--out", str(tmp_path), "--sla-ttft-ms", "300",
              "--sla-tpot-ms", "40", "--itl-series", str(series)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "TPOT p90 ms" in out and "e2e p99 s" in out and "goodput" in out
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert all(0 <= r["goodput"] <= 1 and r["slo"] == "TTFT <= 300 ms, TPOT <= 40 ms" for r in runs)
    lines = [json.loads(x) for x in series.read_text().splitlines()]
    assert [x["policy"] for x in lines].count("kv_all") == 80 and len(lines) == 160
    header = (tmp_path / "requests.csv").read_text().splitlines()[0].split(",")
    i = header.index("ttst")
    assert header[i:i + 3] == ["ttst", "tpot", "max_itl"]
    for png in ("ttft_tpot_pareto.png", "goodput_vs_slo.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_a_prompt_cached_whole_still_gets_its_first_token_from_a_prefill() -> None:
    """The second of two identical page-aligned prompts finds every page cached: it still runs its last token for
    the logits of its first output token, as SGLang and vLLM do. Its first token is recorded after that one-token
    prefill, so its TTFT is positive and no TTFT of -1 s goes into the percentiles."""
    ids = list(range(8))
    reqs = [Request("a", 0.0, 4096, 50, ids), Request("b", 0.001, 4096, 50, ids)]
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0, max_running=1)
    res = simulate(reqs, cfg, RunConfig("kv_all"))
    a, b = res.records
    assert b.device_tokens == 4096 and b.recomputed_tokens == 0
    assert a.finish <= b.first_token < b.second_token < b.finish
    assert 0 < b.ttft - (a.finish - b.arrival) < a.ttft  # one token's prefill after a left the batch
    assert res.summary.ttft_p50 > 0


def _goodput_parts() -> tuple[TtftCost, WorkerLoad, WorkerLoad, TierOverlap, TierOverlap]:
    """min_ttft's cost on a 1M-token worker; a worker decoding a big batch, one decoding two streams; a 16,384-token
    prompt's overlap where all but its last 384 tokens are cached, and a cold one."""
    base = TtftCost(TransferModel(131_072), capacity_tokens=1_000_000)
    busy = WorkerLoad(running=30, active_blocks=5000, context_tokens=300_000)
    light = WorkerLoad(running=2, active_blocks=300, context_tokens=20_000)
    return base, busy, light, TierOverlap(250, 250, 250, 250), TierOverlap(0, 0, 0, 0)


def test_the_goodput_policy_keeps_cache_affinity_only_while_it_is_worth_what_users_feel() -> None:
    """Without bounds the policy is min_ttft. Told an SLO, it prices TTFT against TPOT and the streams it slows: the
    prefix's worker decoding a big batch loses to an idle one (min_ttft keeps the prefix: 7 decode steps cost less
    than the prefill it saves), the same worker decoding two streams keeps it; a TPOT bound the batch would pass
    moves the request whatever the price."""
    base, busy, light, cached, cold = _goodput_parts()
    idle = WorkerLoad()

    def pick(cm: SloCost | TtftCost, load: WorkerLoad) -> str:
        return "cached" if cm.cost(16384, 64, cached, load, 0, 200.0) < cm.cost(16384, 64, cold, idle, 0, 200.0) \
            else "idle"

    assert SloCost(base).cost(16384, 64, cached, busy, 0, 200.0) == base.cost(16384, 64, cached, busy, 0, 200.0)
    assert pick(SloCost(base), busy) == pick(base, busy) == "cached"
    loose = SloCost(base, ttft_ms=1e6, tpot_ms=1e6)
    assert pick(loose, busy) == "idle" and pick(loose, light) == "cached"
    _, tpot_light = loose.estimates(16384, 64, cached, light, 0, 200.0)
    assert pick(SloCost(base, tpot_ms=tpot_light * 0.99), light) == "idle"
    ttft, tpot = loose.estimates(16384, 64, cached, busy, 0, 200.0)
    step = base.latency.decode_ms((300_000 + 16384 + 100) / 1_000_000)
    assert tpot == pytest.approx(step) and ttft > 0  # no uncached tokens routed there: no prefill pass counted


def test_the_tpot_estimate_counts_the_prefill_passes_the_decode_steps_share() -> None:
    """A worker runs prompts' chunks inside its streams' iterations: about as many passes as its in-flight requests
    brought come in while a request decodes (arrivals replace them), spread over the output it is expected to write;
    while no output length is known none is counted."""
    base, _, light, _, cold = _goodput_parts()
    cm = SloCost(base)
    prefilled = dataclasses.replace(light, routed_prefill_tokens=6000)
    (t0, plain), (t1, shared) = cm.estimates(1000, 64, cold, light, 0, 100.0), cm.estimates(1000, 64, cold,
                                                                                             prefilled, 0, 100.0)
    assert t0 == t1 and shared - plain == pytest.approx(2 * base.latency.prefill_ms(3000) / 100.0)
    assert cm.estimates(1000, 64, cold, prefilled, 0, 0.0) == cm.estimates(1000, 64, cold, light, 0, 0.0)


def test_a_prompt_cached_whole_is_expected_to_wait_for_its_one_token_pass() -> None:
    """The engine still runs a wholly cached prompt's last token through the model (for its first output token's
    logits): the TTFT estimate is that pass, not 0."""
    base, _, _, _, _ = _goodput_parts()
    ttft, _ = SloCost(base).estimates(64 * 250, 64, TierOverlap(250, 250, 250, 250), WorkerLoad())
    assert ttft == pytest.approx(base.latency.prefill_ms(1)) and ttft > 0


def test_workers_that_all_miss_the_slo_are_ordered_by_price_not_by_how_far_they_miss() -> None:
    """A bound no worker can meet (a TPOT under the decode floor) must not turn the policy into a TPOT balancer that
    throws the cache away: the worker keeping the prefix, the cheaper by price, wins, although its TPOT is the
    further from the bound; every cost is past SLO_MISS_MS, and the router's tie tolerance cannot merge them."""
    base, _, light, cached, cold = _goodput_parts()
    cm = SloCost(base, tpot_ms=1.0, out_of_reach="price")
    keep, move = cm.cost(16384, 64, cached, light, 0, 200.0), cm.cost(16384, 64, cold, WorkerLoad(), 0, 200.0)
    assert SLO_MISS_MS <= keep < move and move - keep > 1e-9 * move
    assert cm.estimates(16384, 64, cached, light, 0, 200.0)[1] > cm.estimates(16384, 64, cold, WorkerLoad(), 0,
                                                                              200.0)[1]


def test_spread_sends_a_request_no_worker_can_serve_in_time_where_it_slows_the_others_least() -> None:
    """``out_of_reach="spread"``: with the same unmeetable bound the request leaves the prefix's worker, whose
    streams it would slow, for the idle one; workers that meet the bound are still ordered by price."""
    base, _, light, cached, cold = _goodput_parts()
    cm = SloCost(base, tpot_ms=1.0, out_of_reach="spread")
    keep, move = cm.cost(16384, 64, cached, light, 0, 200.0), cm.cost(16384, 64, cold, WorkerLoad(), 0, 200.0)
    assert SLO_MISS_MS <= move < keep
    reachable = SloCost(base, tpot_ms=1e6, out_of_reach="spread")
    assert reachable.cost(16384, 64, cached, light, 0, 200.0) == SloCost(base, tpot_ms=1e6).cost(
        16384, 64, cached, light, 0, 200.0)


def test_discount_weighs_the_ttft_of_a_request_that_misses_its_slo_less_but_still_counts_it() -> None:
    """``out_of_reach="discount"`` sits between the two: with the same unmeetable bound, the prefix's worker decoding
    four streams keeps the request under ``price`` and loses it to the idle worker under ``discount`` (the TTFT it
    saves is spread over 100 tokens, not 12); decoding two streams it keeps it under ``discount`` too, where
    ``spread``, which drops TTFT, moves it. A bound some worker meets is ordered by the usual price."""
    base, _, light, cached, cold = _goodput_parts()
    four = WorkerLoad(running=4, active_blocks=600, context_tokens=40_000)

    def keeps(mode: str, load: WorkerLoad) -> bool:
        cm = SloCost(base, tpot_ms=1.0, out_of_reach=mode)
        keep, move = cm.cost(16384, 64, cached, load, 0, 200.0), cm.cost(16384, 64, cold, WorkerLoad(), 0, 200.0)
        assert keep >= SLO_MISS_MS and move >= SLO_MISS_MS
        return keep < move

    assert [keeps(m, four) for m in ("price", "discount", "spread")] == [True, False, False]
    assert [keeps(m, light) for m in ("price", "discount", "spread")] == [True, True, False]
    reachable = SloCost(base, tpot_ms=1e6, out_of_reach="discount")
    assert reachable.cost(16384, 64, cached, four, 0, 200.0) == SloCost(base, tpot_ms=1e6).cost(
        16384, 64, cached, four, 0, 200.0)


def test_auto_discounts_where_the_tpot_bound_is_near_an_idle_workers_decode_step() -> None:
    """``out_of_reach="auto"``, the default everywhere: ``discount`` under a TPOT bound within 1.5 times an idle
    worker's decode step (where a pile makes every worker miss it), ``price`` above it and under a TTFT bound alone;
    the cost is then exactly that rule's."""
    base, _, _, cached, _ = _goodput_parts()
    four = WorkerLoad(running=4, active_blocks=600, context_tokens=40_000)
    idle_step = base.latency.decode_ms(0.0)
    cases = {1.4 * idle_step: "discount", 1.6 * idle_step: "price", None: "price"}
    for tpot_ms, rule in cases.items():
        auto = SloCost(base, ttft_ms=1.0, tpot_ms=tpot_ms, out_of_reach="auto")
        assert auto.rule == rule
        assert auto.cost(16384, 64, cached, four, 0, 200.0) == SloCost(
            base, ttft_ms=1.0, tpot_ms=tpot_ms, out_of_reach=rule).cost(16384, 64, cached, four, 0, 200.0)
    assert SloCost(base).out_of_reach == RunConfig("goodput").slo_out_of_reach == "auto"
    assert dataclasses.replace(SloCost(base, tpot_ms=1e6), tpot_ms=1.0).rule == "discount"  # told an SLO later


@pytest.mark.parametrize("mode", ["price", "discount", "spread"])
def test_the_out_of_reach_order_is_a_setting_of_the_run_the_cli_and_the_service(tmp_path: Path, mode: str) -> None:
    from kvtier.indexer.routing.policies import RoutingSettings, make_cost
    from kvtier.indexer.service.config import ServiceConfig
    from kvtier.sim.run import routing_settings
    from kvtier.util.fields import ConfigError

    run = RunConfig("goodput", sla_tpot_ms=10.0, slo_out_of_reach=mode)
    cm = make_cost("goodput", routing_settings(ClusterConfig(), run))
    assert isinstance(cm, SloCost) and cm.out_of_reach == mode
    assert make_cost("goodput", ServiceConfig(endpoints=[], slo_out_of_reach=mode).routing_settings()) \
        .out_of_reach == mode  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="--slo-out-of-reach: 'nearest' is not allowed"):
        RunConfig("goodput", slo_out_of_reach="nearest")
    with pytest.raises(ConfigError, match="slo_out_of_reach must be one of auto, price, discount, spread"):
        make_cost("goodput", RoutingSettings(slo_out_of_reach="nearest"))
    base, _, _, _, _ = _goodput_parts()
    with pytest.raises(ConfigError, match="out_of_reach must be one of auto, price, discount, spread, got 'nearest'"):
        SloCost(base, tpot_ms=10.0, out_of_reach="nearest")  # built directly: not ordered like price unasked
    assert cli(["replay", "--trace", "builtin:chat:6", "--workers", "2", "--policy", "goodput", "--sla-tpot-ms",
                "1", "--slo-out-of-reach", mode, "--no-plots", "--out", str(tmp_path)]) == 0


@given(st.lists(st.floats(1e-6, 1e3), min_size=1, max_size=6), st.integers(2, 40),
       st.lists(st.floats(1e-6, 1e3), max_size=6))
def test_percentiles_stay_within_the_values_and_in_order(low: list[float], ties: int, high: list[float]) -> None:
    """Percentiles of latencies with ties (a run's TTFTs often share a value) never fall outside the values, nor
    does a higher percentile fall below a lower one: the interpolation can land an ulp past two equal values."""
    xs = low + [low[-1]] * ties + high
    got = [_pct(xs, p) for p in (0.1, 1.0, 50.0, 90.0, 99.0, 99.9)]
    assert min(xs) <= got[0] and got[-1] <= max(xs) and got == sorted(got)
    assert _pct([0.0005046868558173902] * 10, 99.0) == 0.0005046868558173902  # (one below, before)
    if len(xs) > 1:  # (otherwise as statistics.quantiles interpolates)
        cuts = statistics.quantiles(xs, n=1000, method="inclusive")
        want = [cuts[round(p * 10) - 1] for p in (0.1, 1.0, 50.0, 90.0, 99.0, 99.9)]
        assert got == pytest.approx(want, rel=1e-12)


def test_a_router_estimate_equal_to_a_bound_meets_it() -> None:
    """The SLO's bounds are inclusive (``TTFT <= bound``, ``TPOT <= bound``), for the router's estimates as for the
    simulator's goodput (:meth:`Slo.met`): an estimate exactly at a bound meets it, just past it misses."""
    from kvtier.indexer.routing.scoring import slo_met

    assert slo_met(500.0, 50.0, 500.0, 50.0) is True
    assert slo_met(500.0, 50.0, 500.0, None) is True
    assert slo_met(500.0, 50.0, None, 50.0) is True
    assert slo_met(500.1, 50.0, 500.0, 50.0) is False
    assert slo_met(500.0, 50.1, 500.0, 50.0) is False
    assert slo_met(500.0, float("nan"), 500.0, 50.0) is None


def test_a_request_exactly_at_a_bound_meets_it() -> None:
    """The SLO's bounds are inclusive, as its description says ("TTFT <= 500 ms"): a request whose TTFT, TPOT or
    end-to-end latency equals a bound counts toward goodput."""
    r = RequestRecord("at-bound", 0, 0.0, 100, 3, prefill_start=0.0, first_token=0.5, finish=1.0)  # TPOT 0.25
    assert (r.ttft, r.tpot, r.e2e) == (0.5, 0.25, 1.0)
    for slo in (Slo(ttft_s=0.5), Slo(tpot_s=0.25), Slo(e2e_s=1.0), Slo(0.5, 0.25, 1.0)):
        assert summarize("p", [r], workers=1, slo=slo).goodput == 1.0, slo.describe()
    assert summarize("p", [r], workers=1, slo=Slo(ttft_s=0.49)).goodput == 0.0


def test_max_itl_percentiles_leave_out_requests_of_one_token() -> None:
    """A request that generated one token has no inter-token gap (``max_itl`` -1): the max-ITL percentiles are over
    the requests that generated two or more, as the TTST and TPOT ones are, never a -1 gap."""
    one = [RequestRecord(f"one{i}", 0, 0.0, 100, 1, prefill_start=0.0, first_token=0.2, finish=0.2) for i in range(3)]
    two = RequestRecord("two", 0, 0.0, 100, 2, prefill_start=0.0, first_token=0.2, finish=0.3, second_token=0.3,
                        max_itl=0.1)
    s = summarize("p", [*one, two], workers=1)
    assert s.itl_max_p50 == pytest.approx(0.1) and s.itl_max_p99 == pytest.approx(0.1)
    assert s.tpot_p50 == pytest.approx(0.1)


def test_a_request_that_fills_a_workers_device_exactly_is_served() -> None:
    """A request is rejected only if its prompt and output could never fit a worker's device: one that fills it
    exactly runs; one token more is rejected."""
    cfg = ClusterConfig.of(workers=1, device_tokens=1024)
    exact = simulate([Request("exact", 0.0, 1000, 24, [1, 2])], cfg, RunConfig("round_robin")).summary
    assert (exact.requests, exact.rejected) == (1, 0)
    over = simulate([Request("over", 0.0, 1000, 25, [1, 2])], cfg, RunConfig("round_robin")).summary
    assert (over.requests, over.rejected) == (0, 1)


def test_a_prompt_cached_whole_still_runs_its_last_token_pass() -> None:
    """A prompt found whole on device computes nothing, but its last token still runs through the model for the
    logits of its first output token: its TTFT is that one-token pass, not a decode step."""
    lat = MockerLatency()
    cfg = ClusterConfig.of(workers=1, page_size=64, device_tokens=65_536, host_ratio=0.0)
    reqs = [Request("first", 0.0, 3072, 1, [1, 2, 3, 4, 5, 6]), Request("again", 100.0, 3072, 1, [1, 2, 3, 4, 5, 6])]
    again = simulate(reqs, cfg, RunConfig("round_robin")).records[1]
    assert (again.device_tokens, again.recomputed_tokens) == (3072, 0)
    assert again.ttft == pytest.approx(lat.prefill_ms(1) / 1000)
