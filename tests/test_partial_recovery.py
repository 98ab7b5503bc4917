"""Recovery without dumps: after a loss that replay cannot reach, the worker converges anyway.

SGLang and vLLM engines answer replay requests from a bounded buffer and cannot dump their state.
When batches older than the buffer are lost, the index drops the worker's state once (removals
may be among the lost batches), marks it partial, and keeps applying live events; stores that
extend prefixes from before the loss are held as orphans and grafted if their ancestors are
announced again. Invariants at every quiet point (everything delivered, probes settled):

* soundness: the index never reports a block on a tier where the engine does not hold it;
* completeness: every block the engine holds whose chain of stores (its own and every ancestor's,
  on any tier) was published after the last loss is indexed on exactly its tiers;
* regained: kvtier's engine keeps device and host prefix-closed (declared so to the index), so a store on
  either proves its parent chain held there. Every block such a store proves held, through blocks the index held
  when it lost events (it remembers them) up to the root, is indexed there until the engine removes it. Once every
  held chain has been extended (a store under each held leaf), the index equals the engine's residency on those
  tiers, but for blocks whose stores the index never saw;
* a worker that never lost anything for good is indexed exactly, and is not partial;
* recovering one worker never touches the other.
"""

from __future__ import annotations

import tempfile
from collections import deque

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import tests.test_faulty_wire as fw
from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import BlockRemoved, BlockStored, EventBatch, StorageTier, WorkerId, decode_payload
from kvtier.wire.notices import Delivery, PublisherRestarted, Received, ResyncNeeded, ResyncStarted, StreamId
from kvtier.wire.transport.stream import StreamTracker
from tests.conftest import SLOW

CHECKS: list[tuple[int, int]] = []  # (partial workers, blocks checked) per quiet check
REGAINED: list[int] = []  # blocks a store proved held (indexed only by regaining them), per quiet check
CLOSED = (StorageTier.DEVICE, StorageTier.HOST)  # the tiers kvtier's engine keeps prefix-closed


