"""Hostile request bodies against the indexer service: what one body at the size cap costs before it is answered.

A ``/query`` or ``/route`` body is checked (:func:`kvtier.indexer.service.httplimits.check_json_shape`: nesting and
the count of arrays and objects) and parsed (:func:`kvtier.indexer.service.requestbody.parse_body`) on the HTTP
front end's event loop, so what a body costs there every other connection waits for. Each case is a body of
``max_body_bytes`` (the default cap, 8 MiB) built to be costly to check or to parse, within every other limit:

  prompt           a legitimate one: the most token ids a request may carry (``max_query_tokens``), six digits
                   each as a large vocabulary's are, or as many as fill the body (the yardstick)
  empty arrays     an unknown field holding empty arrays (the parser skips each at many times a byte's cost)
  empty objects    the same with objects
  numbers          an unknown field holding an array of small ints
  bracket string   an unknown field holding one string of brackets (text, not nesting)
  escaped quotes   behind 40 brackets, a string of escaped quotes (each ends a run of backslashes)
  backslashes      behind 40 brackets, a string of backslashes

Target: each case costs at most 5x the legitimate prompt of the same size. No peer's service takes these bodies
to compare. The median of ``--repeat`` runs is printed, with the answer each case gets; each case is run once untimed
first (a process's first parse pays one-time costs).

    python bench/hostile_bodies.py [--mib 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchargs import count

from kvtier.indexer.service.config import ServiceConfig
from kvtier.indexer.service.httplimits import check_json_shape
from kvtier.indexer.service.requestbody import parse_body

RATIO = 5.0


def bodies(size: int, max_tokens: int) -> dict[str, bytes]:
    """Each case's body, ``size`` bytes or just under (the prompt: at most ``max_tokens`` ids)."""
    head, n = b'{"token_ids": [1, 2], "x": ', size - 40
    ids = min(max_tokens, n // 7)
    return {
        "prompt": b'{"token_ids": [' + b",".join(b"%d" % (100_000 + i % 50_000) for i in range(ids)) + b"]}",
        "empty arrays": head + b"[" + b"[]," * (n // 3) + b"[]]}",
        "empty objects": head + b"[" + b"{}," * (n // 3) + b"{}]}",
        "numbers": head + b"[" + b"1," * (n // 2) + b"1]}",
        "bracket string": head + b'"' + b"[" * n + b'"}',
        "escaped quotes": b"[" * 40 + b'"' + b'\\"' * (n // 2),
        "backslashes": b"[" * 40 + b'"' + b"\\" * n,
    }


def cost(body: bytes, cfg: ServiceConfig) -> tuple[float, str]:
    """Seconds the service's check and parse of ``body`` take, and what it answers (200-bound, or the 400's text)."""
    t0 = time.perf_counter()
    try:
        check_json_shape(body, cfg.max_json_depth, cfg.max_json_containers)
        parse_body(body)
        answer = "parsed"
    except ValueError as exc:
        answer = f"400: {str(exc).removeprefix('bad request body: ')[:48]}"
    return time.perf_counter() - t0, answer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=count(), default=8, help="body size, MiB (default: the service's cap, 8)")
    ap.add_argument("--repeat", type=count(), default=3, help="runs per case, the median printed")
    a = ap.parse_args()
    cfg = ServiceConfig(endpoints=[])
    cases = bodies(a.mib << 20, cfg.max_query_tokens)
    print(f"bodies of {a.mib} MiB (the prompt: {len(cases['prompt']) / 2**20:.1f} MiB); max_json_depth "
          f"{cfg.max_json_depth}, max_json_containers {cfg.max_json_containers:,}")
    print(f"{'case':<16}{'ms':>9}{'x prompt':>10}  answer / target")
    base = 0.0
    misses = 0
    for name, body in cases.items():
        cost(body, cfg)  # untimed: a first call pays the process's one-time costs (msgspec's, numpy's), not the body's
        runs = [cost(body, cfg) for _ in range(a.repeat)]
        ms = statistics.median(t for t, _ in runs) * 1e3
        base = base or ms
        ok = ms <= RATIO * base
        misses += not ok
        print(f"{name:<16}{ms:9.1f}{ms / base:10.2f}  {runs[0][1]} / {'MET' if ok else 'MISS'} <= {RATIO:g}x prompt")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
