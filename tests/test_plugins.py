"""Routing-policy plugins: loaded by spec, entry point or file, and the same object routes in the
simulator and in the service."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import cast

import pytest

from kvtier.indexer.routing.plugins import PolicyBase, RouteContext, RoutingPolicy, is_plugin_spec, load_policy
from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.sim.cli import main as cli_main
from kvtier.sim.run import RunConfig, simulate
from kvtier.wire import EventBatch, Publisher
from kvtier.wire.notices import StreamId
from tests.test_service import BS, TOKS, post, stored, wait_for
from tests.test_sim import SMALL, chat

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "fresh_first_policy.py") + ":FreshFirst"


class LeastDevice(PolicyBase):
    """Perversely sends every request where it has the fewest device hits (a policy a test can see)."""

    name = "least_device"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return float(ctx.overlap(worker).device)


class Nobody(PolicyBase):
    name = "nobody"

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        return []

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return 0.0


def test_specs_files_modules_and_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_policy(EXAMPLE).name == "fresh_first"
    assert isinstance(load_policy("tests.test_plugins:LeastDevice"), RoutingPolicy)
    inst = LeastDevice()
    monkeypatch.setattr(sys.modules[__name__], "INSTANCE", inst, raising=False)
    assert load_policy("tests.test_plugins:INSTANCE") is inst  # an instance is used as it is
    for bad, why in [("tests.test_plugins:Missing", "Missing"), ("no_such_module_x:P", "no_such_module_x"),
                     ("/nope/p.py:P", "no such file"), ("tests.test_plugins:BS", "lacks name"),
                     ("not_an_entry_point", "entry point")]:
        with pytest.raises(ValueError, match=why):
            load_policy(bad)
    # An installed distribution advertising the policy in the kvtier.policies group.
    dist = tmp_path / "demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvtier.policies]\nleast_device = tests.test_plugins:LeastDevice\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert is_plugin_spec("least_device") and load_policy("least_device").name == "least_device"


def test_a_plugin_file_named_without_its_policy_is_told_how(capsys: pytest.CaptureFixture[str]) -> None:
    """``--policy examples/fresh_first_policy.py`` (the attribute left out) got the unknown-policy list; it is told
    to name the policy in the file."""
    from kvtier.sim.cli import main

    assert main(["replay", "--trace", "builtin:chat:4", "--policy", "examples/fresh_first_policy.py"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvtier: error: policy 'examples/fresh_first_policy.py': a plugin file is named with the policy in it, "
        "examples/fresh_first_policy.py:ATTR (its class, factory or instance)")


def test_the_same_plugin_routes_in_the_simulator() -> None:
    reqs = chat(200)
    fresh = simulate(reqs, SMALL, RunConfig(EXAMPLE))
    perverse = simulate(reqs, SMALL, RunConfig("tests.test_plugins:LeastDevice"))
    rr = simulate(reqs, SMALL, RunConfig("round_robin"))
    assert fresh.summary.requests == perverse.summary.requests == len(reqs)
    assert fresh.summary.policy == "fresh_first"  # its declared name, not the spec
    assert fresh.summary.hit_rate > rr.summary.hit_rate > perverse.summary.hit_rate


def test_the_same_plugin_routes_in_the_service() -> None:
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0",
                                       policy="tests.test_plugins:LeastDevice"))
    svc.start()
    try:
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3], None, 0)]))
        # Both workers' catch-ups done too: a worker still recovering is left out of the candidates, so while w1
        # recovers, w0 would be recommended.
        wait_for(lambda: (b := post(svc.address + "/query", {"token_ids": TOKS})[1])["workers"]["w0"]["device"] == 3
                 and not any(w["recovering"] for w in b["workers"].values()))
        body = post(svc.address + "/query", {"token_ids": TOKS})[1]
        assert body["recommended"] == "w1" and body["costs"] == {"w0": 3.0, "w1": 0.0}
    finally:
        svc.stop()
        for p in pubs:
            p.close()
    with pytest.raises(LookupError, match="filter kept"):
        svc2 = IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy="tests.test_plugins:Nobody"))
        svc2.router.route([1] * 32)


def test_cli_takes_plugins_and_rejects_bad_ones(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert cli_main(["replay", "--trace", "builtin:chat:40", "--workers", "2", "--policy", EXAMPLE,
                     "--out", str(out), "--no-plots"]) == 0
    assert cli_main(["replay", "--trace", "builtin:chat:40", "--policy", "tests.test_plugins:Missing",
                     "--out", str(out), "--no-plots"]) == 2


class ClaimsKvAll(LeastDevice):
    name = "kv_all"


class AlsoFreshFirst(LeastDevice):
    name = "fresh_first"


def test_a_plugin_is_shown_under_its_declared_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tables, summary.json and requests.csv name a plugin as it names itself; one that declares a built-in's name
    keeps its spec beside it, and two runs that would read alike are refused."""
    out = tmp_path / "run"
    assert cli_main(["compare", "--trace", "builtin:chat:40", "--workers", "2", "--out", str(out), "--no-plots",
                     "--policies", f"round_robin,{EXAMPLE},tests.test_plugins:ClaimsKvAll"]) == 0
    names = ["round_robin", "fresh_first", "kv_all (tests.test_plugins:ClaimsKvAll)"]
    table = capsys.readouterr().out
    assert all(f"\n{n} " in table for n in names), table
    assert [r["policy"] for r in json.loads((out / "summary.json").read_text())["runs"]] == names
    with (out / "requests.csv").open() as f:
        assert {row["policy"] for row in csv.DictReader(f)} == set(names)
    assert cli_main(["compare", "--trace", "builtin:chat:40", "--out", str(out), "--no-plots",
                     "--policies", f"{EXAMPLE},tests.test_plugins:AlsoFreshFirst"]) == 2
    assert "both called 'fresh_first'" in capsys.readouterr().err


