"""One source of settings: the cluster holds the engine's cache config, and the command line comes from the fields."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtier.engine.cache import CacheConfig, PrefetchPolicy, WritePolicy
from kvtier.sim.cli import build_parser
from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import CACHE_SETTINGS, ClusterConfig
from kvtier.sim.experiment import grid_jobs, parse_grid
from kvtier.sim.run import RunConfig
from kvtier.sim.source import ListTrace
from kvtier.util.fields import ConfigError


def test_the_cluster_declares_no_cache_field_again() -> None:
    cluster = {f.name for f in dataclasses.fields(ClusterConfig)}
    cache = {f.name for f in dataclasses.fields(CacheConfig)}
    assert not cluster & cache, f"declared twice: {sorted(cluster & cache)}"
    assert set(CACHE_SETTINGS) <= cache


@pytest.mark.parametrize("command", ["replay", "compare", "sweep"])
def test_every_cache_option_defaults_to_the_field_default(command: str) -> None:
    args = build_parser().parse_args([command, "--trace", "builtin:chat:5",
                                      *(["--grid", "workers=1,2"] if command == "sweep" else [])])
    cache, cluster = CacheConfig(), ClusterConfig()
    for name in CACHE_SETTINGS:
        want = getattr(cache, name)
        assert getattr(args, name) == getattr(want, "value", want), name
    # (--workers is the pools' sum when they are given, so its option has no default of its own)
    generated = [f for f in dataclasses.fields(ClusterConfig)
                 if getattr(f.metadata.get("domain"), "help", None) and f.name != "workers"]
    assert {"device_tokens", "prefill_budget", "max_running"} <= {f.name for f in generated}
    for f in generated:
        assert getattr(args, f.name) == getattr(cluster, f.name), f.name


def test_every_cluster_setting_has_an_option_that_reaches_the_cluster() -> None:
    """What summary.json's meta.cluster reports and a sweep's grid varies can be set on the command line too:
    draft_model could not (no option, no help). ``cache`` is the cache settings' own options; ``kv_gbps`` is
    --kv-link-gbps."""
    from kvtier.sim.cli import _cluster

    args = build_parser().parse_args(["replay", "--draft-model", "tiny"])
    missing = [f.name for f in dataclasses.fields(ClusterConfig) if not hasattr(args, f.name)]
    assert missing == ["cache", "kv_gbps"]
    assert _cluster(args).draft_model == "tiny" and ClusterConfig().draft_model is None


def test_flat_settings_reach_the_cache_and_the_cluster() -> None:
    c = ClusterConfig.of(workers=3, page_size=16, host_ratio=4.0, write_policy="write_back",
                         prefetch_policy=PrefetchPolicy.TIMEOUT, selective_threshold=5)
    assert c.workers == 3 and c.cache.page_size == c.page_size == 16 and c.host_ratio == 4.0
    assert c.write_policy is WritePolicy.WRITE_BACK and c.prefetch_policy is PrefetchPolicy.TIMEOUT
    worker = c.cache_config()
    assert worker.page_size == 16 and worker.selective_threshold == 5
    assert worker.device_pages == c.device_tokens // 16
    d = c.replace(host_ratio=0.0, l3="none")
    assert d.host_ratio == 0.0 and d.page_size == 16 and c.host_ratio == 4.0
    flat = c.settings()
    assert flat["page_size"] == 16 and flat["write_policy"] == "write_back" and "cache" not in flat


def test_a_bad_flat_setting_names_its_option() -> None:
    with pytest.raises(ConfigError, match="--page-size: 0 is not allowed"):
        ClusterConfig.of(page_size=0)
    with pytest.raises(ConfigError, match="--host-ratio"):
        ClusterConfig().replace(host_ratio=-1.0)


def test_a_sweep_varies_a_cache_setting() -> None:
    grid = parse_grid(["host_ratio=0,4", "prefetch_policy=best_effort,wait_complete"])
    jobs = grid_jobs(ListTrace([]), ClusterConfig(), RunConfig("round_robin"), grid)
    got = [(j.cluster.host_ratio, j.cluster.prefetch_policy) for j in jobs]
    assert got == [(0.0, PrefetchPolicy.BEST_EFFORT), (0.0, PrefetchPolicy.WAIT_COMPLETE),
                   (4.0, PrefetchPolicy.BEST_EFFORT), (4.0, PrefetchPolicy.WAIT_COMPLETE)]


def test_a_sweep_varies_the_latency_fit(tmp_path: Path) -> None:
    """``latency`` values are read as ``--latency`` reads them (a preset's name or a fit's path), not passed on as
    strings: the runs use the fits, and their tags keep the names."""
    from kvtier.hardware.latency import LATENCY_PRESETS

    grid = parse_grid(["latency=dynamo-mocker,h200-llama-3.1-8b"])
    jobs = grid_jobs(ListTrace([]), ClusterConfig(), RunConfig("round_robin"), grid)
    assert [(j.tag["latency"], j.cluster.latency) for j in jobs] == [
        (name, LATENCY_PRESETS[name]) for name in ("dynamo-mocker", "h200-llama-3.1-8b")]
    assert cli(["sweep", "--trace", "builtin:chat:4", "--no-plots", "--out", str(tmp_path), "--grid",
                "latency=dynamo-mocker,h200-llama-3.1-8b"]) == 0
    runs = json.loads((tmp_path / "sweep.json").read_text())["runs"]
    assert [r["latency"] for r in runs] == ["dynamo-mocker", "h200-llama-3.1-8b"]
    assert runs[0]["ttft_p50"] != runs[1]["ttft_p50"]


def test_the_indexers_help_says_each_default_a_setting_stands_for() -> None:
    """Its options default to None (a --config's settings stand unless given): the help said ``(default: none)``
    for every routing setting and limit; each names ServiceConfig's default now."""
    from kvtier.indexer.service.config import ServiceConfig

    indexer = next(a for a in build_parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
                   if a.prog.endswith(" indexer"))
    defaults = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}
    checked = 0
    for action in indexer._actions:
        if defaults.get(action.dest) not in (None, dataclasses.MISSING):
            said = f"default: the config's, else {defaults[action.dest]}"
            assert said in (action.help or ""), (action.dest, action.help)
            checked += 1
    assert checked >= 20
    helps = {a.dest: a.help for a in indexer._actions}
    assert helps["gpu_link"].endswith("(default: the config's, else h100-pcie5)")
    assert helps["max_connections"].endswith("(default: the config's, else 1024)")


def test_compare_runs_the_goodput_policy_by_default_where_an_slo_is_given(tmp_path: Path) -> None:
    """The default policies compared under an SLO left out kvtier's own SLO-aware policy, the one an SLO is told to
    (without one it routes as min_ttft, so it is left out there)."""
    for slo, last in (([], "llmd_precise"), (["--sla-ttft-ms", "100"], "goodput")):
        out = tmp_path / last
        assert cli(["compare", "--trace", "builtin:chat:4", "--no-plots", "--out", str(out), *slo]) == 0
        runs = json.loads((out / "summary.json").read_text())["runs"]
        assert [r["policy"] for r in runs][-1] == last and len(runs) == 14 + bool(slo)
