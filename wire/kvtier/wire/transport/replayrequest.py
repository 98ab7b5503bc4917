"""The replay request a stream has in flight, and what its answer showed so far
(:class:`kvtier.wire.transport.recovery.StreamRecovery`).

An answer that starts past the seq asked for means the publisher's buffer no longer reaches back: the batches
between are lost for good (``lost``; what came after is kept in ``beyond``). One that starts where asked but then
skips a seq lost frames on the way (a ZMQ high-water mark): ``hole``, and the tracker asks again from the first
missing seq.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplayRequest"]


@dataclass(slots=True)
class ReplayRequest:
    """Why the pending replay was asked, and the answer's batches sorted as they come (:meth:`take`).

    Invariants: ``progress <= frames``; ``beyond`` is non-empty when ``lost``. An answer asked again keeps
    ``beyond`` (a publisher that lost those batches sends the same ones again, and if it never answers they are
    still the oldest at hand), unless the connection dropped meanwhile (the publisher may be a new process).
    """

    start: int = 0  # first seq asked
    for_gap: bool = False  # it fills a detected gap (not a catch-up or check)
    probe: bool = False  # an idle probe: no answer means nothing
    resyncing: bool = False  # a resync (its dump fallback is not rate-limited again)
    verify: bool = False  # its first batch checks the last delivered seq's content
    # it was asked after a live batch went past batches set aside as doubtful: an answer that still holds nothing
    # from its start on shows they are the publisher's (its replay keeps nothing), not corrupt seqs
    settle: bool = False
    restarted: bool = False  # the check found a new publisher: replay it from 0 next
    # it checks the publisher for a live batch that came below the seq expected over the same connection: once the
    # check passes (``checked``), such batches are corrupt seqs
    below: bool = False
    checked: bool = False  # the check passed: the publisher still holds the last batch delivered
    hole: bool = False  # the answer skipped a seq after its start (frames dropped)
    lost: bool = False  # the answer started past the seq expected: the buffer no longer holds it
    # The check's answer started past the seq it checks (``lost`` for good, whatever a re-ask answers: the re-ask
    # asks from the seq expected, which a publisher restarted since may well hold anew)
    lost_at_check: bool = False
    frames: int = 0  # batches received in the answer
    progress: int = 0  # batches the answer delivered
    beyond: list[tuple[int, bytes]] = field(default_factory=list)  # answered past a loss for good

    def ask(self, start: int, *, for_gap: bool = False, probe: bool = False, resyncing: bool = False,
            verify: bool = False, settle: bool = False, below: bool = False) -> None:
        """A new request from ``start``, for what the flags say (nothing of an earlier request carries over), with
        no answer yet. O(1)."""
        self.start = start
        self.for_gap, self.probe, self.resyncing, self.verify, self.restarted = for_gap, probe, resyncing, verify, False
        self.settle, self.below, self.checked = settle, below, False
        self.beyond = []
        self.lost_at_check = False
        self.fresh_answer()

    def done(self) -> None:
        """The request is over (answered, abandoned, or given up for a dump): nothing it was for carries over
        into what the stream does next. O(1)."""
        self.for_gap = self.probe = self.resyncing = self.verify = self.restarted = self.lost_at_check = False
        self.settle = self.below = self.checked = False

    @property
    def purposes(self) -> bool:
        """Whether the request is marked as for something (a gap, a probe, a resync, a check, a restart, doubtful
        batches, a batch below the seq expected)."""
        return (self.for_gap or self.probe or self.resyncing or self.verify or self.restarted or self.settle
                or self.below)

    def fresh_answer(self) -> None:
        """The same request asked again: what an earlier answer showed is forgotten, but a loss its check found.
        O(1)."""
        self.hole, self.lost = False, self.lost_at_check
        self.frames = self.progress = 0

    def forget_answer(self) -> None:
        """What the answer showed is forgotten, the batches past a loss and the loss its check found too (the
        answer was used up, or it may be an old process's). O(1)."""
        self.beyond, self.lost_at_check = [], False
        self.fresh_answer()

    def take(self, seq: int, payload: bytes, expected: int) -> bool:
        """Sorts batch ``seq`` of the answer (after the check, if any): True if it is the one ``expected``, to
        deliver. Batches of a publisher found restarted, already delivered or after a hole are dropped; one past
        ``expected`` marks a loss for good if it opens the answer (it and those after go to ``beyond``), else a
        hole. O(1)."""
        first = self.frames == 0
        self.frames += 1
        if self.restarted or seq < expected or self.hole:
            return False
        if self.lost:
            self.beyond.append((seq, payload))
            return False
        if seq > expected:
            if first:
                self.lost = True
                self.beyond.append((seq, payload))
            else:
                self.hole = True
            return False
        self.progress += 1
        return True

    def _check(self) -> None:
        assert self.progress <= self.frames, f"{self.progress} delivered of {self.frames} batches answered"
        assert self.beyond or not self.lost, "a loss for good with no batch kept beyond it"
        assert self.lost or not self.lost_at_check, "a loss its check found, forgotten by the answer"