def test_cache_blind_builtins_route_by_turn_and_by_load() -> None:
    from kvtier.indexer.index.tiered import TieredIndex
    from kvtier.indexer.routing.plugins import LeastLoadedPolicy, RoundRobinPolicy, note_routed
    from kvtier.indexer.routing.router import Router
    from kvtier.indexer.routing.scoring import CreditCost
    from kvtier.wire import WorkerId

    idx = TieredIndex(BS)
    ws = [StreamId(WorkerId(f"w{i}")) for i in range(3)]
    for w in ws:
        idx.add_worker(w)
    rr = Router(idx, CreditCost(), policy=RoundRobinPolicy())
    turns = []
    for _ in range(4):  # the turn moves once the choice is booked (a query, which books nothing, takes none)
        assert rr.route([1] * 8).worker == rr.route([1] * 8).worker
        turns.append(rr.route([1] * 8).worker)
        note_routed(rr.policy, [], 8, turns[-1])
    assert [str(w) for w in turns] == ["w0", "w1", "w2", "w0"]
    ll = Router(idx, CreditCost(), policy=LeastLoadedPolicy())
    ll.loads.add("a", ws[0], [], 8, 8)
    ll.loads.add("b", ws[2], [], 8, 8)
    assert ll.route([1] * 8).worker == ws[1]


def test_a_bug_in_kvtiers_own_policies_surfaces_as_itself_not_as_a_plugin_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtier's own policies go through the plugin protocol too; their exceptions are kvtier's bugs, so they are not
    dressed as a plugin's failure (a one-line exit 2, a counted 500): they keep their type and traceback."""
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.indexer.routing.plugins import BUILTIN, PluginError, route_with
    from kvtier.wire.overlap import OverlapScores
    from kvtier.wire.protocol import WorkerId

    policy = BUILTIN["round_robin"]()
    monkeypatch.setattr(type(policy), "score", lambda self, ctx, w: {}["missing"])
    workers = [StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))]
    ctx = RouteContext(64, BS, [], OverlapScores(total_blocks=4), LoadTracker(BS), frozenset())
    with pytest.raises(KeyError) as err:
        route_with(policy, ctx, workers)
    assert not isinstance(err.value, PluginError)


