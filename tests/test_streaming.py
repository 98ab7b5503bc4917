"""Million-request replays in bounded memory (issue 11, item 3): traces generated and written as a
stream, replayed from the file without holding it, records streamed out in arrival order; and every
figure the same as the in-memory run's."""

from __future__ import annotations

import csv
import dataclasses
import gc
import itertools
import json
import pickle
import tracemalloc
from pathlib import Path

import pytest

from kvtier.sim.cli import main as cli
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate, iter_generate
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.run import RunConfig, RunResult, simulate
from kvtier.sim.source import ListTrace, MooncakeFile
from kvtier.sim.trace import Request, TraceError, load_mooncake, write_mooncake

CLUSTER = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0)
CHAT = dataclasses.replace(PRESETS["chat"], requests=400, rate=4.0, system_tokens=1024, user_tokens=600)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    write_mooncake(generate(CHAT, 5), path)
    return path


def _figures(r: RunResult) -> str:
    return json.dumps(r.summary.as_dict())  # NaN never equals itself; its JSON text does


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _same(a: RunResult, b: RunResult) -> None:
    assert _figures(a) == _figures(b)
    assert a.records == b.records and a.decisions == b.decisions
    assert list(a.ttft) == list(b.ttft)


def test_generation_streams_in_arrival_order() -> None:
    """A trillion requests asked for, a thousand taken: only a stream gets there; and they are the first
    thousand of a materialised trace."""
    endless = dataclasses.replace(PRESETS["chat"], requests=10**12)
    head = list(itertools.islice(iter_generate(endless, 3), 1000))
    listed = generate(dataclasses.replace(endless, requests=5000), 3)[:1000]
    assert [r.to_json() for r in head] == [r.to_json() for r in listed]
    assert [r.request_id for r in head] == [f"r{i}" for i in range(1000)]


def test_generation_holds_only_open_sessions() -> None:
    spec = dataclasses.replace(PRESETS["chat"], requests=20_000)
    tracemalloc.start()
    for _ in iter_generate(spec, 0):
        pass
    streamed = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    held = generate(spec, 0)
    materialised = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(held) == 20_000
    assert streamed < materialised / 10, (streamed, materialised)


def test_mooncake_file_reads_what_load_mooncake_reads(chat_file: Path, tmp_path: Path) -> None:
    listed = load_mooncake(chat_file)
    assert list(MooncakeFile(chat_file)) == listed and len(MooncakeFile(chat_file)) == len(listed)
    assert list(MooncakeFile(chat_file, limit=7)) == listed[:7]
    scaled = MooncakeFile(chat_file, time_scale=0.5)
    assert [r.arrival for r in scaled] == [r.arrival * 0.5 for r in listed]
    # Ids named by the file, blank lines, and an id that collides with a generated one.
    lines = ['{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1], "request_id": "x"}', "",
             '{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [2]}']
    named = tmp_path / "named.jsonl"
    named.write_text("\n".join(lines) + "\n")
    assert [r.request_id for r in MooncakeFile(named)] == ["x", "r1"] == [r.request_id for r in load_mooncake(named)]
    clash = tmp_path / "clash.jsonl"
    clash.write_text(lines[2] + "\n" + lines[0].replace('"x"', '"r0"') + "\n")
    with pytest.raises(TraceError, match=r"clash.jsonl:2: request_id 'r0' already used on line 1"):
        len(MooncakeFile(clash))


@pytest.mark.parametrize("closed_loop", [True, False])
def test_replay_from_the_file_equals_the_replay_of_the_list(chat_file: Path, closed_loop: bool) -> None:
    for policy in ("kv_host", "round_robin"):
        run = RunConfig(policy, closed_loop=closed_loop)
        src = MooncakeFile(chat_file)
        _same(simulate(src, CLUSTER, run), simulate(load_mooncake(chat_file), CLUSTER, run))
        assert src._live == {}  # every request finished: the source remembers none


def test_a_stopped_replay_counts_the_same_unfinished(chat_file: Path) -> None:
    run = RunConfig("kv_all", until_s=40.0)
    a, b = simulate(MooncakeFile(chat_file), CLUSTER, run), simulate(load_mooncake(chat_file), CLUSTER, run)
    _same(a, b)
    assert a.summary.unfinished > 0


