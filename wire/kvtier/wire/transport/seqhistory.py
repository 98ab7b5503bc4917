"""What one stream delivered lately and what it gave up for lost: the memory that tells a duplicate, a straggler
and a restarted publisher apart (:class:`kvtier.wire.transport.stream.StreamTracker`).

A PUB socket never sends one seq twice with different content, so a seq at or below the last delivered one is a
duplicate when its payload's digest matches, a straggler when it falls in a range given up for lost (a replay
answer overtook it) or in the range the last state dumps stood for (their end marker overtook it, over the same
connection), and otherwise the first batch of a new publisher process or a corrupt seq frame. The converse is
assumed: a new process does not send the batch the old one sent at a seq byte for byte (each batch carries its
publisher's wall-clock timestamp), so a check that compares what the publisher holds at the last seq delivered tells
the two apart, and a batch that repeats one delivered at another seq is a corrupt seq frame.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

#: A stable digest of a payload (unlike ``hash``, the same in every process: positions are persisted).
digest = xxhash.xxh3_64_intdigest

__all__ = ["SeqHistory", "digest"]


@dataclass(slots=True)
class SeqHistory:
    """The digests of the last ``window`` delivered seqs, and the last ``ranges`` seq ranges given up for lost.

    Invariants (:meth:`_check`): at most ``window`` digests, counted by digest in ``_counts``, and at most ``ranges``
    ranges; each range is non-empty.
    """

    window: int = 4096  # how many recent (seq, digest) pairs identify duplicates
    ranges: int = 64  # how many given-up ranges are remembered (to tell stragglers from restarts)
    _recent: OrderedDict[int, int] = field(default_factory=OrderedDict)  # seq -> payload digest, oldest first
    _counts: dict[int, int] = field(default_factory=dict)  # payload digest -> how many seqs in _recent have it
    _skipped: list[tuple[int, int]] = field(default_factory=list)  # seq ranges [a, b) given up for lost, oldest first
    _covered: tuple[int, int] | None = None  # seqs [a, b) the last dumps (back to back) stood for, until a reconnect

    def delivered(self, seq: int, payload: bytes) -> None:
        """``payload`` was delivered as ``seq``; the oldest digest goes past ``window``. O(payload)."""
        self._record(seq, digest(payload))

    def _record(self, seq: int, known: int) -> None:
        """``seq`` was delivered with a payload of digest ``known``. O(1)."""
        old = self._recent.get(seq)
        if old is not None:
            self._uncount(old)
        self._recent[seq] = known
        self._counts[known] = self._counts.get(known, 0) + 1
        if len(self._recent) > self.window:
            self._uncount(self._recent.popitem(last=False)[1])

    def _uncount(self, known: int) -> None:
        left = self._counts.pop(known) - 1
        if left:
            self._counts[known] = left

    def holds(self, seq: int, payload: bytes) -> bool:
        """Whether ``seq`` was delivered with this very payload (a duplicate, or the same publisher). O(len)."""
        return self._recent.get(seq) == digest(payload)

    def foreign(self, seq: int, payload: bytes) -> bool:
        """Whether ``payload`` at ``seq``, a seq already passed, can only be a new publisher process's: it was not
        delivered with this payload (a duplicate), nor does it fall in a range given up for lost or the last dumps
        stood for (a straggler). O(ranges)."""
        return not (self.holds(seq, payload) or self.gave_up(seq) or self.covered(seq))

    def repeats(self, payload: bytes) -> bool:
        """Whether ``payload`` is, byte for byte, one of the last ``window`` batches delivered (each batch carries
        its publisher's timestamp: a live frame held through a gap's replay that repeats one is most likely a corrupt
        seq frame). O(payload)."""
        return digest(payload) in self._counts

    def digest_at(self, seq: int) -> int | None:
        """The digest of what was delivered as ``seq``, or None if it is not (or no longer) known. O(1)."""
        return self._recent.get(seq)

    def vouch(self, seq: int, known: int) -> None:
        """``known`` is the digest of what a snapshot says was delivered as ``seq``. O(1)."""
        self._record(seq, known)

    def gave_up(self, seq: int) -> bool:
        """Whether ``seq`` lies in a range given up for lost. O(ranges)."""
        return any(a <= seq < b for a, b in self._skipped)

    def give_up(self, first: int, end: int) -> None:
        """Seqs ``first .. end - 1`` are lost for good; the oldest range goes past ``ranges``. O(ranges)."""
        assert first < end, f"given up an empty range [{first}, {end})"
        self._skipped.append((first, end))
        del self._skipped[:-self.ranges]

    def dumped(self, first: int, end: int) -> None:
        """A state dump stood for the stream up to seq ``end - 1``, and for seqs ``first .. end - 1``, none of them
        delivered: each of those that comes after it over the same connection is a straggler (:meth:`covered`), as
        is one the previous dump stood for when nothing was delivered between the two (dumps back to back). The
        digests of seqs delivered before it are kept (a late copy is a duplicate), but from seq ``end - 1`` on (the
        dump carries no batch of its own to compare with, and a publisher that restarted unseen may have dumped
        below what was delivered). O(window)."""
        for seq in [q for q in self._recent if q >= end - 1]:
            self._uncount(self._recent.pop(seq))
        if self._covered is not None and self._covered[1] == first:
            first = self._covered[0]
        self._covered = (first, end) if first < end else None

    def covered(self, seq: int) -> bool:
        """Whether ``seq`` lies in the range the last dumps stood for (and no reconnect came since). O(1)."""
        return self._covered is not None and self._covered[0] <= seq < self._covered[1]

    def uncover(self) -> None:
        """The connection dropped: a batch in the dumps' range may come from a new process now. O(1)."""
        self._covered = None

    def forget_digests(self) -> None:
        """The stream starts over from a resync: seqs delivered before say nothing now. O(window)."""
        self._recent.clear()
        self._counts.clear()
        self._covered = None

    def forget(self) -> None:
        """A new publisher: nothing delivered or given up before is its. O(window)."""
        self._recent.clear()
        self._counts.clear()
        self._skipped.clear()
        self._covered = None

    def _check(self) -> None:
        assert len(self._recent) <= self.window, f"{len(self._recent)} digests kept, window {self.window}"
        counts: dict[int, int] = {}
        for known in self._recent.values():
            counts[known] = counts.get(known, 0) + 1
        assert counts == self._counts, "the digest counts differ from the digests kept"
        assert len(self._skipped) <= self.ranges, f"{len(self._skipped)} ranges kept, at most {self.ranges}"
        assert all(a < b for a, b in self._skipped), f"an empty range given up: {self._skipped}"
        assert self._covered is None or self._covered[0] < self._covered[1], f"an empty dump range: {self._covered}"
