"""The token ids, router keys and page digests of requests about to arrive, made on a helper thread ahead of
the clock.

A request's token ids (:class:`kvtier.sim.trace.TokenBank`), its router keys
(:func:`kvtier.indexer.index.keys.block_keys`) and the engine's SHA-256 digests of its pages
(:func:`kvtier.engine.hashing.chain`) depend on nothing but the request, so they can be made before it arrives.
On the full Mooncake trace they are about 0.7 s of compiled work (148M token ids, 2.3M keys, the digests of
the 1.7M pages the engines cache) that the simulator's main thread would otherwise do between its events.
:class:`Lookahead` reads the trace's arrivals a batch ahead and has :func:`kvtier.kernels.aheadkernel.prepare` make
each batch on a helper thread while the main thread simulates; the main thread only cuts each request's bytes,
keys and digests out of its batch, and the engine takes a new node's digests from its request's
(:meth:`kvtier.engine.radix.RadixTree.add_child`, which checks the first against the parent's chain). They are
the same bytes, keys and digests either way (``tests/test_lookahead.py``), so no result changes.

Only requests released at their own arrival time come through here; a closed-loop session's later turns
(released when their predecessor finishes) are made when they arrive, as is everything where the compiled
kernels do not run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.keys import SEED, BlockKey, KeyList, block_keys
from kvtier.kernels import jit
from kvtier.sim.trace import HASH_BLOCK, Request, TokenBank
from kvtier.util.helperthread import HelperThread
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens

#: Requests per batch, one helper call each. After each call the helper waits up to the interpreter's switch
#: interval for the GIL, so a batch must take the main thread much longer than that to simulate.
BATCH = 128
#: Prompt tokens per batch, at most (or one request, if it is longer): what is read ahead, about 5 bytes a token
#: once made, stays within two batches and a request whatever the trace's prompts are (128 requests of Mooncake's
#: conversation trace hold about 1.5M tokens).
BATCH_TOKENS = 1 << 22

# aheadkernel.prepare's result: tokens, keys, first key, digests, first page
_Made = tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.uint8],
              npt.NDArray[np.int64]]
_KERNELS = jit.LazyKernels("kvtier.kernels.aheadkernel", lambda k: k.prepare(
    np.zeros(1, np.uint64), np.array([0, 1], np.int64), np.full(1, 128, np.int64), *TokenBank().kernel_args(),
    64 * TOKEN_BYTES, np.uint64(SEED), 64 * TOKEN_BYTES, k.SHA))
_HELPER = HelperThread("kvtier-lookahead")  # one thread, shared by the runs of this process


def lookahead_backend() -> str:
    """``"numba"`` when batches are made ahead on the helper thread, else ``"python (why)"`` (each request is
    then made when it arrives). Loads the kernel now. O(1) after the first call."""
    _KERNELS.get()
    return str(_KERNELS.backend)


@dataclass(slots=True)
class _Batch:
    """Requests whose token ids, keys and page digests one helper call makes."""

    made: Future[_Made]  # aheadkernel.prepare's result, once the helper is done
    first_block: npt.NDArray[np.int64]  # request i's hash ids are the batch's first_block[i]:first_block[i + 1]


class Lookahead:
    """``arrivals`` (``(rank, request)`` in release order, as :meth:`kvtier.sim.source.TraceSource.arrivals`
    yields them) read ahead, with each request's token ids, router keys (if ``keys``) and the digests of its full
    pages of ``page_size`` tokens made on a helper thread.

    Invariant: every request read from ``arrivals`` and not yet taken is in ``self._due``, with its batch and
    its place in it; requests read but not yet handed out are in ``self._ahead``, which is kept above one
    batch until ``arrivals`` ends, so that the helper works on the next batch while this one is simulated.
    """

    def __init__(self, arrivals: Iterator[tuple[int, Request]], bank: TokenBank, page_size: int, keys: bool) -> None:
        self._arrivals = arrivals  # read on the calling thread only
        self._bank = bank  # makes the requests that do not come through a batch
        self._page_size = page_size  # tokens per router key and per engine page
        self._keys = keys  # whether the run needs router keys
        self._ahead: deque[tuple[int, Request]] = deque()  # read, not yet handed out
        self._ahead_tokens = 0  # their prompt tokens
        self._due: dict[int, tuple[_Batch, int]] = {}  # id(request) -> its batch and index, until taken
        self._ended = False  # arrivals exhausted
        # A TokenBank subclass may make other tokens: only the bank itself is made ahead.
        self._k: Any = _KERNELS.get() if type(bank) is TokenBank else None  # the kernel module

    def __iter__(self) -> Iterator[tuple[int, Request]]:
        return self

    def __next__(self) -> tuple[int, Request]:
        """The next ``(rank, request)`` released at its arrival time. O(1), and O(BATCH) to read a batch."""
        if self._k is None:
            return next(self._arrivals)
        while len(self._ahead) <= BATCH and self._ahead_tokens <= BATCH_TOKENS and not self._ended:
            self._read()
        if not self._ahead:
            raise StopIteration
        pair = self._ahead.popleft()
        self._ahead_tokens -= pair[1].input_length
        return pair

    def _read(self) -> None:
        """Reads the next batch from the arrivals (:data:`BATCH` requests, fewer if they reach
        :data:`BATCH_TOKENS`) and hands it to the helper. O(BATCH)."""
        pairs: list[tuple[int, Request]] = []
        tokens = 0
        while len(pairs) < BATCH and tokens < BATCH_TOKENS:
            pair = next(self._arrivals, None)
            if pair is None:
                self._ended = True
                break
            pairs.append(pair)
            tokens += pair[1].input_length
        if not pairs:
            return
        self._ahead_tokens += tokens
        reqs = [r for _, r in pairs]
        first_block = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(np.fromiter((len(r.hash_ids) for r in reqs), np.int64, len(reqs)), out=first_block[1:])
        batch = _Batch(_HELPER.submit(self._make, reqs, first_block), first_block)
        for i, r in enumerate(reqs):
            self._due[id(r)] = (batch, i)
        self._ahead.extend(pairs)

    def _make(self, reqs: list[Request], first_block: npt.NDArray[np.int64]) -> _Made:
        """On the helper thread: the batch's tokens, keys and page digests."""
        ids = np.fromiter(chain.from_iterable(r.hash_ids for r in reqs), np.uint64, int(first_block[-1]))
        lengths = np.fromiter((r.input_length for r in reqs), np.int64, len(reqs))
        step = self._page_size * TOKEN_BYTES
        made: _Made = self._k.prepare(ids, first_block, lengths, *self._bank.kernel_args(),
                                      step if self._keys else 0, np.uint64(SEED), step, self._k.SHA)
        return made

    def take(self, req: Request) -> tuple[PackedTokens, list[BlockKey], bytes]:
        """``req``'s token ids (packed), its router keys if the run needs them (else ``[]``) and its full pages'
        digests joined (empty if not made ahead: the engine makes them): cut from its batch when it was read ahead
        (waiting for the helper if it is not done), else made now. Each request read ahead is taken once.
        O(input_length)."""
        due = self._due.pop(id(req), None)
        if due is None:
            tokens = self._bank.packed(req)
            return tokens, block_keys(tokens, self._page_size) if self._keys else [], b""
        batch, i = due
        made_tokens, made_keys, first_key, digests, first_page = batch.made.result()  # (raises what it raised)
        start = int(batch.first_block[i]) * HASH_BLOCK
        tokens = made_tokens[start:start + req.input_length].tobytes()
        a, b = int(first_key[i]), int(first_key[i + 1])
        pages = digests[first_page[i]:first_page[i + 1]].tobytes() if first_page[-1] >= 0 else b""
        return tokens, KeyList(made_keys[a:b]) if b > a else [], pages


__all__ = ["BATCH", "Lookahead", "lookahead_backend"]
