"""The measured latency model: bench/gpu_latency.py's points, the preset fitted to them, and pools of other sizes."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.hardware.latency import (
    LATENCY_PRESETS,
    MockerLatency,
    fit_latency,
    latency_from_json,
    latency_to_json,
    load_latency_points,
    resolve_latency,
)
from kvtier.indexer.service.config import ServiceConfig
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, routing_settings, simulate
from kvtier.util.fields import ConfigError

ROOT = Path(__file__).resolve().parent.parent
H200 = "h200-llama-3.1-8b"
H200_POINTS = ROOT / "bench" / "data" / "gpu_latency_h200_llama-3.1-8b.csv"
H200_POOL = 875_422  # the KV capacity gpu_latency.py printed on the H200


def test_the_toy_model_writes_points_that_fit_latency_takes(tmp_path: Path) -> None:
    """The measuring code itself, on the CPU: the same model code as on the GPU, two layers wide."""
    out = tmp_path / "points.csv"
    run = subprocess.run([sys.executable, "bench/gpu_latency.py", "--tiny", "--prefill", "16,32,64",
                          "--batches", "1,4", "--contexts", "8,32", "--reps", "1", "-o", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader(out.open()))
    assert [r["kind"] for r in rows] == ["prefill"] * 3 + ["decode"] * 4
    assert [int(r["tokens"]) for r in rows if r["kind"] == "decode"] == [9, 36, 33, 132]  # batch x (context + 1)
    assert all(0 < float(r["x"]) <= 1 for r in rows if r["kind"] == "decode")
    assert {r["attention"] for r in rows} <= {"sdpa", "matmul"}
    # fit-latency reads the file as written. Its prefill times are made a line first: on a CPU, three passes of
    # 16-64 tokens timed once each are noise (a first pass can take ten times the next), and a quadratic through
    # them may dip below zero between them, which fit-latency refuses.
    for r in rows:
        if r["kind"] == "prefill":
            r["ms"] = str(1.0 + 0.01 * float(r["x"]))
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fit = tmp_path / "fit.json"
    assert cli(["fit-latency", str(out), "--kv-pool-tokens", "4096", "-o", str(fit)]) == 0
    assert latency_from_json(fit.read_text()).kv_pool_tokens == 4096


def test_the_h200_preset_is_the_fit_of_the_points_shipped_beside_it() -> None:
    prefill, decode = load_latency_points(str(H200_POINTS))
    assert len(prefill) == 11 and len(decode) == 46
    fit = fit_latency(prefill, decode, H200_POOL)
    preset = LATENCY_PRESETS[H200]
    for f in ("prefill_a", "prefill_b", "prefill_c", "decode_a", "decode_b", "decode_c"):
        assert getattr(fit, f) == pytest.approx(getattr(preset, f), rel=1e-9), f
    assert fit.kv_pool_tokens == preset.kv_pool_tokens == H200_POOL


def test_a_smaller_pool_is_charged_for_the_kv_it_holds() -> None:
    """Decode time follows the KV in use: a pool of a third of the measured one, full, costs what a third of the
    measured pool cost. A fit that states no pool (the mocker's) is used as it is."""
    preset = LATENCY_PRESETS[H200]
    small = preset.for_pool(H200_POOL // 3)
    for u in (0.0, 0.1, 0.5, 1.0):
        assert small.decode_ms(u) == pytest.approx(preset.decode_ms(u * (H200_POOL // 3) / H200_POOL), rel=1e-12)
    assert small.prefill_ms(4096) == preset.prefill_ms(4096)
    assert preset.for_pool(H200_POOL) is preset
    mocker = LATENCY_PRESETS["dynamo-mocker"]
    assert mocker == MockerLatency() and mocker.for_pool(1234) is mocker


def test_the_engines_and_the_router_use_the_fit_of_the_workers_pool() -> None:
    cluster = ClusterConfig(workers=2, device_tokens=65_536, latency=LATENCY_PRESETS[H200])
    expected = LATENCY_PRESETS[H200].for_pool(65_536)
    assert cluster.worker_latency() == expected
    assert routing_settings(cluster, RunConfig(policy="min_ttft")).latency == expected
    svc = ServiceConfig(endpoints=[], latency_path=H200, capacity_tokens=65_536)
    assert svc.routing_settings().latency == expected


def test_replay_takes_a_preset_by_name_and_a_fit_file(tmp_path: Path) -> None:
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=30), 1)
    runs = {}
    for name in ("dynamo-mocker", H200):
        cluster = ClusterConfig(workers=2, device_tokens=65_536, latency=resolve_latency(name))
        runs[name] = simulate(trace, cluster, RunConfig(policy="kv_all")).summary
    assert runs[H200].ttft_p50 != runs["dynamo-mocker"].ttft_p50  # the iteration times changed
    path = tmp_path / "fit.json"
    path.write_text(latency_to_json(LATENCY_PRESETS[H200]))
    assert resolve_latency(str(path)) == LATENCY_PRESETS[H200]
    out = tmp_path / "out"
    assert cli(["replay", "--trace", "builtin:chat:8", "--workers", "2", "--latency", H200, "--no-plots",
                "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["runs"]


def test_a_fit_file_states_its_pool_or_none() -> None:
    text = latency_to_json(MockerLatency())
    assert "kv_pool_tokens" not in text and latency_from_json(text) == MockerLatency()
    bad = json.loads(latency_to_json(LATENCY_PRESETS[H200]))
    bad["kv_pool_tokens"] = -5
    with pytest.raises(ValueError, match="kv_pool_tokens must be a whole number >= 0"):
        latency_from_json(json.dumps(bad))


@pytest.mark.parametrize(("coeffs", "worst"), [((1e-5, -0.1, 240.0), 5000),  # convex, below zero at its vertex only
                                               ((-1e-6, 0.0, 20.0), 8192)])  # concave, below zero past 4,472
def test_a_prefill_fit_below_zero_within_a_pass_is_refused(coeffs: tuple[float, float, float], worst: int) -> None:
    """The simulator charges passes of 1 to --prefill-budget tokens, and the router prices them: a fit that gives
    one a negative time is refused where it is loaded, naming the worst one."""
    fit = dataclasses.replace(MockerLatency(), prefill_a=coeffs[0], prefill_b=coeffs[1], prefill_c=coeffs[2])
    with pytest.raises(ValueError, match=f"for {worst} tokens; a prefill of 1 to 8192 tokens"):
        fit.check_prefill(8192)
    fit.check_prefill(worst // 2 if worst == 8192 else 1000)  # fine below where it turns negative
    with pytest.raises(ConfigError, match="--latency: its prefill fit gives"):
        ClusterConfig.of(latency=fit, device_tokens=8192)
    MockerLatency().check_prefill(10**7)
    LATENCY_PRESETS["h200-llama-3.1-8b"].check_prefill(10**7)


def test_a_prefill_fit_is_checked_over_the_prompts_the_router_prices() -> None:
    """The router prices a prompt's prefill whole (the goodput policy's slowdown of the requests running there):
    a fit positive over a pass of the budget but not over a prompt the device holds is refused too."""
    fit = dataclasses.replace(MockerLatency(), prefill_a=-1e-7, prefill_b=0.0, prefill_c=20.0)  # zero at 14,142
    ClusterConfig.of(latency=fit, device_tokens=8192, prefill_budget=8192)
    with pytest.raises(ConfigError, match=r"gives -87\.4 ms for 32768 tokens.*prompts up to --device-tokens"):
        ClusterConfig.of(latency=fit, device_tokens=32768, prefill_budget=8192)
