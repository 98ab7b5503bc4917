"""Seeded synthetic workloads, written as Mooncake-style requests.

Each *session* (``Request.session``, with each turn's ``think_s``) is an append-only token
stream (system prompt, then user turns and model outputs); a request's prompt is a prefix of
its session's stream, so the hash ids of 512-token blocks are stable across turns and a
partial last block is a prefix of the same block in the next turn. System prompts (or tool definitions)
are shared by many sessions.

* ``chat``: multi-turn conversations, a few shared system prompts, human think times.
* ``agentic``: tool loops: long shared tool definitions, many short steps, each
  appending a tool result; seconds between steps.
* ``sysprompt``: single-turn requests, each one of a few long system prompts plus
  a unique question.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvtier.sim.trace import HASH_BLOCK, Request


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """Shape of a synthetic workload (token counts are means of exponential draws)."""

    kind: str  # "chat", "agentic" or "sysprompt"
    requests: int = 1000  # total requests
    rate: float = 2.0  # new sessions per second
    system_prompts: int = 8  # distinct shared prefixes
    system_tokens: int = 2048  # tokens of each shared prefix
    turns: int = 6  # mean turns (steps) per session
    user_tokens: int = 400  # mean new prompt tokens per turn (user message or tool result)
    output_tokens: int = 300  # mean generated tokens per turn
    think_s: float = 20.0  # mean seconds between a turn's end and the next turn


PRESETS: dict[str, WorkloadSpec] = {
    "chat": WorkloadSpec("chat"),
    "agentic": WorkloadSpec("agentic", rate=1.0, system_prompts=4, system_tokens=6144, turns=12,
                            user_tokens=900, output_tokens=120, think_s=2.0),
    "sysprompt": WorkloadSpec("sysprompt", rate=4.0, system_prompts=6, system_tokens=3072, turns=1,
                              user_tokens=300, output_tokens=200, think_s=0.0),
}


def generate(spec: WorkloadSpec, seed: int = 0) -> list[Request]:
    """Requests of ``spec``, sorted by arrival. Deterministic for ``seed``. O(requests) memory; see
    :func:`iter_generate` for the same requests streamed."""
    return list(iter_generate(spec, seed))


def iter_generate(spec: WorkloadSpec, seed: int = 0) -> Iterator[Request]:
    """The requests of :func:`generate`, yielded in arrival order as they are made (ties in the order
    they were drawn), so a million-request trace is written without being held.

    Memory is bounded by the turns of sessions still open: sessions start in time order and a turn
    never arrives before its session starts, so a turn is final once the next session's start is drawn
    past it. O(log open turns) per request.
    """
    if spec.kind not in PRESETS:
        raise ValueError(f"unknown workload kind {spec.kind!r}; expected one of {sorted(PRESETS)}")
    rng = np.random.default_rng(seed)
    sys_blocks = math.ceil(spec.system_tokens / HASH_BLOCK)
    next_id = spec.system_prompts * sys_blocks
    # (arrival, draw order, request): draw order breaks ties as a stable sort by arrival would
    pending: list[tuple[float, int, Request]] = []
    drawn = emitted = 0
    t_session = 0.0
    sessions = 0

    def ready(before: float) -> Iterator[Request]:
        nonlocal emitted
        while pending and pending[0][0] <= before:
            req = heapq.heappop(pending)[2]
            req.request_id = f"r{emitted}"
            emitted += 1
            yield req

    while drawn < spec.requests:
        t_session += float(rng.exponential(1.0 / spec.rate))
        yield from ready(t_session)
        prompt = int(rng.integers(spec.system_prompts))
        ids = [prompt * sys_blocks + i for i in range(sys_blocks)]
        length = spec.system_tokens
        t = t_session
        turns = 1 if spec.kind == "sysprompt" else 1 + int(rng.poisson(max(spec.turns - 1, 0)))
        session = f"s{sessions}"
        sessions += 1
        think: float | None = None  # the first turn has no predecessor
        for _ in range(turns):
            length += 1 + int(rng.exponential(spec.user_tokens))
            blocks = math.ceil(length / HASH_BLOCK)
            # Blocks past the shared prefix belong to this session.
            while len(ids) < blocks:
                ids.append(next_id)
                next_id += 1
            out_len = 1 + int(rng.exponential(spec.output_tokens))
            heapq.heappush(pending, (t, drawn, Request("", t, length, out_len, list(ids[:blocks]), session, think)))
            drawn += 1
            length += out_len
            # Open loop releases the next turn at t; closed loop, `think` after this turn's last token.
            think = float(rng.exponential(spec.think_s))
            t += think + out_len * 0.02  # think + rough decode time
            if drawn >= spec.requests:
                break
    yield from ready(math.inf)
