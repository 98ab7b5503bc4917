"""Stores whose parent the index does not know yet, held until it does.

A ``BlockStored`` names its first block's parent by engine hash, and the router key of every
block chains from the parent's key, so a store whose parent is unknown cannot be indexed yet.
That happens for three ordinary reasons, none of them a lost batch on the stream:

* the worker's state before a loss was dropped (replay could not reach back and the engine
  cannot dump), and the engine now extends a prefix it stored before the loss;
* a shared pool's writers announce a page's child before the page itself;
* an engine publishes a store whose parent it never announced (a bug on its side).

Asking for a resync would not help in any of these (a replay delivers the same store again), so
such a store is an *orphan*: held here, bounded, and grafted into the index as soon as its
parent's key becomes known (another store naming the parent hash, on any tier). Removals that
name an orphan's blocks are applied to the held copy, so a graft never resurrects a block the
engine dropped. The oldest orphans are aged out when the pool is full.

Invariants (asserted by :meth:`OrphanPool._check`): every held run is listed once under its
parent hash, once in age order, and each of its blocks still present under its (block hash, tier),
by position; ``blocks`` and ``held_bytes`` are the sums of the runs' lengths and sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from kvtier.wire.protocol import BlockStored, EngineHash, StorageTier

_encode = msgspec.msgpack.Encoder().encode
_decode_stored = msgspec.msgpack.Decoder(BlockStored).decode


@dataclass(slots=True, eq=False)
class OrphanRun:
    """One held store: its blocks and which of them the engine still holds on ``tier``."""

    event: BlockStored  # the store as received (its parent is unknown)
    tier: StorageTier  # tier the store put its blocks on
    present: list[bool]  # per block: False once a removal on ``tier`` named it
    extras: list[int | None] | None  # per-block key scopes, already read from the event's extra keys
    size: int = 0  # bytes it holds, about: its store as msgpack (set when held)


@dataclass(slots=True)
class OrphanStats:
    """Counters of one worker's orphan pool."""

    held: int = 0  # stores parked because their parent was unknown
    grafted: int = 0  # held stores later indexed once their parent became known
    dropped: int = 0  # held stores aged out (pool full) or cleared with the worker


