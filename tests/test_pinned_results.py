"""Pinned results: a change made for speed changes no result (issue 11).

Fixed small runs (every policy on a generated chat trace with host and L3 tiers; the first Mooncake
requests, whose tokens come from the trace's hash ids; a lossy wire with recovery; closed-loop agent
sessions) are pinned in ``tests/pinned_results.json``: the readable figures (hit rates by tier, TTFT
percentiles, batches published, load imbalance) and a digest of every request's record and routing decision.

A deliberate change of results re-pins in the same commit and says why in its message::

    KVTIER_REPIN=1 python -m pytest tests/test_pinned_results.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.policies import POLICIES
from kvtier.sim.run import RunConfig, RunResult, simulate
from kvtier.sim.trace import Request, load_mooncake

PINS = Path(__file__).with_name("pinned_results.json")
REPIN = os.environ.get("KVTIER_REPIN") == "1"

TIERED = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0, l3="disk", l3_tokens=131_072)
# A hybrid model (gpt-oss-20b: sliding-window layers, window 128) with a small window pool, announcing its
# window KV or not (SGLang): kv_swa tracks, or infers, the window; kv_all over-counts; the oracle reads it.
SWA = dataclasses.replace(TIERED, model="gpt-oss-20b", swa_ratio=0.2)
SWA_BLIND = SWA.replace(swa_events=False)
MOONCAKE = ClusterConfig.of(workers=8, page_size=64, device_tokens=262_144, host_ratio=2.0, max_running=64,
                         prefill_budget=8192)
# Disaggregated (issue 48): the Mooncake cluster as 4 prefill + 4 decode workers over a 50 GB/s KV link (round robin
# and dynamo pick the decode worker at handoff, the others at arrival); the tiered one as 2 + 2 with conditional
# disaggregation, where the KV-aware policies prefill some turns on their decode worker.
MOONCAKE_PD = MOONCAKE.replace(prefill_workers=4, decode_workers=4, kv_gbps=50.0)
TIERED_PD = TIERED.replace(prefill_workers=2, decode_workers=2, local_prefill_tokens=512)


def _chat() -> list[Request]:
    return generate(dataclasses.replace(PRESETS["chat"], requests=200, system_tokens=1024, user_tokens=600), 1)


def _agentic() -> list[Request]:
    return generate(dataclasses.replace(PRESETS["agentic"], requests=150), 2)


def _mooncake(shared: Path) -> list[Request]:
    return load_mooncake(shared / "traces" / "mooncake_conversation_trace.jsonl", limit=300)


#: case name -> (trace, cluster, run); the trace is built lazily (the Mooncake one needs ../shared).
CASES: dict[str, tuple[str, ClusterConfig, RunConfig]] = {
    **{f"chat/{p}": ("chat", TIERED, RunConfig(p)) for p in POLICIES},
    "chat/kv_all/ttft": ("chat", TIERED, RunConfig("kv_all", cost="ttft")),
    "chat/kv_all/loss": ("chat", TIERED, RunConfig("kv_all", event_loss=0.05, event_delay_s=0.002, seed=3)),
    "chat/kv_host/loss-no-dump": ("chat", TIERED, RunConfig("kv_host", event_loss=0.05, loss_burst=4,
                                                            recovery="replay", replay_buffer=8, seed=4)),
    **{f"mooncake/{p}": ("mooncake", MOONCAKE, RunConfig(p)) for p in ("round_robin", "kv_host", "dynamo",
                                                                      "min_ttft")},
    **{f"agentic/{p}": ("agentic", TIERED, RunConfig(p)) for p in ("kv_all", "min_ttft")},
    **{f"chat-swa/{p}": ("chat", SWA, RunConfig(p)) for p in ("kv_all", "kv_swa", "oracle")},
    "chat-swa/kv_swa/no-window-events": ("chat", SWA_BLIND, RunConfig("kv_swa")),
    **{f"mooncake-pd/{p}": ("mooncake", MOONCAKE_PD, RunConfig(p)) for p in ("round_robin", "kv_host", "dynamo",
                                                                            "goodput", "llmd")},
    **{f"chat-pd/{p}": ("chat", TIERED_PD, RunConfig(p)) for p in ("kv_all", "least_loaded", "min_ttft")},
}


def _r(x: float) -> float:
    return round(x, 9)  # sub-nanosecond noise from a reordered float sum is not a result


RECORD_FIELDS = [f.name for f in dataclasses.fields(RequestRecord)]
#: The fields of each request's latency between tokens, popped from the end of a record's row (last first).
FELT_FIELDS = ["max_itl", "second_token"]
#: The fields of disaggregated serving, the last of a record, popped from aggregated runs' rows.
DISAGG_FIELDS = ["decode_worker", "prefill_end", "decode_cached_tokens", "transferred_tokens", "receive_start"]


def fingerprint(res: RunResult) -> dict[str, Any]:
    """The readable figures of a run and a digest of all of it."""
    h, felt = hashlib.sha256(), hashlib.sha256()
    for rec in res.records:
        row = [_r(v) if isinstance(v, float) else v for v in dataclasses.astuple(rec)]
        # What a user feels between tokens is pinned apart, so that the digest of the rest stayed as it was.
        felt.update(json.dumps([row.pop(RECORD_FIELDS.index(f)) for f in FELT_FIELDS]).encode())
        if rec.decode_worker < 0:  # aggregated: the disaggregated fields leave these pins as they were
            for f in reversed(DISAGG_FIELDS):
                row.pop(RECORD_FIELDS.index(f) - len(FELT_FIELDS))
        if rec.usable_blocks < 0:  # not an SWA model: the field added for them leaves these pins as they were
            row.pop(RECORD_FIELDS.index("usable_blocks"))
        h.update(json.dumps(row).encode())
    h.update(json.dumps(res.decisions).encode())
    wire = dataclasses.asdict(res.wire)
    wire.pop("blocks")  # a count of what the events carried, added later: the pins stay as they were
    wire.pop("seconds")  # the event path's wall time: measured, not a result
    h.update(json.dumps(list(wire.values())).encode())
    s = res.summary
    return {"hit_rate": _r(s.hit_rate), "hit_device": _r(s.hit_device), "hit_host": _r(s.hit_host),
            "hit_storage": _r(s.hit_storage), "ttft_ms": [_r(s.ttft_p50 * 1e3), _r(s.ttft_p90 * 1e3),
                                                          _r(s.ttft_p99 * 1e3)],
            "requests": s.requests, "unfinished": s.unfinished, "batches": res.events_published,
            "load_imbalance": _r(s.load_imbalance),
            "digest": h.hexdigest()[:32],
            "tpot_ms": [_r(s.tpot_p50 * 1e3), _r(s.tpot_p90 * 1e3), _r(s.tpot_p99 * 1e3)],
            "e2e_s": [_r(s.e2e_p50), _r(s.e2e_p90), _r(s.e2e_p99)], "felt_digest": felt.hexdigest()[:32]}


@pytest.fixture(scope="module")
def traces(shared_dir: Path) -> dict[str, list[Request]]:
    return {"chat": _chat(), "agentic": _agentic(), "mooncake": _mooncake(shared_dir)}


@pytest.fixture(scope="module")
def pins() -> dict[str, Any]:
    return json.loads(PINS.read_text()) if PINS.exists() else {}


@pytest.mark.parametrize("case", list(CASES))
def test_results_are_pinned(case: str, traces: dict[str, list[Request]], pins: dict[str, Any]) -> None:
    trace, cluster, run = CASES[case]
    got = fingerprint(simulate(traces[trace], cluster, run))
    if REPIN:
        pins[case] = got
        PINS.write_text(json.dumps(dict(sorted(pins.items())), indent=1) + "\n")
        return
    assert case in pins, f"{case} has no pinned result; run with KVTIER_REPIN=1 and commit {PINS.name}"
    want = pins[case]
    assert set(want) == set(got), f"{case}: pinned {sorted(want)}, made {sorted(got)}; re-pin with KVTIER_REPIN=1"
    figures = {k: (want[k], got[k]) for k in want if not k.endswith("digest") and want[k] != got[k]}
    assert not figures, f"{case}: results moved (pinned, now): {figures}"
    assert got["digest"] == want["digest"], (
        f"{case}: the summary figures match but some request's record or routing decision moved")
    assert got["felt_digest"] == want["felt_digest"], f"{case}: some request's inter-token latency moved"


def test_every_pinned_case_is_still_run(pins: dict[str, Any]) -> None:
    assert REPIN or set(pins) == set(CASES), f"stale pins: {sorted(set(pins) - set(CASES))}"
