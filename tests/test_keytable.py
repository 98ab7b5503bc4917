"""The compiled tables (kvtier.indexer.index.keytable) against the dicts they replace: growth, deletion by backward
shift, wide masks, and the engine-hash table's signedness and its move to a dict."""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import queue
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.indexer.index.keyrefs import KeyRefs, key_array
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import KERNELS, KEY, USED, EngineHashes, KeyTable, warm_tables
from kvtier.sim.cli import main as cli_main
from tests.conftest import SLOW
from tests.jit_paths import python_path

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


KeyTableMachine.TestCase.settings = settings(max_examples=1000 if SLOW else 25, stateful_step_count=30 if SLOW else 12,
                                             deadline=None)
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


EngineHashesMachine.TestCase.settings = settings(max_examples=1000 if SLOW else 40,
                                                 stateful_step_count=30 if SLOW else 15, deadline=None)
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


def _same_home(t: KeyTable | EngineHashes, count: int, start: int) -> list[int]:
    """``count`` keys from ``start`` up that share one home row of ``t``."""
    mask = t.r.shape[0] - 1
    by_home: dict[int, list[int]] = {}
    k = start
    while True:
        got = by_home.setdefault(int(t.k._home(np.uint64(k), mask)), [])
        got.append(k)
        if len(got) == count:
            return got
        k += 1


@pytest.mark.parametrize("held_before", [False, True])
def test_a_store_whose_new_keys_share_a_probe_run_claims_each_its_own_row(held_before: bool) -> None:
    """The store kernel probes every block once, then claims from where each probe stopped: keys of one event that
    stopped at the same free row must still land in distinct rows, as must their engine hashes, and a key repeated
    in the chain must find the row its first claim took."""
    t, e = KeyTable(), EngineHashes()
    t.widen(2)
    t.pool.reserve(64)
    keys = _same_home(t, 4, 1 << 40)
    ehs = _same_home(e, 5, 7)
    t[keys[0] + 1] = 1  # type: ignore[index]  # (somebody else's key, so that runs pass used rows)
    if held_before:  # case 4: the first key is held by another worker's slot already
        t[keys[0]] = 1 << 4  # type: ignore[index]
    chain = [keys[0], keys[1], keys[2], keys[1], keys[3]]
    n = len(chain)
    newly, how = np.empty(n, np.uint8), np.empty(n, np.uint8)
    cur, res = np.empty(n, np.uint64), np.empty(7, np.int64)
    p = t.pool
    path = t.k.store(t.r, t.m, p.pm, p.ph, p.pa, e.r, e.m, np.array(chain, np.uint64), np.array(ehs, np.uint64),
                     np.uint64(0), False, 0, np.uint64(1), np.uint64(0xF), True, newly, how, cur, res)
    assert path == (4 if held_before else 1)
    _check_table(t)
    _check_table(e)
    rows = {k: t.slot(k) for k in keys}
    assert len(set(rows.values())) == len(keys) and min(rows.values()) >= 0
    assert [t[k] & 1 for k in keys] == [1, 1, 1, 1]  # type: ignore[index]
    assert (t[keys[0]] >> 4) & 1 == held_before  # type: ignore[index]
    # Case 4 names the repeated key once: its second engine hash is an alias. Case 1 takes every name.
    named = [h for j, h in enumerate(ehs) if not (held_before and j == 3)]
    assert {h: e[h] for h in named} == {h: k for h, k in zip(ehs, chain, strict=True) if h in named}  # type: ignore[index]
    assert len(e) == len(named) and res[2] == (1 if held_before else 0)
    assert len(t) == len(keys) + 1


