"""The benchmark scripts as users run them: each completes its smallest run, and refuses a bad argument in one line
(exit 2) before any work, as ``bench/benchargs.py`` promises. Their figures are not judged here (benchmarks, not
tests, hold performance)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``bench/<script> args`` in a fresh interpreter, from the repository's root, as the README runs it; Dynamo's
    mocker left out (``--dynamo-python`` unset runs it only where this interpreter has it, which the tests' does
    not)."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("disagg", [[], ["--disagg", "2:2"]], ids=["aggregated", "disaggregated"])
def test_the_dynamo_crosscheck_runs_aggregated_and_disaggregated_clusters(shared_dir: Path,
                                                                          disagg: list[str]) -> None:
    """An aggregated cluster crashed asking for its decode pool (which only a disaggregated one has)."""
    trace = shared_dir / "traces" / "mooncake_conversation_trace.jsonl"
    run = bench("bench/crosscheck_dynamo.py", "--trace", str(trace), "--limit", "40", "--clusters", "loaded", *disagg)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    rows = [ln.split()[1] for ln in run.stdout.splitlines() if ln.startswith("kvtier ")]
    assert rows == ["round_robin", "dynamo", "min_ttft"]
    assert ("2 prefill" in run.stdout) == bool(disagg)


@pytest.mark.parametrize(("args", "named"), [
    (["bench/goodput_table.py", "--policies", "dynamoo,min_ttf"], "dynamoo, min_ttf unknown"),
    (["bench/l3_bench.py", "--dir", "/nonexistent/kvtier-dir"], "/nonexistent/kvtier-dir: no such directory"),
    (["bench/replay_bench.py", "--sglang-kv-events", "/nonexistent/kv_events.py"],
     "/nonexistent/kv_events.py: no such file"),
    (["bench/sim_bench.py", "--dynamo-python", "/nonexistent/python"], "/nonexistent/python: no such executable"),
    (["bench/crosscheck_dynamo.py", "--dynamo-python", "/nonexistent/python"],
     "/nonexistent/python: no such executable"),
    (["bench/scale_bench.py", "--policies", "round_robin,bogus"], "--policies: bogus;"),
    (["bench/engine_bench.py", "--ops", "100"], "100 is not allowed"),
], ids=["goodput_table", "l3_bench", "replay_bench", "sim_bench", "crosscheck_dynamo", "scale_bench", "engine_bench"])
def test_a_bad_argument_is_one_line_and_exit_2_before_any_work(tmp_path: Path, args: list[str], named: str) -> None:
    """Each of these went on to a traceback, or to work done before the mistake was found (scale_bench replayed
    its first policies), or to a run with the misspelt policies dropped and "every target met" (goodput_table)."""
    run = bench(*args, "--out", str(tmp_path / "out")) if "scale_bench" in args[0] else bench(*args)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [ln for ln in run.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and named in errors[0], run.stderr
    assert "Traceback" not in run.stderr and not run.stdout
    assert not (tmp_path / "out").exists()  # (scale_bench: nothing written, no trace generated)


def test_the_index_workloads_second_worker_is_another_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fourth conversation also lives on a second worker: with one or two workers the formula gave the first
    one again, and its stores were applied twice to one worker."""
    monkeypatch.syspath_prepend(str(BENCH))
    from index_workload import placement
    for workers in range(1, 7):
        for conv in range(48):
            held = placement(conv, workers)
            assert len(held) == len(set(held)) and all(0 <= w < workers for w in held)
            assert len(held) == (2 if conv % 4 == 0 and workers > 1 else 1)


def test_a_target_against_dynamo_says_when_dynamo_did_not_run(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """indexer_bench judged "2x Dynamo" targets MET without Dynamo: only the absolute half was judged."""
    monkeypatch.syspath_prepend(str(BENCH))
    from indexer_bench import line
    assert line("apply", 2e6, None, "blocks/s", "target >= 2x Dynamo and >= 1,500,000", ok=True)
    assert "MET target >= 2x Dynamo and >= 1,500,000; Dynamo not run: that part not judged" in capsys.readouterr().out
    line("apply", 2e6, 5e5, "blocks/s", "target >= 2x Dynamo and >= 1,500,000", ok=True)
    assert "not judged" not in capsys.readouterr().out
