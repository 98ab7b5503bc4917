"""The collector-pause counter and the startup freeze that keeps the service's full passes short."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterator

import pytest

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.util.gcpause import RARE_YOUNG_THRESHOLD, GcPauses, freeze_startup_objects, rare_collections


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # frozen objects go back to the oldest generation: nothing else sees the test's freeze


def test_pauses_are_counted_per_pass_and_stop_when_uninstalled() -> None:
    pauses = GcPauses()
    # No automatic pass (this thread's allocations, or another thread's: a helper an earlier test left) is counted
    # beside the two asked for here.
    enabled = gc.isenabled()
    gc.disable()
    try:
        pauses.install()
        pauses.install()  # idempotent: one callback, each pass counted once
        try:
            gc.collect(0)
            gc.collect()
            f = pauses.figures()
            assert f["gc_passes"] == 2 and f["gc_full_passes"] == 1
            assert 0 < f["gc_pause_max_seconds"] <= f["gc_pause_seconds"]
        finally:
            pauses.uninstall()
        gc.collect()
    finally:
        if enabled:
            gc.enable()
    assert pauses.figures()["gc_passes"] == 2
    assert pauses._callback not in gc.callbacks


def test_freeze_takes_live_objects_out_of_later_passes_and_collects_garbage_first(unfrozen: None) -> None:
    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    live = [Node() for _ in range(100)]
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: garbage only the collector frees
    cycle = weakref.ref(a)
    del a, b
    frozen = freeze_startup_objects()
    # Not ==: another thread (the tqdm monitor an earlier progress bar started wakes every 10 s) may free frozen
    # objects in between.
    assert frozen >= len(live) and len(live) <= gc.get_freeze_count() <= frozen
    tracked = {id(o) for o in gc.get_objects()}
    assert id(live) not in tracked and not any(id(n) in tracked for n in live)  # later passes skip them
    assert cycle() is None, "a reference cycle was frozen instead of collected: it would never be freed"


def test_rare_collections_raises_the_young_threshold_and_restores_it_after_an_error() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError, match="inside"), rare_collections(12_345):
        assert gc.get_threshold() == (12_345, *before[1:])
        raise RuntimeError("inside")
    assert gc.get_threshold() == before
    with pytest.raises(ValueError, match="threshold"), rare_collections(0):
        pass
    assert gc.get_threshold() == before
    gc.set_threshold(0, *before[1:])  # automatic collection off: it stays off
    try:
        with rare_collections(12_345):
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_a_simulation_runs_with_rare_collections_and_leaves_the_thresholds_as_they_were() -> None:
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=40), 3)
    simulate(trace, ClusterConfig.of(workers=2), RunConfig("kv_host"), sink=lambda _: seen.append(gc.get_threshold()))
    assert len(seen) == 40 and seen[0][0] == RARE_YOUNG_THRESHOLD  # the first finishes while the run goes on
    assert gc.get_threshold() == before
