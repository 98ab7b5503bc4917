"""A router restarted from a snapshot older than the publisher's replay buffer: a loss, not a publisher restart.

On resume the tracker checks, by replay from the last seq it applied, that the publisher still holds the same batch
there. A publisher that restarted has its seq gone back: its answer holds other content at that seq, or nothing at or
past it. The same process whose buffer moved on past the snapshot answers from a later seq, and so may a new process
that published that far already: what came before the answer is lost for good (partial, or a dump where the engine
has one), not taken as a restart, so what the index remembers of the worker's blocks stays and later stores regain
what they prove held (kvtier.indexer.index.relearn).
"""

from __future__ import annotations

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import (
    DUMP_REQUEST,
    END_SEQ,
    BlockStored,
    Delivery,
    EventBatch,
    PublisherRestarted,
    Received,
    ResyncNeeded,
    ResyncStarted,
    StorageTier,
    StreamId,
    StreamTracker,
    WorkerId,
    encode_payload,
    pack_seq,
    unpack_seq,
)
from kvtier.wire.transport.seqhistory import digest

S = StreamId(WorkerId("w"), 0)
TOKS = list(range(100, 112))


def payload(i: int) -> bytes:
    """Batch ``i`` of a publisher: a store of block ``i`` (engine hash ``-1 - i``) under block ``i - 1``, each block
    four tokens of TOKS (cycling), so that every batch differs."""
    tokens = [TOKS[(4 * i + j) % len(TOKS)] for j in range(4)]
    ev = BlockStored(block_hashes=[-1 - i], parent_block_hash=None if i == 0 else -i, token_ids=tokens, block_size=4,
                     medium="GPU")
    return encode_payload(EventBatch(ts=float(i), events=[ev], dp_rank=0))


def resumed(dump: bool = False) -> StreamTracker:
    """A tracker resumed from a snapshot taken after seq 4 was applied; its check asks from seq 4."""
    t = StreamTracker(S, can_replay=True, can_dump=dump, timeout_s=1.0)
    t.resume((5, digest(payload(4))), 0.0)
    assert [unpack_seq(q) for q in t.outbox] == [4]
    t.outbox.clear()
    return t


def answer(t: StreamTracker, seqs: list[int], contents: list[int] | None = None) -> list[Delivery]:
    """The publisher's answer: batches ``seqs`` (with the content of ``contents``, the same by default), then the end
    marker."""
    out: list[Delivery] = []
    for seq, c in zip(seqs, contents or seqs, strict=True):
        out += t.on_reply(pack_seq(seq), payload(c), 0.1)
    return out + t.on_reply(END_SEQ, b"", 0.1)


def test_a_buffer_that_moved_on_past_the_snapshot_is_a_loss_not_a_restart() -> None:
    """The same process kept publishing while the router was down, past its buffer: its answer starts at seq 8.
    Seqs 5-7 are lost for good: the stream is marked partial and goes on from 8, with no restart counted (a restart
    would make the consumer drop what it remembers of the worker and replay from 0)."""
    t = resumed()
    out = answer(t, [8, 9, 10])
    assert [type(d) for d in out] == [ResyncNeeded, Received, Received, Received]
    assert "no longer holds" in out[0].reason  # type: ignore[union-attr]
    assert [d.seq for d in out if isinstance(d, Received)] == [8, 9, 10]
    assert t.stats.restarts == 0 and t.outbox == [] and t.expected == 11


def test_a_buffer_that_starts_right_after_the_snapshot_is_still_a_loss() -> None:
    """The batch the snapshot ends with is gone from the buffer, the next one is not. Nothing tells a restart (the
    seq did not go back), but nothing rules one out either (a new process may have published that far already):
    the worker is cleared once and marked partial, and the stream goes on from there, with no restart counted."""
    t = resumed()
    out = answer(t, [5, 6])
    assert [type(d) for d in out] == [ResyncNeeded, Received, Received] and t.stats.restarts == 0
    assert "cannot be ruled out" in out[0].reason  # type: ignore[union-attr]


def test_a_dump_capable_engine_is_dumped_after_a_stale_snapshot_not_replayed_as_restarted() -> None:
    t = resumed(dump=True)
    out = answer(t, [8, 9])
    assert [type(d) for d in out] == [ResyncStarted] and t.outbox == [DUMP_REQUEST] and t.stats.restarts == 0


def test_a_publisher_whose_seq_went_back_is_still_a_restart() -> None:
    """Another content at the seq asked, or nothing at or past it: a new process."""
    t = resumed()
    out = answer(t, [4, 5], [40, 41])
    assert isinstance(out[0], PublisherRestarted) and t.stats.restarts == 1 and [unpack_seq(q) for q in t.outbox] == [0]
    t = resumed()
    out = answer(t, [])
    assert isinstance(out[0], PublisherRestarted) and t.stats.restarts == 1


def test_the_index_keeps_what_it_remembers_of_the_worker_across_a_stale_snapshot() -> None:
    """Fed to the index, the stale snapshot's loss keeps the keys of the blocks it held (it clears them once and
    marks the worker partial), so a device store under one of them regains the whole chain on a prefix-closed
    engine; as a restart the index would have forgotten them, and regained nothing."""
    index = TieredIndex(4)
    index.set_prefix_closed(S, [StorageTier.DEVICE])
    consumer = IndexConsumer(index)
    live = StreamTracker(S, can_replay=True, can_dump=False, timeout_s=1.0)
    consumer.feed(out for i in range(5) for out in live.on_live(i, payload(i), 0.0))
    assert index.find_matches(TOKS * 2).workers[S].device == 5
    position = live.position()
    assert position is not None
    index = TieredIndex.restore(index.snapshot())
    consumer = IndexConsumer(index)
    t = StreamTracker(S, can_replay=True, can_dump=False, timeout_s=1.0)
    t.resume(position, 1.0)
    t.outbox.clear()
    consumer.feed(answer(t, [8]))  # block 8 under block 7, a block the index never saw: held as an orphan
    assert index.is_partial(S) and index.find_matches(TOKS * 2).workers[S].device == 0
    consumer.feed(t.on_live(9, encode_payload(EventBatch(ts=9.0, events=[BlockStored(
        block_hashes=[-100], parent_block_hash=-5, token_ids=[1, 2, 3, 4], block_size=4, medium="GPU")])), 1.2))
    assert index.find_matches(TOKS * 2).workers[S].device == 5  # blocks 0-4 regained under the store of block 100
