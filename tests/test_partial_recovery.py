"""Recovery without dumps: after a loss that replay cannot reach, the worker converges anyway.

SGLang and vLLM engines answer replay requests from a bounded buffer and cannot dump their state.
When batches older than the buffer are lost, the index drops the worker's state once (removals
may be among the lost batches), marks it partial, and keeps applying live events; stores that
extend prefixes from before the loss are held as orphans and grafted if their ancestors are
announced again. Invariants at every quiet point (everything delivered, probes settled):

* soundness: the index never reports a block on a tier where the engine does not hold it;
* completeness: every block the engine holds whose chain of stores (its own and every ancestor's,
  on any tier) was published after the last loss is indexed on exactly its tiers;
* a worker that never lost anything for good is indexed exactly, and is not partial;
* recovering one worker never touches the other.
"""

from __future__ import annotations

import tempfile
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import tests.test_faulty_wire as fw
from kvtier.indexer.consumer import IndexConsumer
from kvtier.indexer.index import TieredIndex
from kvtier.wire import BlockStored, EventBatch, StorageTier, WorkerId, decode_payload
from kvtier.wire.notices import Delivery, Received, ResyncNeeded, StreamId
from kvtier.wire.stream import StreamTracker

CHECKS: list[tuple[int, int]] = []  # (partial workers, blocks checked) per quiet check


class PartialRecovery(fw.TwoEngines):
    @initialize(buffer=st.sampled_from([1, 3]))
    def setup(self, buffer: int) -> None:
        self.clock = [0.0]
        self.engines = [fw.Engine("w0", self.clock, buffer), fw.Engine("w1", self.clock, buffer)]
        self.streams = [StreamId(WorkerId(e.name)) for e in self.engines]
        self.index = TieredIndex(fw.PS)
        for s in self.streams:
            self.index.add_worker(s)
        self.consumer = IndexConsumer(self.index)
        self.trackers = [self._tracker(s) for s in self.streams]
        self.wire: list[deque[tuple[int, bytes]]] = [deque(), deque()]
        self.published: list[dict[int, EventBatch]] = [{}, {}]  # seq -> batch, as the engine sent it
        self.boundary: list[int | None] = [0, 0]  # first seq applied after the last loss for good
        self.lost: list[bool] = [False, False]  # a loss for good happened; boundary pending
        self.ever_partial = [False, False]
        self.cut_next_answer = [None, None]
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
            elif isinstance(d, Received) and self.lost[w]:
                self.lost[w] = False
                self.boundary[w] = d.seq
            self.consumer.feed([d])
            self._serve(w, out)
        assert self.index.worker_hashes(other) == before, f"handling {self.streams[w]} changed {other}"

    def _serve(self, w: int, out: list[Delivery]) -> None:
        t = self.trackers[w]
        while t.outbox:
            for seq_frame, payload in self._answer(w, t.outbox.pop(0)):
                out.extend(t.on_reply(seq_frame, payload, self.clock[0]))

    def _publish(self, w: int) -> None:
        msg = self.engines[w].flush()
        if msg is not None:
            self.published[w][msg[0]] = decode_payload(msg[1])
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


PartialRecovery.TestCase.settings = settings(max_examples=1000 if fw.SLOW else 300,
                                             stateful_step_count=80 if fw.SLOW else 50, deadline=None)
TestPartialRecovery = PartialRecovery.TestCase


def test_the_machine_reached_partial_workers() -> None:
    """The property above is only worth something if losses for good actually happened."""
    if not CHECKS:
        pytest.skip("run together with TestPartialRecovery")
    assert any(partial for partial, _ in CHECKS), "no quiet check ever saw a partial worker"
    assert sum(n for _, n in CHECKS) > 0, "no block was ever checked for completeness"