@pytest.mark.parametrize("module", ["kvtier.contrib.mine", "my_policies"])
def test_a_users_plugin_fails_as_a_plugin_whatever_its_module(module: str) -> None:
    """The ``kvtier`` namespace is open to other packages: a user's plugin there (or a subclass of one of kvtier's
    own) is still a plugin, its exception named in one line (a PluginError), not taken for kvtier's bug."""
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.indexer.routing.plugins import BUILTIN, PluginError, route_with
    from kvtier.wire.overlap import OverlapScores
    from kvtier.wire.protocol import WorkerId

    class Theirs(BUILTIN["round_robin"]):  # type: ignore[misc,valid-type]
        name = "theirs"

        def score(self, ctx: RouteContext, worker: StreamId) -> float:
            return {}["missing"]  # type: ignore[no-any-return]

    Theirs.__module__ = module
    workers = [StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))]
    ctx = RouteContext(64, BS, [], OverlapScores(total_blocks=4), LoadTracker(BS), frozenset())
    with pytest.raises(PluginError, match=r"policy 'theirs': score\(\) raised KeyError: 'missing'"):
        route_with(Theirs(), ctx, workers)


def test_a_plugins_error_names_the_line_of_its_own_code(tmp_path: Path) -> None:
    """The one line a failing plugin gets names where in the plugin's code it raised: the plugin's own line where
    a library it called raised beneath it, and the line of a plugin that fails at import (a syntax error's message
    names its line already)."""
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.indexer.routing.plugins import PluginError, load_policy, route_with
    from kvtier.wire.overlap import OverlapScores
    from kvtier.wire.protocol import WorkerId

    src = tmp_path / "mypolicy.py"
    src.write_text("import json\n"
                   "from kvtier.indexer.routing.plugins import PolicyBase\n"
                   "\n"
                   "class Bad(PolicyBase):\n"
                   "    name = 'bad'\n"
                   "\n"
                   "    def score(self, ctx, worker):\n"
                   "        return json.loads('{')\n")
    workers = [StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))]
    ctx = RouteContext(64, BS, [], OverlapScores(total_blocks=4), LoadTracker(BS), frozenset())
    with pytest.raises(PluginError) as err:
        route_with(load_policy(f"{src}:Bad"), ctx, workers)
    assert str(err.value).startswith("policy 'bad': score() raised JSONDecodeError: Expecting property name")
    assert str(err.value).endswith("(mypolicy.py, line 8, in score)")
    broken = tmp_path / "atimport.py"
    broken.write_text("X = 1\nY = {}['missing']\n")
    with pytest.raises(ValueError, match=r"KeyError: 'missing' \(atimport\.py, line 2, in <module>\)$"):
        load_policy(f"{broken}:X")
    # Where no line of the plugin's raised (no such module, a score float() does not take), kvtier's own line is no
    # plugin's: none is named.
    with pytest.raises(ValueError) as no_module:
        load_policy("no_such_module_here:X")
    assert str(no_module.value).endswith("No module named 'no_such_module_here'"), no_module.value
    src.write_text(src.read_text().replace("json.loads('{')", "'abc'"))
    with pytest.raises(PluginError) as not_a_number:
        route_with(load_policy(f"{src}:Bad"), ctx, workers)
    assert str(not_a_number.value).endswith("could not convert string to float: 'abc'"), not_a_number.value
    # The same from the installed command, whose kvtier package path is the install's, not the tests' (an editable
    # install's names one folder of kvtier's seven): kvtier's own line is still no plugin's.
    run = subprocess.run([sys.executable, "-m", "kvtier", "replay", "--trace", "builtin:chat:4", "--no-plots",
                          "--out", str(tmp_path / "out"), "--policy", f"{src}:Bad"], capture_output=True, text=True,
                         timeout=300, check=False, cwd=tmp_path, env={k: v for k, v in os.environ.items()
                                                                      if k != "PYTHONPATH"})
    assert run.returncode == 2 and run.stderr.rstrip().endswith("could not convert string to float: 'abc'"), run.stderr