def test_tables_past_five_eighths_grow_into_rows_zeroed_ahead_on_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 5/8 full, the store kernel has the index ready a table's next size (RowTable.prepare: zeroed on a helper
    thread, off the GIL); the growth at 3/4 rehashes into those rows. With every table prepared (no size floor),
    an index of thousands of blocks must answer as one that grew the plain way, and the prepared rows must have
    been used, by the masks' table and by the engine hashes'."""
    from kvtier.indexer.index import keytable
    from kvtier.indexer.index.tiered import TieredIndex
    from kvtier.wire import BlockStored, WorkerId
    from kvtier.wire.notices import StreamId

    taken: list[tuple[int, int]] = []
    take = keytable._Prefaulted.take

    def counting(self: keytable._Prefaulted, shape: tuple[int, int]) -> np.ndarray | None:
        got = take(self, shape)
        if got is not None:
            taken.append(shape)
        return got

    def build(floor: int) -> TieredIndex:
        monkeypatch.setattr(keytable, "PREFAULT_BYTES", floor)
        idx = TieredIndex(4)
        rng = np.random.default_rng(3)
        for conv in range(60):
            tokens = rng.integers(0, 50_000, 64 * 4).tolist()
            w = StreamId(WorkerId(f"w{conv % 3}"))
            for part in range(4):  # four stores of 16 blocks, each under the last
                hashes = [conv << 16 | part * 16 + i for i in range(16)]
                parent = (conv << 16 | part * 16 - 1) if part else None
                idx.apply(w, BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                         token_ids=tokens[part * 64:(part + 1) * 64], block_size=4))
        idx._check()
        return idx

    plain = build(1 << 62)
    assert not taken
    monkeypatch.setattr(keytable._Prefaulted, "take", counting)
    ahead = build(0)
    assert any(cols == 4 for _, cols in taken) and any(cols == 3 for _, cols in taken), taken
    assert ahead.snapshot() == plain.snapshot()

    # A process forked now (a sweep's pool) has none of this one's threads: its tables must still grow.
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=lambda: out.put(build(0).snapshot() == plain.snapshot()))
    child.start()
    try:
        assert out.get(timeout=60), "a forked child's index differs"
    except queue.Empty:
        pytest.fail("a forked child's table growth waited for its parent's helper thread")
    finally:
        child.kill()
        child.join()


def test_structured_engine_hashes_spread_like_random_keys() -> None:
    """Engine hashes may be structured ints: fields side by side (a conversation id over a block index, as the
    indexer bench's are: one worker of 16 holds every 16th conversation), sequential ids. Homes must spread them
    like random keys: with a multiply alone such fields sat on a lattice and clustered (here 4.5 rows probed per
    hit at 27% load, where random keys take 1.2; 8.7 at 57% in the bench, against 1.7), on every lookup and claim
    of a store or removal."""
    layouts = {
        "fields": [(1 << 62) | conv << 16 | i for conv in range(5, 4800, 16) for i in range(32, 512)],
        "sequential": list(range(1, 150_001)),
        "random": np.random.default_rng(0).integers(1, 1 << 62, 150_000).tolist(),
    }
    for name, ehs in layouts.items():
        e = EngineHashes()
        e.reserve(len(ehs))
        for j, eh in enumerate(ehs):
            e[eh] = BlockKey(j + 1)
        rows = e.r
        cap = rows.shape[0]
        used = np.flatnonzero(rows[:, USED])
        homes = np.array([e.k._home(np.uint64(k), cap - 1) for k in rows[used, KEY]])
        probes = float(np.mean((used - homes) % cap)) + 1  # rows read by a lookup that finds the key
        load = len(used) / cap
        expected = (1 + 1 / (1 - load)) / 2  # linear probing with random homes (Knuth)
        assert probes < 1.5 * expected, (
            f"{name} engine hashes: {probes:.2f} rows probed per hit at {load:.0%} load, {expected:.2f} expected")


def test_warming_some_table_kernels_names_kernels_that_exist() -> None:
    assert warm_tables(["store_tokens", "remove"]) == "numba"
    with pytest.raises(AssertionError, match=r"no table kernels named \['store_token'\]"):
        warm_tables(["store_token", "remove"])


def test_the_index_ignores_kvtier_jit_0_and_without_numba_says_which_platform_lacks_it() -> None:
    """The tables are the one index: ``KVTIER_JIT=0`` (the leaf kernels' switch) leaves them compiled, and where numba
    cannot import, building an index fails at once with one line naming the platform."""
    code = ("import json; from kvtier.indexer.index.tiered import TieredIndex; from kvtier.indexer.index import keys\n"
            "idx = TieredIndex(16); print(json.dumps([type(idx._masks).__name__, keys.key_backend()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KVTIER_JIT": "0"}).stdout
    assert json.loads(out) == ["KeyTable", "python (KVTIER_JIT=0)"]  # leaf kernels on Python, the index compiled
    blocked = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numba'] = None\n" + code],
                             capture_output=True, text=True)
    assert blocked.returncode == 1
    last = blocked.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtier.kernels.jit.KernelsUnavailable: kvtier.indexer.index.tablekernel needs numba"), last
    assert platform.machine() in last and "no pure-Python path" in last


@pytest.mark.parametrize("argv", [["replay", "--trace", "builtin:chat:20", "--workers", "2"],
                                  ["indexer", "--listen", "127.0.0.1:0", "--endpoint", "w=tcp://127.0.0.1:1"]])
def test_a_command_that_builds_an_index_without_its_kernels_exits_2_with_one_line(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtier replay`` and ``kvtier indexer`` where the table kernels cannot load: exit 2 and one line naming the
    platform, not a traceback (the index is built before any socket is opened)."""
    capsys.readouterr()
    with python_path(KERNELS):
        assert cli_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("kvtier: error:")]  # (replay announces its run)
    assert "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("kvtier: error: kvtier.indexer.index.tablekernel needs numba"), errors
    assert platform.machine() in errors[0]


#: Engine hashes the way each engine sends them, so that a table keeps its compiled rows and grows: SGLang's signed
#: 64-bit ints, vLLM's unsigned ones, and small ints whose homes crowd into long probe runs ((low, high) bounds).
ENGINE_KINDS = {"sglang": (-(2**63), 2**63 - 1), "vllm": (0, M64), "crowded": (1, 3000)}


def _batch(n: int, seed: int, low: int, high: int) -> list[int]:
    """``n`` ints in ``[low, high]`` from ``seed``: hypothesis shrinks the size and the seed, while a list it drew
    itself would stay a few elements long, too short to grow a table."""
    rng = np.random.default_rng(seed)
    span = high - low + 1
    return [low + int.from_bytes(rng.bytes(9), "little") % span for _ in range(n)]


batches = st.tuples(st.integers(1, 700), st.integers(0, 2**32))


class TablesMachine(RuleBasedStateMachine):
    """Every compiled table against the dict it stands for, through every method of each, driven the way the index
    drives them: batches that grow a table many times over through the mapping interface (the path a snapshot's
    restore takes, row by row), deletes, a clear that shrinks it back, a copy rebuilt from its items (the snapshot
    round trip), and the kernels' array views. The engine-hash tables keep one engine's hashes each, so that they
    stay compiled and grow; one that is given a hash it cannot hold moves to a dict, and must still agree."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = KeyTable()
        self.kd: dict[int, int] = {}
        self.ehs = {kind: EngineHashes() for kind in ENGINE_KINDS}
        self.ed: dict[str, dict[object, int]] = {kind: {} for kind in ENGINE_KINDS}
        self.refs = KeyRefs()
        self.rd: dict[int, int] = {}
        self.prompts: list[list[int]] = []  # the chains counted in ``refs``, each once per time it was added

    # --- the masks' table ---------------------------------------------------------------------

    @rule(batch=batches, crowded=st.booleans(), slot=st.integers(0, 39), tier=st.integers(0, 3))
    def masks_set(self, batch: tuple[int, int], crowded: bool, slot: int, tier: int) -> None:
        for k in _batch(*batch, 1, 4000 if crowded else M64):
            m = self.kd.get(k, 0) | 1 << (4 * slot + tier)
            self.keys[k] = m  # type: ignore[index]
            self.kd[k] = m
            assert self.keys[k] == m, f"key {k:#x}: its mask was not where the table looks"  # type: ignore[index]

    @rule(data=st.data())
    def masks_delete(self, data: st.DataObject) -> None:
        if self.kd:
            for k in data.draw(st.lists(st.sampled_from(sorted(self.kd)), max_size=300, unique=True)):
                del self.keys[k]  # type: ignore[arg-type]
                del self.kd[k]

    @rule()
    def masks_clear(self) -> None:
        self.keys.clear()
        self.kd.clear()
        assert self.keys.r.shape[0] == KeyTable().r.shape[0], "a cleared table kept its grown rows"

    @rule()
    def masks_round_trip(self) -> None:
        again = KeyTable()
        for k, m in self.keys.items():
            again[k] = m
        again._check()
        self.keys = again

    # --- the engine hashes' tables ------------------------------------------------------------

    @rule(batch=batches, kind=st.sampled_from(sorted(ENGINE_KINDS)), key=st.integers(0, M64))
    def hashes_put(self, batch: tuple[int, int], kind: str, key: int) -> None:
        ehs = _batch(*batch, *ENGINE_KINDS[kind])
        e, d = self.ehs[kind], self.ed[kind]
        arr = e.int64s(ehs)
        if arr is not None:
            assert arr.tolist() == [h & M64 for h in ehs]
        for j, h in enumerate(ehs):
            e[h] = BlockKey(key ^ j)
            d[h] = key ^ j
            assert e[h] == key ^ j, f"engine hash {h}: its key was not where the table looks"  # type: ignore[index]

    @rule(kind=st.sampled_from(sorted(ENGINE_KINDS)), h=st.binary(min_size=1, max_size=8))
    def hashes_put_one_it_cannot_hold(self, kind: str, h: bytes) -> None:
        self.ehs[kind][h] = BlockKey(7)  # type: ignore[index]
        self.ed[kind][h] = 7
        assert self.ehs[kind].py is not None

    @rule(data=st.data(), kind=st.sampled_from(sorted(ENGINE_KINDS)))
    def hashes_delete(self, data: st.DataObject, kind: str) -> None:
        d = self.ed[kind]
        if d:
            for h in data.draw(st.lists(st.sampled_from(list(d)), max_size=300, unique=True)):
                del self.ehs[kind][h]  # type: ignore[arg-type]
                del d[h]

    @rule(kind=st.sampled_from(sorted(ENGINE_KINDS)))
    def hashes_clear(self, kind: str) -> None:
        self.ehs[kind].clear()
        self.ed[kind].clear()

    @rule(kind=st.sampled_from(sorted(ENGINE_KINDS)))
    def hashes_round_trip(self, kind: str) -> None:
        again = EngineHashes()
        for h, k in self.ehs[kind].items():
            again[h] = k
        self.ehs[kind] = again

    @rule(kind=st.sampled_from(sorted(ENGINE_KINDS)), h=st.one_of(st.integers(-(2**64), 2**65), st.binary(max_size=8)))
    def hashes_read(self, kind: str, h: object) -> None:
        e, d = self.ehs[kind], self.ed[kind]
        assert (h in e) == (h in d)
        assert e.get(h) == d.get(h)  # type: ignore[arg-type]
        if h not in d:
            with pytest.raises(KeyError):
                e[h]  # type: ignore[index]
            with pytest.raises(KeyError):
                del e[h]  # type: ignore[arg-type]

    # --- the router's reference counts --------------------------------------------------------

    @rule(first=st.integers(1, 50), n=st.integers(0, 700))
    def refs_add(self, first: int, n: int) -> None:
        chain = [first << 32 | j for j in range(n)]
        arr = key_array(chain)
        assert arr is not None
        absent = sum(1 for k in set(chain) if k not in self.rd)
        assert self.refs.add(arr) == absent
        for k in chain:
            self.rd[k] = self.rd.get(k, 0) + 1
        self.prompts.append(chain)

    @rule(data=st.data())
    def refs_drop(self, data: st.DataObject) -> None:
        if self.prompts:
            chain = self.prompts.pop(data.draw(st.integers(0, len(self.prompts) - 1)))
            arr = key_array(chain)
            assert arr is not None
            gone = self.refs.drop(arr)
            for k in chain:
                self.rd[k] -= 1
            assert gone == sum(1 for k in set(chain) if not self.rd[k])
            self.rd = {k: c for k, c in self.rd.items() if c}

    @rule(data=st.data())
    def refs_held_prefix(self, data: st.DataObject) -> None:
        """Held prefixes of chains that mostly start where a counted prompt does, each asked at the search's edges
        (one key short of where its counted part ends, there, one key past: partly held) and at a random length."""
        firsts = sorted({c[0] >> 32 for c in self.prompts if c})
        first = data.draw(st.sampled_from(firsts) if firsts and data.draw(st.integers(0, 3)) else st.integers(1, 50))
        counted = next(j for j in range(10_000) if (first << 32 | j) not in self.rd)
        for n in sorted({max(1, counted - 1), max(1, counted), counted + 1, data.draw(st.integers(1, 400))}):
            chain = [first << 32 | j for j in range(n)]
            arr = key_array(chain)
            assert arr is not None
            held = min(counted, n)
            event("held prefix: " + ("none" if held == 0 else "all" if held == n else "part"))
            assert self.refs.held_prefix(arr, chain[0]) == held
            assert KeyRefs.held_prefixes((None, self.refs), arr, chain[0]) == [0, held]

    # --- what every table must keep -------------------------------------------------------------

    @invariant()
    def same_as_dicts(self) -> None:
        assert dict(self.keys.items()) == self.kd and len(self.keys) == len(self.kd)
        assert sorted(self.keys) == sorted(self.kd)
        _check_table(self.keys)
        self.keys._check()
        for kind, e in self.ehs.items():
            d = self.ed[kind]
            assert dict(e.items()) == d and len(e) == len(d), kind
            assert sorted(map(repr, e)) == sorted(map(repr, d))
            assert sorted(e.values()) == sorted(d.values()) == sorted(e.key_array().tolist())
            if e.py is None:
                _check_table(e)
        assert self.refs.to_dict() == self.rd and len(self.refs) == len(self.rd)
        _check_table(self.refs._t)  # type: ignore[arg-type]


TablesMachine.TestCase.settings = settings(max_examples=1000 if SLOW else 30, stateful_step_count=40 if SLOW else 20,
                                           deadline=None)
TestTablesAgainstDicts = TablesMachine.TestCase


@pytest.mark.parametrize("signed", [True, False])
def test_engine_hashes_written_one_by_one_grow_without_losing_one(signed: bool) -> None:
    """A snapshot's restore writes a worker's engine hashes one by one into a table of 64 rows: each write that
    grows the table must land in the grown rows, not in the rows it replaced."""
    e = EngineHashes()
    base = -(1 << 62) if signed else 1 << 63
    ehs = [base + i * 0x9E3779B97F4A7C15 % (1 << 62) for i in range(1, 5000)]
    for j, h in enumerate(ehs):
        e[h] = BlockKey(j + 1)
    assert len(e) == len(ehs) and all(e[h] == j + 1 for j, h in enumerate(ehs))  # type: ignore[index]
    _check_table(e)
