"""What one stream has delivered and what it holds back: the state that its live path
(:class:`kvtier.wire.transport.stream.StreamTracker`) and its recovery
(:class:`kvtier.wire.transport.recovery.StreamRecovery`) share.

Both move ``expected`` forward; neither calls the other through it. The recovery hands back the batches to drain
through the live path when it ends, so the live path stays the only place that decides, batch by batch, whether to
deliver, drop or hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.codec import DecodeError, decode_payload
from kvtier.wire.notices import Delivery, MalformedFrame, PublisherRestarted, Received, StreamId, StreamStats
from kvtier.wire.transport.seqhistory import SeqHistory

log = logging.getLogger("kvtier.wire.transport.stream")  # (one logger for the stream's messages, whichever part logs)

__all__ = ["Held", "StreamState"]

#: Batches kept back, as (seq, payload): live ones that came during a recovery, or a replay answer's past a loss.
Held = list[tuple[int, bytes]]


@dataclass(slots=True)
class StreamState:
    """The delivered side of one stream.

    Invariant: every seq below ``expected`` was delivered, skipped as given up for lost, or covered by a state
    dump; ``held`` is empty whenever no recovery is under way
    (:meth:`kvtier.wire.transport.recovery.StreamRecovery._check`).
    """

    stream: StreamId  # identity of the stream
    stats: StreamStats = field(default_factory=StreamStats)  # counters
    expected: int | None = None  # next seq to deliver; None before the first message
    held: Held = field(default_factory=list)  # live messages held back during a recovery
    history: SeqHistory = field(default_factory=SeqHistory)  # digests of recent seqs, ranges given up
    # Live batches past ``expected`` that the publisher's replay answers did not hold: neither delivered nor given up
    # until the live batches after them tell whether they are the publisher's (``StreamTracker._settle_doubtful``)
    doubtful: Held = field(default_factory=list)
    # The live socket reconnected, or the stream resumed from a snapshot, and the check (or recovery) that follows is
    # not over, the batches held through it not yet drained: a batch below ``expected`` that is no duplicate or
    # straggler is a new process's, not a corrupt seq
    reconnected: bool = False
    # The last recovery gave the stream up for lost with nothing at hand to go on from (``expected`` None): the next
    # live batch starts the state anew from the publisher's seq 0 (``StreamTracker._fresh_start``)
    lost_all: bool = False

    def deliver(self, seq: int, payload: bytes, source: Literal["live", "replay"], out: list[Delivery]) -> bool:
        """Batch ``seq``, the one expected, handed on (:meth:`hand_on`); its seq is used up even if it fails to
        decode (the publisher will not send it again): False then, a loss for the caller to report. O(payload)."""
        self.expected = seq + 1
        self.history.delivered(seq, payload)
        return self.hand_on(seq, payload, source, out, f"seq {seq}")

    def hand_on(self, seq: int, payload: bytes, source: Literal["live", "replay", "dump"], out: list[Delivery],
                what: str) -> bool:
        """Batch ``seq`` decoded for the consumer (True), or, if it fails to decode, reported as malformed under
        ``what`` (False). O(payload)."""
        try:
            batch = decode_payload(payload, packed_tokens=True)
        except DecodeError as exc:
            self.malformed(f"{what}: {exc}", out)
            return False
        self.stats.delivered += 1
        out.append(Received(self.stream, seq, batch, source))
        return True

    def malformed(self, reason: str, out: list[Delivery]) -> None:
        """A frame or payload that failed to parse: counted, logged sparingly, reported. O(1)."""
        self.stats.malformed += 1
        if worth_logging(self.stats.malformed):
            log.warning("stream %s: malformed message: %s%s", self.stream, reason, suffix(self.stats.malformed))
        out.append(MalformedFrame(self.stream, reason))

    def bogus(self, seq: int, reason: str, out: list[Delivery]) -> None:
        """A live batch that is not the publisher's batch ``seq`` (it repeats one delivered already, another batch
        holds its seq, or the publisher's sequence went on without it): a corrupt seq frame, dropped, counted in
        ``bogus_seqs`` and as malformed. O(1)."""
        self.stats.bogus_seqs += 1
        self.malformed(f"seq {seq}: {reason}: a corrupt seq, dropped", out)

    def passed(self, seq: int, payload: bytes) -> bool:
        """Batch ``seq``, below the seq expected, is accounted for: the very batch delivered there (counted as a
        duplicate), or a straggler of a loss or of a dump (counted as late; applying it after later batches could
        resurrect removed blocks). False: it is no batch this stream delivered there. O(1) and hashing it."""
        if self.history.holds(seq, payload):
            self.stats.duplicates += 1
            return True
        if self.history.gave_up(seq) or self.history.covered(seq):
            self.stats.late += 1
            return True
        return False

    def merged(self, batches: Held, reason: str, out: list[Delivery]) -> dict[int, bytes]:
        """``batches`` by seq; at a seq held twice with other content, the later one wins and the earlier goes as a
        corrupt seq (``reason``). O(b)."""
        by_seq: dict[int, bytes] = {}
        for seq, payload in batches:
            if by_seq.setdefault(seq, payload) != payload:
                self.bogus(seq, reason, out)
                by_seq[seq] = payload
        return by_seq

    def settle_passed_doubtful(self, out: list[Delivery]) -> None:
        """Doubtful batches that ``expected`` moved past (a replay or dump delivered their seqs) are settled as the
        live path settles a seq already passed (:meth:`passed`), except that one accounted for by nothing is a
        corrupt seq (not a new process: the publisher's replay did not hold it). O(d)."""
        if self.expected is None:
            return
        kept: Held = []
        for seq, payload in self.doubtful:
            if seq >= self.expected:
                kept.append((seq, payload))
            elif not self.passed(seq, payload):
                self.bogus(seq, f"another batch was delivered as seq {seq}", out)
        self.doubtful = kept

    def new_publisher(self, seq: int, expected: int | None, out: list[Delivery]) -> None:
        """The publisher restarted (``seq``: its first batch seen, -1 if none): reported, what was delivered
        forgotten, ``expected`` set anew. O(history)."""
        self.stats.restarts += 1
        out.append(PublisherRestarted(self.stream, seq))
        self.history.forget()
        self.doubtful = []  # (the old process's, if anyone's)
        self.expected = expected
        self.lost_all = False  # (reported already)

    def take_held(self) -> Held:
        """The held batches in seq order, none left held. O(h log h)."""
        held = sorted(self.held)
        self.held = []
        return held