class Interrupts(PolicyBase):
    """Raises what no ``except Exception`` takes (a KeyboardInterrupt of its own, an asyncio.CancelledError)."""

    name = "interrupts"
    raises: type[BaseException] = KeyboardInterrupt

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        raise self.raises


class Meddles(PolicyBase):
    """Adjusts the load it is shown, drops workers from the overlaps, and picks a plain tuple."""

    name = "meddles"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        load = ctx.load(worker)
        load.running += 5
        ctx.overlaps.workers.pop(worker, None)
        return 0.0

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        return cast(StreamId, tuple(min(scores)))


def _two_workers() -> tuple[list[StreamId], RouteContext]:
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.wire.overlap import OverlapScores
    from kvtier.wire.protocol import WorkerId

    workers = [StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))]
    return workers, RouteContext(64, BS, [], OverlapScores(total_blocks=4), LoadTracker(BS), frozenset())


@pytest.mark.parametrize("raises", [KeyboardInterrupt, asyncio.CancelledError])
def test_a_plugin_raising_past_exception_off_the_main_thread_fails_as_a_plugin(
        raises: type[BaseException]) -> None:
    """In the service a plugin runs on the HTTP thread, where no Ctrl-C lands: a KeyboardInterrupt it raised killed
    that thread (the service up, every request unanswered for ever), an asyncio.CancelledError dropped the connection
    unanswered. Off the main thread either is the plugin's failure; on it a KeyboardInterrupt is still the user's
    Ctrl-C."""
    from kvtier.indexer.routing.plugins import PluginError, route_with

    workers, ctx = _two_workers()
    policy = Interrupts()
    policy.raises = raises
    got: list[BaseException] = []

    def run() -> None:
        try:
            route_with(policy, ctx, workers)
        except BaseException as exc:  # (what reached the thread's top)
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert isinstance(got[0], PluginError) and "score() raised" in str(got[0]), got
    if raises is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            route_with(policy, ctx, workers)


def test_what_a_plugin_changes_of_what_it_is_shown_changes_no_booking_and_no_answer() -> None:
    """``ctx.load`` handed the router's own load: a plugin that adjusted it left phantom running requests behind,
    skewing every later choice. One that dropped workers from ``ctx.overlaps`` made the service answer a cryptic
    400 (the chosen worker's overlap missing), and a plain tuple equal to a worker was answered as that tuple."""
    from kvtier.indexer.index.tiered import TieredIndex
    from kvtier.indexer.routing.load import LoadTracker
    from kvtier.indexer.routing.router import Router
    from kvtier.indexer.routing.scoring import CreditCost
    from kvtier.wire import WorkerId

    index = TieredIndex(BS)
    workers = [StreamId(WorkerId(f"w{i}")) for i in range(2)]
    for w in workers:
        index.add_worker(w)
    loads = LoadTracker(BS)
    router = Router(index, CreditCost(), loads=loads, workers=workers, policy=Meddles())
    d = router.route(TOKS)
    assert d.worker == workers[0] and type(d.worker) is StreamId
    assert set(d.overlaps.workers) == set(workers)
    assert all(loads.load(w).running == 0 for w in workers)


def test_a_plugin_whose_name_raises_later_is_named_by_its_class() -> None:
    """The error path read the plugin's name again: one whose name raised after it loaded turned its failure into
    kvtier's own error (a 500 with a traceback in the service)."""
    from kvtier.indexer.routing.plugins import PluginError, route_with

    class Fickle(Nobody):
        @property  # type: ignore[override]
        def name(self) -> str:
            raise RuntimeError("no name now")

    workers, ctx = _two_workers()
    with pytest.raises(PluginError, match=r"^policy Fickle \(its name raised\): filter kept \[\]"):
        route_with(Fickle(), ctx, workers)