def test_a_sink_gets_every_record_once_final_in_arrival_order(chat_file: Path) -> None:
    run = RunConfig("kv_all", until_s=60.0)
    kept = simulate(load_mooncake(chat_file), CLUSTER, run)
    got: list[RequestRecord] = []
    as_sent: list[RequestRecord] = []

    def sink(r: RequestRecord) -> None:
        got.append(r)
        as_sent.append(dataclasses.replace(r))  # what the sink saw then: nothing may change it later

    streamed = simulate(MooncakeFile(chat_file), CLUSTER, run, sink=sink)
    assert got == kept.records == as_sent and streamed.records == [] and streamed.decisions == []
    assert _figures(streamed) == _figures(kept) and list(streamed.ttft) == list(kept.ttft)
    assert kept.summary.unfinished > 0  # the end of the run flushed records that never finished


def test_a_streamed_replay_holds_the_requests_in_flight_not_the_trace(tmp_path: Path) -> None:
    """Counted mid-run: the live Request and RequestRecord objects (those in flight, queued, or waiting for
    an older record to finish). Replaying the same trace from a list holds every Request (the check can
    fail)."""
    path = tmp_path / "long.jsonl"
    n = write_mooncake(iter_generate(dataclasses.replace(CHAT, requests=3000, rate=2.0), 1), path)
    counts: list[tuple[int, int]] = []

    def census(r: RequestRecord) -> None:
        if r.request_id == "r2000":
            gc.collect()
            objs = gc.get_objects()
            counts.append((sum(type(o) is Request for o in objs), sum(type(o) is RequestRecord for o in objs)))

    simulate(MooncakeFile(path), CLUSTER, RunConfig("kv_host"), sink=census)
    trace = load_mooncake(path)
    simulate(ListTrace(trace), CLUSTER, RunConfig("kv_host"), sink=census)
    (file_reqs, file_recs), (list_reqs, _) = counts
    assert n == 3000 and list_reqs >= 3000
    assert file_reqs < n / 5 and file_recs < n / 5, counts


def test_a_mooncake_file_pickles_with_its_index(chat_file: Path) -> None:
    src = MooncakeFile(chat_file, limit=50).index()
    next(src.arrivals(True))  # a request in flight is not part of what travels
    again = pickle.loads(pickle.dumps(src))
    assert again._indexed and len(again) == 50 and list(again) == list(src)


def test_cli_streams_a_million_request_shape_end_to_end(chat_file: Path, tmp_path: Path) -> None:
    """gen-trace writes as it generates; replay and compare (two processes) stream the file and the CSV;
    the CSV equals what the in-memory records give, in arrival order, with no part files left behind."""
    gen = tmp_path / "gen.jsonl"
    assert cli(["gen-trace", "--kind", "agentic", "--requests", "300", "--seed", "4", "-o", str(gen)]) == 0
    assert [json.loads(x) for x in gen.read_text().splitlines()] == [
        json.loads(r.to_json()) for r in generate(dataclasses.replace(PRESETS["agentic"], requests=300), 4)]
    out = tmp_path / "cmp"
    args = ["--trace", str(chat_file), "--workers", "3", "--page-size", "64", "--device-tokens", "32768",
            "--host-ratio", "1", "--no-plots", "--out", str(out)]
    assert cli(["compare", *args, "--policies", "round_robin,kv_host", "--jobs", "2"]) == 0
    rows = _csv(out / "requests.csv")
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    expected = {p: simulate(load_mooncake(chat_file), CLUSTER, RunConfig(p)).records
                for p in ("round_robin", "kv_host")}
    assert [(r["policy"], r["request_id"], r["ttft"]) for r in rows] == [
        (p, rec.request_id, f"{rec.ttft:.6f}") for p, recs in expected.items() for rec in recs]
    one = tmp_path / "one"
    assert cli(["replay", *args[:-1], str(one), "--policy", "kv_host"]) == 0
    assert _csv(one / "requests.csv") == [r for r in rows if r["policy"] == "kv_host"]