@dataclass(slots=True)
class OrphanPool:
    """Held orphan stores of one worker. Bounded by ``capacity`` blocks and ``byte_capacity`` bytes (a store of one
    block may carry a salt, a LoRA name or extra keys of megabytes): past either, the oldest runs go first."""

    capacity: int = 65_536  # blocks held at most
    byte_capacity: int = 64 << 20  # bytes held at most (each run's store as msgpack)
    blocks: int = 0  # blocks currently held
    held_bytes: int = 0  # bytes currently held
    stats: OrphanStats = field(default_factory=OrphanStats)  # counters
    _by_parent: dict[EngineHash, list[OrphanRun]] = field(default_factory=dict)  # waiting on a hash
    # (block hash, tier) -> id(run) -> positions in that run of the blocks with that hash still present: a removal
    # takes its entry whole (a block once gone from a run never comes back), so each listed block costs one visit.
    _by_hash: dict[tuple[EngineHash, StorageTier], dict[int, list[int]]] = field(default_factory=dict)
    _age: OrderedDict[int, OrphanRun] = field(default_factory=OrderedDict)  # id(run) -> run, oldest first

    def __bool__(self) -> bool:
        return bool(self._age)

    def __len__(self) -> int:
        """Runs held."""
        return len(self._age)

    def hold(self, event: BlockStored, tier: StorageTier, extras: list[int | None] | None = None) -> None:
        """Parks ``event`` (whose parent is unknown) until its parent is known.

        O(blocks in the event), plus the blocks of any runs aged out to make room.
        """
        self._keep(OrphanRun(event, tier, [True] * len(event.block_hashes), extras))
        self.stats.held += 1
        while (self.blocks > self.capacity or self.held_bytes > self.byte_capacity) and self._age:
            _, oldest = self._age.popitem(last=False)
            self._forget(oldest)
            self.stats.dropped += 1

    def dump(self) -> list[tuple[bytes, int, list[bool], list[int | None] | None]]:
        """The held runs, oldest first, as plain values for a snapshot: ``(the store as msgpack, its tier, which
        blocks are still present, its key scopes)``, copies: the pool may change while a snapshot is written from
        them. O(blocks held)."""
        return [(_encode(r.event), int(r.tier), list(r.present), r.extras) for r in self._age.values()]

    def load(self, runs: list[tuple[bytes, int, list[bool], list[int | None] | None]], block_size: int) -> None:
        """Holds :meth:`dump`'s runs again as they were (removals applied to them kept), after those held now; no
        counter moves and nothing is aged out. ``ValueError``, ``TypeError`` or ``msgspec.DecodeError`` if a run
        is not what :meth:`dump` writes, nor a store the index (of ``block_size``) would have held: blocks of
        another size, token ids out of step with its blocks, a parent among them. O(blocks)."""
        for raw, tier, present, extras in runs:
            event = _decode_stored(raw)
            n = len(event.block_hashes)
            if event.parent_block_hash is None or len(present) != n or not (
                    extras is None or (len(extras) == n and all(x is None or type(x) is int for x in extras))):
                raise ValueError("a held orphan run with no parent, or flags or key scopes out of step with its blocks")
            if not n or event.block_size != block_size or event.num_tokens != n * block_size \
                    or event.parent_block_hash in event.block_hashes:
                raise ValueError(f"a held orphan run no store could make: {n} blocks of {event.block_size} (the "
                                 f"index's: {block_size}), {event.num_tokens} token ids, or under one of its blocks")
            self._keep(OrphanRun(event, StorageTier(tier), [bool(p) for p in present], extras))

    def _keep(self, run: OrphanRun) -> None:
        """Lists ``run`` as the newest held one. O(blocks of ``run``)."""
        parent = run.event.parent_block_hash
        assert parent is not None, "a root store is never an orphan"
        self._by_parent.setdefault(parent, []).append(run)
        rid, tier = id(run), run.tier
        for i, (eh, present) in enumerate(zip(run.event.block_hashes, run.present, strict=True)):
            if present:
                self._by_hash.setdefault((eh, tier), {}).setdefault(rid, []).append(i)
        self._age[rid] = run
        self.blocks += len(run.event.block_hashes)
        run.size = len(_encode(run.event))
        self.held_bytes += run.size

    def take(self, parent: EngineHash) -> list[OrphanRun]:
        """Removes and returns the runs waiting for ``parent``. O(1) plus their blocks."""
        runs = self._by_parent.pop(parent, None)
        if not runs:
            return []
        for run in runs:
            del self._age[id(run)]
            self._unlist(run)
        self.stats.grafted += len(runs)
        return runs

    def remove(self, eh: EngineHash, tier: StorageTier) -> bool:
        """Marks block ``eh`` gone from ``tier`` in every held run; True if any run held it. O(blocks it names:
        each held block is visited by one removal at most)."""
        named = self._by_hash.pop((eh, tier), None)
        if named is None:
            return False
        for rid, positions in named.items():
            present = self._age[rid].present
            for i in positions:
                present[i] = False
        return True

    def clear(self) -> None:
        """Drops every held run (the worker was cleared). O(1) amortised."""
        self.stats.dropped += len(self._age)
        self._by_parent.clear()
        self._by_hash.clear()
        self._age.clear()
        self.blocks = self.held_bytes = 0

    def _forget(self, run: OrphanRun) -> None:
        parent = run.event.parent_block_hash
        assert parent is not None
        waiting = self._by_parent[parent]
        waiting.remove(run)
        if not waiting:
            del self._by_parent[parent]
        self._unlist(run)

    def _unlist(self, run: OrphanRun) -> None:
        rid, tier = id(run), run.tier
        for eh in set(run.event.block_hashes):
            named = self._by_hash.get((eh, tier))
            if named is not None and named.pop(rid, None) is not None and not named:
                del self._by_hash[(eh, tier)]
        self.blocks -= len(run.event.block_hashes)
        self.held_bytes -= run.size

    def _check(self) -> None:
        """Asserts every invariant. O(held blocks)."""
        runs = list(self._age.values())
        assert len({id(r) for r in runs}) == len(runs), "a run is held twice"
        by_parent = [r for rs in self._by_parent.values() for r in rs]
        assert sorted(map(id, by_parent)) == sorted(map(id, runs)), "parent lists and age order disagree"
        listed = {(eh, tier, rid, i) for (eh, tier), named in self._by_hash.items() for rid, ps in named.items()
                  for i in ps}
        held = {(eh, r.tier, id(r), i) for r in runs for i, eh in enumerate(r.event.block_hashes) if r.present[i]}
        assert listed == held, f"{len(held - listed)} present blocks not listed, {len(listed - held)} listed not held"
        size = sum(r.size for r in runs)
        assert self.held_bytes == size, f"held_bytes={self.held_bytes} but runs hold {size}"
        assert self.blocks == sum(len(r.event.block_hashes) for r in runs), (
            f"blocks={self.blocks} but runs hold {sum(len(r.event.block_hashes) for r in runs)}")
