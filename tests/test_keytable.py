"""The compiled tables (kvtier.indexer.keytable) against the dicts they replace: growth, deletion by backward
shift, wide masks, and the engine-hash table's signedness and its move to a dict."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.indexer.keytable import KERNELS, KEY, EngineHashes, KeyTable

pytestmark = pytest.mark.skipif(KERNELS.get() is None, reason="compiled tables need numba (KVTIER_JIT=0 here)")

M64 = (1 << 64) - 1


def _check_table(t: KeyTable | EngineHashes) -> None:
    """Every used slot's key is found where it is (no probe run was broken), and the count is right."""
    used = t.used()
    assert len(used) == int(t.m[0]), "entry count out of sync with the used flags"
    for i in used.tolist():
        assert t.slot(int(t.r[i, KEY])) == i, f"row {i}: key {int(t.r[i, KEY]):#x} not found where it lies"


class KeyTableMachine(RuleBasedStateMachine):
    """Batches big enough to grow the table past its first capacity, keys from a small range so that probe runs
    collide, and masks of up to 40 slots (three words)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = KeyTable()
        self.d: dict[int, int] = {}

    @rule(keys=st.lists(st.integers(0, 4000), min_size=1, max_size=500), slot=st.integers(0, 39),
          tier=st.integers(0, 3))
    def set_many(self, keys: list[int], slot: int, tier: int) -> None:
        for k in keys:
            m = self.d.get(k, 0) | 1 << (4 * slot + tier)
            self.t[k] = m  # type: ignore[index]
            self.d[k] = m

    @rule(data=st.data())
    def delete_some(self, data: st.DataObject) -> None:
        if not self.d:
            return
        for k in data.draw(st.lists(st.sampled_from(sorted(self.d)), max_size=300, unique=True)):
            del self.t[k]  # type: ignore[arg-type]
            del self.d[k]

    @rule(k=st.integers(0, M64))
    def missing_reads(self, k: int) -> None:
        assert (k in self.t) == (k in self.d)
        assert self.t.get(k, 0) == self.d.get(k, 0)  # type: ignore[arg-type]
        if k not in self.d:
            with pytest.raises(KeyError):
                del self.t[k]  # type: ignore[arg-type]

    @invariant()
    def same_as_dict(self) -> None:
        assert dict(self.t.items()) == self.d
        assert len(self.t) == len(self.d)
        _check_table(self.t)
        self.t._check()


KeyTableMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
TestKeyTable = KeyTableMachine.TestCase

hashes = st.one_of(st.integers(-(2**63), -1), st.integers(0, 2**63 - 1), st.integers(2**63, M64),
                   st.binary(max_size=8), st.integers(0, 50))


class EngineHashesMachine(RuleBasedStateMachine):
    """Engine hashes of either signedness, bytes and small ints, through both the mapping interface and the
    kernels' array conversion: the table gives back what it was given, or moves to a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.e = EngineHashes()
        self.d: dict[object, int] = {}

    @rule(ehs=st.lists(hashes, min_size=1, max_size=200), key=st.integers(0, M64))
    def put(self, ehs: list[int], key: int) -> None:
        arr = self.e.int64s(ehs)
        if arr is not None:  # the table holds them all, as their 64 bits
            assert arr.tolist() == [h & M64 for h in ehs]
        for h in ehs:
            self.e[h] = key  # type: ignore[assignment]
            self.d[h] = key

    @rule(data=st.data())
    def delete_some(self, data: st.DataObject) -> None:
        if self.d:
            for h in data.draw(st.lists(st.sampled_from(list(self.d)), max_size=50, unique=True)):
                del self.e[h]  # type: ignore[arg-type]
                del self.d[h]

    @rule(h=hashes)
    def reads(self, h: int) -> None:
        assert (h in self.e) == (h in self.d)
        assert self.e.get(h) == self.d.get(h)

    @rule()
    def clear(self) -> None:
        self.e.clear()
        self.d.clear()

    @invariant()
    def same_as_dict(self) -> None:
        assert dict(self.e.items()) == self.d
        assert sorted(map(repr, self.e)) == sorted(map(repr, self.d))
        assert sorted(self.e.values()) == sorted(self.d.values())
        if self.e.py is None:
            _check_table(self.e)
            ints = [h for h in self.d if isinstance(h, int)]
            assert len(ints) == len(self.d), "bytes in the table"
            assert not (any(h < 0 for h in ints) and any(h >= 2**63 for h in ints)), "both signs in the table"


EngineHashesMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)
TestEngineHashes = EngineHashesMachine.TestCase


def test_a_seventeenth_worker_widens_every_mask() -> None:
    t = KeyTable()
    t[5] = 1  # type: ignore[index]
    t[6] = 1 << 70  # type: ignore[index]
    assert t.words == 2 and t[5] == 1 and t[6] == 1 << 70  # type: ignore[index]
    t[5] = 1 | 1 << 200  # type: ignore[index]
    assert t.words == 4 and t[5] == 1 | 1 << 200 and t[6] == 1 << 70  # type: ignore[index]


def test_deleting_from_crowded_probe_runs_keeps_every_other_key_found() -> None:
    """Deletion moves later entries of a probe run back: at three-quarters load, with every third key deleted,
    every key left must still be found (a deletion that only freed its slot would cut runs short)."""
    t = KeyTable()
    cap = t.r.shape[0]
    keys = list(range(1, cap * 3 // 4))
    for k in keys:
        t[k] = 1  # type: ignore[index]
    assert t.r.shape[0] == cap, "the table grew: the test wants it crowded"
    for k in keys[::3]:
        del t[k]  # type: ignore[arg-type]
    left = [k for i, k in enumerate(keys) if i % 3]
    assert [k for k in left if t.get(k) != 1] == []  # type: ignore[arg-type]
    assert all(keys[i] not in t for i in range(0, len(keys), 3))
    _check_table(t)