class PartialRecovery(fw.TwoEngines):
    @initialize(buffer=st.sampled_from([1, 3]))
    def setup(self, buffer: int) -> None:
        self.clock = [0.0]
        self.engines = [fw.Engine("w0", self.clock, buffer), fw.Engine("w1", self.clock, buffer)]
        self.streams = [StreamId(WorkerId(e.name)) for e in self.engines]
        self.index = TieredIndex(fw.PS)
        for s in self.streams:
            self.index.add_worker(s)
            self.index.set_prefix_closed(s, CLOSED)
        # The model of what the index can regain: per worker, each engine hash's parent (the engine's truth), the
        # blocks the index held at its losses (remembered since the last clear that was not a loss), and per closed
        # tier the blocks a store since proved held there and the engine has not removed from it since.
        self.parents: list[dict[int, int | None]] = [{}, {}]
        self.dropped: list[set[int]] = [set(), set()]
        self.proven: list[dict[StorageTier, set[int]]] = [{t: set() for t in CLOSED} for _ in range(2)]
        self.consumer = IndexConsumer(self.index)
        self.trackers = [self._tracker(s) for s in self.streams]
        self.wire: list[deque[tuple[int, bytes]]] = [deque(), deque()]
        self.published: list[dict[int, EventBatch]] = [{}, {}]  # seq -> batch, as the engine sent it
        self.boundary: list[int | None] = [0, 0]  # first seq applied after the last loss for good
        self.lost: list[bool] = [False, False]  # a loss for good happened; boundary pending
        self.ever_partial = [False, False]
        self.cut_next_answer = [None, None]
        self.fresh = 0  # tokens of new pages requested under held nodes
        self.snapshots = tempfile.TemporaryDirectory(prefix="kvtier-partial-recovery-")

    def _tracker(self, stream: StreamId) -> StreamTracker:
        t = StreamTracker(stream, can_replay=True, can_dump=False, timeout_s=1.0, probe_s=1.0)
        t.start(self.clock[0])
        return t

    def _consume(self, w: int, out: list[Delivery]) -> None:
        other = self.streams[1 - w]
        before = self.index.worker_hashes(other)
        self._serve(w, out)
        while out:
            d = out.pop(0)
            if isinstance(d, ResyncNeeded):
                self.lost[w] = self.ever_partial[w] = True
                self.dropped[w].update(*self.index.worker_hashes(self.streams[w]).values())
                for t in CLOSED:
                    self.proven[w][t].clear()  # (dropped with the rest: remembered, no longer reported)
            elif isinstance(d, ResyncStarted | PublisherRestarted):
                # The consumer clears the worker, partial no longer: it is rebuilt from seq 0 (also a stream given up
                # with nothing at hand whose publisher's batches came after: StreamTracker._fresh_start).
                self._started_afresh(w)
            elif isinstance(d, Received) and self.lost[w]:
                self.lost[w] = False
                self.boundary[w] = d.seq
            if isinstance(d, Received) and self.ever_partial[w] and not self.lost[w]:
                self._prove(w, d.batch)
            self.consumer.feed([d])
            self._serve(w, out)
        assert self.index.worker_hashes(other) == before, f"handling {self.streams[w]} changed {other}"

    def _forget(self, w: int) -> None:
        """The index cleared worker ``w`` for a full rebuild: it remembers nothing of what it held."""
        self.dropped[w].clear()
        for t in CLOSED:
            self.proven[w][t].clear()

    def _prove(self, w: int, batch: EventBatch) -> None:
        """What a batch applied after a loss proves held, event by event (the model of kvtier.indexer.index.relearn): a
        store on a closed tier under a parent whose chain runs through dropped blocks up to the root, or up to a
        block proven there, proves that chain and its own blocks there; a removal takes blocks off that tier."""
        for ev in batch.events:
            if isinstance(ev, BlockRemoved) and ev.tier in CLOSED:
                self.proven[w][ev.tier].difference_update(ev.block_hashes)
            if not isinstance(ev, BlockStored) or ev.tier not in CLOSED or ev.parent_block_hash is None:
                continue
            proven, chain = self.proven[w][ev.tier], []
            up: int | None = ev.parent_block_hash
            while up is not None and up not in proven and up in self.dropped[w] and up in self.parents[w]:
                chain.append(up)
                up = self.parents[w][up]
            if up is None or up in proven:
                proven.update(chain)
                proven.update(ev.block_hashes)

    def _serve(self, w: int, out: list[Delivery]) -> None:
        t = self.trackers[w]
        while t.outbox:
            for seq_frame, payload in self._answer(w, t.outbox.pop(0)):
                out.extend(t.on_reply(seq_frame, payload, self.clock[0]))

    def _publish(self, w: int) -> None:
        msg = self.engines[w].flush()
        if msg is not None:
            self.published[w][msg[0]] = batch = decode_payload(msg[1])
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    for eh, up in zip(ev.block_hashes, [ev.parent_block_hash, *ev.block_hashes[:-1]], strict=True):
                        self.parents[w][eh] = up
            self.wire[w].append(msg)

    @precondition(lambda self: any(self.wire))
    @rule(w=st.integers(0, 1), n=st.integers(1, 6))
    def lose(self, w: int, n: int) -> None:
        """Batches vanish on the wire; a run longer than the replay buffer is lost for good."""
        for _ in range(min(n, len(self.wire[w]))):
            self.wire[w].popleft()

    @rule()
    def router_restarts_from_its_snapshot(self) -> None:
        """The router restarts from its snapshot file (as in test_faulty_wire): a partial worker stays partial, and
        what it held outside its blocks (orphans waiting for a parent, the keys of blocks dropped at the loss) must
        come back, or completeness fails for stores grafted or extended after the restart. A stream saved
        mid-recovery starts afresh: from seq 0, exact again if the buffer still reaches back that far."""
        self._restart_router(can_dump=False)

    def _started_afresh(self, w: int) -> None:
        self.lost[w] = self.ever_partial[w] = False
        self.boundary[w] = 0
        self._forget(w)

    @precondition(lambda self: any(self.ever_partial))
    @rule(w=st.integers(0, 1))
    def extend_every_held_chain(self, w: int) -> None:
        """A request with a new page under each node the engine holds (on device, then on host): each store (the new
        page on device, then its backup on host; a load-back first for a node on host alone) proves the node's chain
        held. Then :meth:`quiet_then_check` requires every held block the index remembers or saw stored, under
        each such store, on its tier: the index equals the engine's residency there, but for blocks whose stores it
        never saw and those the engine had no room to extend (its device holds 8 pages)."""
        cache = self.engines[w].cache
        for on_device in (True, False):
            for node in [n for n in cache.tree.nodes() if n.pages and (n.device if on_device else n.host) is not None]:
                if (node.device if on_device else node.host) is None:
                    continue  # gone since (a request before this one evicted it)
                path, n = [], node
                while n is not None and n.pages:
                    path[:0] = np.frombuffer(n.tokens, "<u4").tolist()
                    n = n.parent
                self.fresh += 1
                adm = cache.admit("x", path + [10_000 + self.fresh] * fw.PS)
                if cache.begin_prefill(adm) is not None:
                    cache.finish_prefill(adm)
                cache.release(adm)
                for _ in range(3):  # its copies land, each batch delivered before a probe could race it
                    self._publish(w)
                    self.deliver(w, 1000)
                    self.clock[0] += 10.0
                    cache.poll()
        self.quiet_then_check()

    @invariant()
    def structure(self) -> None:
        self.index._check()
        for t in self.trackers:
            t._check()

    @rule()
    def quiet_then_check(self) -> None:
        self.settle(ticks=4)
        checked = 0
        for w, (e, s) in enumerate(zip(self.engines, self.streams, strict=True)):
            seen, truth = self.index.worker_hashes(s), e.cache.residency()
            assert self.index.is_partial(s) == self.ever_partial[w], s
            if not self.ever_partial[w]:
                assert seen == truth, (s, {t: seen[t] ^ truth[t] for t in StorageTier})
                continue
            closed, stored = self._closed_after_loss(w)
            for tier in StorageTier:
                assert seen[tier] <= truth[tier], (s, tier, "reported but not held", seen[tier] - truth[tier])
                must = truth[tier] & closed & stored[tier]
                if tier in CLOSED:
                    must |= truth[tier] & self.proven[w][tier]
                    REGAINED.append(len(truth[tier] & self.proven[w][tier] - (closed & stored[tier])))
                assert must <= seen[tier], (s, tier, "held, published after the loss, not indexed",
                                            must - seen[tier])
                checked += len(must)
        CHECKS.append((sum(self.ever_partial), checked))

    def _closed_after_loss(self, w: int) -> tuple[set[object], dict[StorageTier, set[object]]]:
        """Engine hashes whose chain of ancestors was stored (on any tier) after the last loss, and
        per tier the hashes stored there after it: none while nothing was received since the last loss (a
        resumed stream's check of its last batch can find one with no batch after it)."""
        if self.lost[w]:
            return set(), {t: set() for t in StorageTier}
        boundary = self.boundary[w]
        assert boundary is not None
        stores = [ev for seq, b in self.published[w].items() if seq >= boundary
                  for ev in b.events if isinstance(ev, BlockStored)]
        stored: dict[StorageTier, set[object]] = {t: set() for t in StorageTier}
        for ev in stores:
            stored[ev.tier].update(ev.block_hashes)
        closed: set[object] = set()
        grew = True
        while grew:
            grew = False
            for ev in stores:
                if (ev.parent_block_hash is None or ev.parent_block_hash in closed) and not (
                        set(ev.block_hashes) <= closed):
                    closed.update(ev.block_hashes)
                    grew = True
        return closed, stored


PartialRecovery.TestCase.settings = settings(max_examples=1000 if SLOW else 300,
                                             stateful_step_count=80 if SLOW else 50, deadline=None)
TestPartialRecovery = PartialRecovery.TestCase


def test_the_machine_reached_partial_workers() -> None:
    """The property above is only worth something if losses for good actually happened."""
    if not CHECKS:
        pytest.skip("run together with TestPartialRecovery")
    assert any(partial for partial, _ in CHECKS), "no quiet check ever saw a partial worker"
    assert sum(n for _, n in CHECKS) > 0, "no block was ever checked for completeness"
    assert sum(REGAINED) > 0, "no quiet check ever required a block that only a store's proof could index"
