"""Every bad input through the real CLI: one line naming what was wrong, exit 2, never a traceback.

The table holds the inputs of issue 15 and others of their kind; the hypothesis tests throw
random argument vectors at ``kvtier replay`` and ``kvtier indexer``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.engine.config import MAX_CACHE_PAGES, CacheConfig
from kvtier.hardware.latency import MockerLatency, latency_to_json
from kvtier.indexer.service import app as service
from kvtier.sim import cli as cli_module
from kvtier.sim import experiment
from kvtier.sim.cli import main
from kvtier.sim.cluster import MAX_PAGES
from kvtier.sim.report import wholes
from kvtier.util import outpath
from kvtier.util.fields import ConfigError
from kvtier.util.outpath import unwritable
from tests.test_multiprocess import ROOT, free_ports

SMALL = ["--trace", "builtin:chat:4", "--no-plots"]


def mooncake(tmp: Path, name: str, records: list[dict[str, Any]] | list[str]) -> str:
    path = tmp / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def rec(ts: Any = 0, n_in: Any = 100, n_out: Any = 10, ids: Any = None, **kw: Any) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids or [1], **kw}


def azure(tmp: Path, name: str, stamps: list[str]) -> str:
    path = tmp / name
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},100,10\n" for s in stamps))
    return str(path)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def busy_zmq() -> Iterator[str]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


def engine(*args: str) -> list[str]:
    # (port 0: the engine binds free ones itself; two ports found free apart may be one, or taken meanwhile)
    return ["engine", "--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
            "--trace", "builtin:chat:2", "--hold", "0", *args]


def indexer(*args: str) -> list[str]:
    return ["indexer", "--endpoint", f"w0=tcp://127.0.0.1:{free_ports()[0]}", *args]


def toml(tmp: Path, text: str) -> str:
    path = tmp / "svc.toml"
    path.write_text(text)
    return str(path)


Argv = Callable[[Path, dict[str, Any]], list[str]]  # (temporary dir, fixtures) -> argument vector
# (argument vector builder, what the error line must say)
Case = tuple[Argv, str]


def replay(*opts: str) -> Argv:
    """``kvtier replay`` of a tiny builtin trace with ``opts``."""
    return lambda t, f: ["replay", *SMALL, *opts]
CASES: dict[str, Case] = {
    # cluster options (ClusterConfig's domains)
    "page-size 0": (replay("--page-size", "0"),
                    "--page-size: 0 is not allowed; expected an integer >= 1"),
    "page-size negative": (replay("--page-size", "-16"), "--page-size: -16 is not allowed"),
    "workers 0": (replay("--workers", "0"), "--workers: 0 is not allowed"),
    # sizes whose memory is spent before the run: refused up front, not after gigabytes (or a MemoryError)
    "workers past the workers a run holds": (replay("--workers", "100000000"),
                                             "--workers 100000000: 100,000,000 workers; a simulation holds at most "
                                             "16,384"),
    "workers past the pages a run holds": (replay("--workers", "10000", "--device-tokens", "1000000"),
                                           "pages in all; a simulation holds at most 33,554,432"),
    "device tokens past the pages a run holds": (replay("--device-tokens", "100000000000000000000"),
                                                 "a simulation holds at most 33,554,432"),
    "pools past the workers a run holds": (replay("--prefill-workers", "1000000", "--decode-workers", "1000000"),
                                         "--prefill-workers 1000000 --decode-workers 1000000: 2,000,000 workers"),
    "pools past the pages a run holds": (replay("--prefill-workers", "5000", "--decode-workers", "5000",
                                                "--device-tokens", "1000000"),
                                         "--prefill-workers 5000 --decode-workers 5000, --device-tokens 1000000"),
    "window pools past the pages a run holds": (  # a worker's window pool holds at least its window's 8 pages
        replay("--model", "tiny-swa", "--swa-ratio", "0", "--host-ratio", "0", "--workers", "1", "--page-size", "16",
               "--device-tokens", str((MAX_PAGES - 4) * 16)),
        "--swa-ratio 0 (8 window-KV pages a worker): 33,554,436 pages in all; a simulation holds at most"),
    "grid workers past the pages a run holds": (lambda t, f: ["sweep", *SMALL, "--grid", "workers=100000000"],
                                                "--grid workers=100000000: --workers 100000000: 100,000,000"),
    # an output directory that cannot take the results: refused before the runs, not after them
    "out is a file": (lambda t, f: ["replay", *SMALL, "--out", _bytes(t, "f", b"")],
                      "f: is not a directory; name a directory"),
    "out is empty": (lambda t, f: ["replay", *SMALL, "--out", ""], "--out: empty; name a directory"),
    "sweep's file is a directory": (lambda t, f: ["sweep", *SMALL, "--grid", "seed=1,2", "--out", _dir(
        t, "o/sweep.json")[:-len("/sweep.json")]], "sweep.json is a directory"),
    "compare's summary is a directory": (lambda t, f: ["compare", *SMALL, "--policies", "round_robin,kv_all",
                                                       "--out", _dir(t, "o/summary.json")[:-len("/summary.json")]],
                                         "summary.json is a directory"),
    "sweep grid of a link on an aggregated cluster": (lambda t, f: ["sweep", *SMALL, "--grid", "kv_gbps=10,20"],
                                                       "grid axis 'kv_gbps': it applies to a disaggregated cluster"),
    "sweep grid past its cap": (lambda t, f: ["sweep", *SMALL, "--grid", "seed=" + ",".join(map(str, range(200))),
                                             "temperature=" + ",".join(map(str, range(1, 101)))],
                                "--grid: 20,000 points; a sweep runs at most 10,000"),
    "sweep grid value twice": (lambda t, f: ["sweep", *SMALL, "--grid", "policy=kv_all,kv_all"],
                               "grid axis 'policy': kv_all given twice"),
    "azure shared prefix past its cap": (lambda t, f: ["replay", "--trace", azure(t, "a.csv", ["2024-05-10 00:00:00"]),
                                                       "--shared-prefix-blocks", "10000000000000000000"],
                                         "expected an integer in [0, 1048576]"),
    "azure prefix groups past its cap": (lambda t, f: ["replay", "--trace", azure(t, "a.csv", ["2024-05-10 00:00:00"]),
                                                       "--prefix-groups", "100000000000000000000000"],
                                         "expected an integer in [1, 1048576]"),
    "sweep grid negative seed": (lambda t, f: ["sweep", *SMALL, "--grid", "seed=-1"],
                                 "--grid seed=-1: --seed: -1 is not allowed; expected an integer >= 0"),
    # an axis the cluster would not take: its rows reported settings that never ran
    "sweep grid workers of pools": (lambda t, f: ["sweep", *SMALL, "--prefill-workers", "2", "--decode-workers", "2",
                                                  "--grid", "workers=2,6"],
                                    "--grid workers=2: a disaggregated cluster's workers are its pools' (2 + 2)"),
    "sweep grid workers beside pools": (lambda t, f: ["sweep", *SMALL, "--grid", "pools=2:2", "workers=3,4"],
                                        "--grid pools=2:2 workers=3: a disaggregated cluster's workers"),
    "sweep grid kv link under a bandwidth": (lambda t, f: ["sweep", *SMALL, "--prefill-workers", "1",
                                                           "--decode-workers", "1", "--kv-link-gbps", "50", "--grid",
                                                           "kv_link=tcp-100g,nvlink-h100"],
                                             "--grid kv_link=tcp-100g: --kv-link-gbps 50 sets the link's bandwidth"),
    # the prefill -> decode link's options on an aggregated cluster: nothing would use them
    "kv link aggregated": (replay("--kv-link", "tcp-100g"),
                           "--kv-link: it applies to a disaggregated cluster only; give --prefill-workers"),
    "kv link options aggregated": (replay("--kv-link-gbps", "50", "--local-prefill-tokens", "128"),
                                   "--kv-link-gbps, --local-prefill-tokens: they apply to a disaggregated cluster"),
    "decode pool aggregated": (replay("--decode-device-tokens", "4096", "--decode-max-running", "8"),
                               "--decode-device-tokens, --decode-max-running: they apply to a disaggregated cluster"),
    "kv link sharing aggregated": (replay("--kv-link-sharing", "nic"),
                                   "--kv-link-sharing: it applies to a disaggregated cluster only"),
    "sweep decode pool axis aggregated": (lambda t, f: ["sweep", *SMALL, "--grid", "decode_max_running=8,16"],
                                          "grid axis 'decode_max_running': it applies to a disaggregated cluster"),
    "decode device tokens tiny": (replay("--prefill-workers", "1", "--decode-workers", "1", "--decode-device-tokens",
                                         "64"), "--decode-device-tokens: 64 holds fewer than 4 pages"),
    "sweep kv link aggregated": (lambda t, f: ["sweep", *SMALL, "--kv-link-gbps", "50", "--grid", "seed=1,2"],
                                 "--kv-link-gbps: it applies to a disaggregated cluster only"),
    "sweep grid split of another size": (lambda t, f: ["sweep", *SMALL, "--workers", "8", "--grid", "pools=agg,2:2"],
                                         "--grid pools=2:2: 4 workers, the cluster 8: a split keeps the cluster's"),
    "sweep grid pools and a pool size": (lambda t, f: ["sweep", *SMALL, "--grid", "pools=2:2", "prefill_workers=1"],
                                         "grid axes 'pools' and 'prefill_workers' both size the cluster"),
    "builtin trace past its cap": (lambda t, f: ["replay", "--trace", "builtin:chat:99999999999999"],
                                   "99,999,999,999,999 requests; a builtin trace holds at most 1,000,000"),
    "builtin trace limit past its cap": (lambda t, f: ["replay", "--trace", "builtin:chat", "--limit", "2000000"],
                                         "2,000,000 requests; a builtin trace holds at most 1,000,000"),
    "engine device pages past a cache": (lambda t, f: engine("--device-pages", "100000000000000"),
                                         "a cache holds at most 268,435,456"),
    "device-tokens below 4 pages": (replay("--device-tokens", "100"),
                                    "--device-tokens: 100 holds fewer than 4 pages"),
    "host-ratio -1": (replay("--host-ratio", "-1"),
                      "--host-ratio: -1 is not allowed; expected a number in [0, 1024]"),
    "host-ratio nan": (replay("--host-ratio", "nan"), "--host-ratio: nan is not allowed"),
    "host-ratio inf": (replay("--host-ratio", "inf"), "--host-ratio: inf is not allowed"),
    "h2d-gbps 0": (replay("--h2d-gbps", "0"),
                   "--h2d-gbps: 0.0 is not allowed; expected a number in [0.001, 1000000]"),
    # a positive speed or scale too small (or large) for any run: 300-digit TTFTs, arrivals past the float range
    "kv-link-gbps tiny": (replay("--prefill-workers", "1", "--decode-workers", "1", "--kv-link-gbps", "1e-300"),
                          "--kv-link-gbps: 1e-300 is not allowed; expected a number in [0.001, 1000000]"),
    "time-scale huge": (replay("--time-scale", "1e300"),
                        "--time-scale: 1e300 is not allowed; expected a number in [1e-06, 1000000]"),
    "storage-gbps -1": (replay("--storage-gbps", "-1"), "--storage-gbps: -1.0 is not allowed"),
    "l3-tokens 0": (replay("--l3", "disk", "--l3-tokens", "0"),
                    "--l3-tokens: 0 is not allowed"),
    "l3 without host": (replay("--l3", "disk", "--host-ratio", "0"),
                        "--l3 disk: needs a host tier"),
    "prefill-budget 0": (replay("--prefill-budget", "0"),
                         "--prefill-budget: 0 is not allowed"),
    "max-running 0": (replay("--max-running", "0"), "--max-running: 0 is not allowed"),
    "page-size not a number": (replay("--page-size", "x"),
                               "argument --page-size: 'x' is not an integer >= 1"),
    # router options (RunConfig's domains)
    "temperature -1": (replay("--temperature", "-1"), "--temperature: -1.0 is not allowed"),
    "temperature nan": (replay("--temperature", "nan"), "--temperature: nan is not allowed"),
    "event-loss 2": (replay("--event-loss", "2"),
                     "--event-loss: 2.0 is not allowed; expected a number in [0, 1]"),
    "event-delay -5": (replay("--event-delay", "-5"), "--event-delay: -5.0 is not allowed"),
    "host-credit nan": (replay("--host-credit", "nan"), "--host-credit: nan is not allowed"),
    "until -1": (replay("--until", "-1"), "--until: -1.0 is not allowed"),
    "replay-buffer 0": (replay("--replay-buffer", "0"), "--replay-buffer: 0 is not allowed"),
    "loss-burst 0": (replay("--loss-burst", "0"), "--loss-burst: 0 is not allowed"),
    "sla-ttft-ms 0": (replay("--sla-ttft-ms", "0"), "--sla-ttft-ms: 0.0 is not allowed; expected a number > 0"),
    "sla-tpot-ms nan": (replay("--sla-tpot-ms", "nan"), "--sla-tpot-ms: nan is not allowed"),
    "unknown policy": (replay("--policy", "bogus"), "unknown policy 'bogus'; expected one of round_robin"),
    "policy typo": (replay("--policy", "kvall"), "unknown policy 'kvall' (did you mean 'kv_all'?); expected"),
    "policy with a hyphen": (replay("--policy", "min-ttft"), "unknown policy 'min-ttft' (did you mean 'min_ttft'?)"),
    "builtin trace typo": (lambda t, f: ["replay", "--no-plots", "--trace", "builtin:chatt"],
                           "unknown builtin trace 'chatt' (did you mean 'chat'?); expected one of agentic, chat, "
                           "sysprompt"),
    "draft model unknown": (replay("--draft-model", "llama-9"), "argument --draft-model: invalid choice: 'llama-9'"),
    # trace options
    "time-scale -1": (replay("--time-scale", "-1"),
                      "argument --time-scale: -1 is not allowed; expected a number in [1e-06, 1000000]"),
    "time-scale nan": (replay("--time-scale", "nan"), "argument --time-scale: nan"),
    "limit -5": (replay("--limit", "-5"), "argument --limit: -5 is not allowed"),
    "limit 0": (replay("--limit", "0"), "argument --limit: 0 is not allowed"),
    "builtin:chat:0": (lambda t, f: ["replay", "--no-plots", "--trace", "builtin:chat:0"], "with N >= 1 requests"),
    "builtin:chat:x": (lambda t, f: ["replay", "--no-plots", "--trace", "builtin:chat:x"], "with N >= 1 requests"),
    "unknown builtin": (lambda t, f: ["replay", "--no-plots", "--trace", "builtin:nope"], "unknown builtin trace"),
    "missing trace": (lambda t, f: ["replay", "--no-plots", "--trace", str(t / "none.jsonl")], "not found"),
    "directory as trace": (lambda t, f: ["replay", "--no-plots", "--trace", str(t)], "is not a file"),
    # trace contents
    "duplicate request_id": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "dup.jsonl", [rec(request_id="a"), rec(5, request_id="a")])], "dup.jsonl:2: request_id 'a' already used"),
    # the latest arrival a run takes (the clock's microseconds), in the trace or through --time-scale
    "timestamp past the clock": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "far.jsonl", [rec(), rec(10**12)])],
        "far.jsonl:2: timestamp must be a finite non-negative number of ms up to 1e+11, got 1000000000000"),
    "time-scale past the clock": (lambda t, f: ["replay", "--no-plots", "--time-scale", "1000", "--trace", mooncake(
        t, "s.jsonl", [rec(), rec(10**9)])], "--time-scale 1000 takes request 'r1' of "),
    "time-scale past the clock, builtin": (lambda t, f: ["replay", "--no-plots", "--time-scale", "1e6", "--trace",
                                                         "builtin:chat:50"],
                                           "kvtier: error: --time-scale 1e+06 takes request 'r49' of builtin:chat:50, "
                                           "arriving at 436.268 s, to 4.36e+08 s: past 1e+08 s"),
    "azure span past the clock": (lambda t, f: ["replay", "--no-plots", "--trace", azure(
        t, "a.csv", ["2024-05-10 00:00:00", "9999-12-31 00:00:00"])],
        "a.csv arrives at 2.52e+11 s: past 1e+08 s, where the simulator's clock (seconds in a float)"),
    # JSON true is no session: taken as the session "True", a record naming that one became its next turn
    "boolean session_id": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "s.jsonl", [rec(session_id=True)])], "s.jsonl:1: session_id must be a string or an integer, got True"),
    "NaN timestamp": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "nan.jsonl", [json.dumps(rec()), json.dumps(rec(float("nan")))])],
        "nan.jsonl:2: timestamp must be a finite non-negative number"),
    "Infinity timestamp": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "inf.jsonl", [json.dumps(rec(float("inf")))])],
        "inf.jsonl:1: timestamp must be a finite non-negative number"),
    "backwards timestamp": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "back.jsonl", [rec(10), rec(5)])], "back.jsonl:2: timestamp goes backwards"),
    "boolean input_length": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "bool.jsonl", [rec(n_in=True)])], "bool.jsonl:1: input_length must be >= 1"),
    "boolean hash id": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "boolid.jsonl", [rec(ids=[True])])], "boolid.jsonl:1: hash_ids must be"),
    "non-UTF-8 trace": (lambda t, f: ["replay", "--no-plots", "--trace", _bytes(
        t, "latin.jsonl", json.dumps(rec()).encode() + b"\n" + b'{"x": "caf\xe9"}\n')], "latin.jsonl:2: not UTF-8"),
    # hostile traces (issue 51): refused in bounded memory, before anything is allocated per token or block
    "trace line past the cap": (lambda t, f: ["replay", "--no-plots", "--trace", _sparse(t, "long.jsonl")],
                                "long.jsonl:1: line is longer than the cap of 4,194,304 bytes"),
    "trace nested 200k deep": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "deep.jsonl", [rec(), "[" * 200_000 + "]" * 200_000])], "deep.jsonl:2: JSON nested deeper than 32"),
    "trace input_length 1e10": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "long_in.jsonl", [rec(n_in=10**10)])], "long_in.jsonl:1: input_length 10000000000 is past the cap"),
    "trace 1M hash ids": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "ids.jsonl", [rec(n_in=2**29, ids=[1] * 2**20)])], "ids.jsonl:1: input_length 536870912 is past the cap"),
    "trace integer past a float": (lambda t, f: ["replay", "--no-plots", "--trace", mooncake(
        t, "big.jsonl", [rec(10**400)])], "big.jsonl:1: timestamp must be a finite non-negative number"),
    "compare trace nested": (lambda t, f: ["compare", "--no-plots", "--trace", mooncake(
        t, "deep.jsonl", ['{"a": ' + "{" * 100_000])], "deep.jsonl:1: JSON nested deeper than 32"),
    "sweep trace line past the cap": (lambda t, f: ["sweep", "--trace", _sparse(t, "long.jsonl"), "--grid",
                                                    "workers=1"], "long.jsonl:1: line is longer than the cap"),
    "engine trace nested": (lambda t, f: engine("--trace", mooncake(t, "deep.jsonl", ["[" * 100_000])),
                            "deep.jsonl:1: JSON nested deeper than 32"),
    "azure ContextTokens 1e10": (lambda t, f: ["replay", "--no-plots", "--trace", _bytes(
        t, "long.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10000000000,1\n")],
        "long.csv:2: ContextTokens 10000000000 is past the cap"),
    "azure field past the csv limit": (lambda t, f: ["replay", "--no-plots", "--trace", _bytes(
        t, "wide.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,1," + b"x" * 200_000)],
        "wide.csv:2: not CSV: field larger than field limit"),
    "azure line past the cap": (lambda t, f: ["replay", "--no-plots", "--trace", _sparse(t, "long.csv")],
                                "long.csv:1: line is longer than the cap"),
    "azure backwards": (lambda t, f: ["replay", "--no-plots", "--trace", azure(
        t, "back.csv", ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:40.1"])], "back.csv:3: TIMESTAMP goes back"),
    "azure mixed time zones": (lambda t, f: ["replay", "--no-plots", "--trace", azure(
        t, "tz.csv", ["2023-11-16 18:15:46.68", "2023-11-16 18:15:47+00:00"])], "tz.csv:3: TIMESTAMP"),
    "azure row missing a field": (lambda t, f: ["replay", "--no-plots", "--trace", _bytes(
        t, "short.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,100\n")],
        "short.csv:2: GeneratedTokens is missing"),
    "azure field not a number": (lambda t, f: ["replay", "--no-plots", "--trace", _bytes(
        t, "nan.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,lots,1\n")],
        "nan.csv:2: ContextTokens 'lots' is not an integer"),
    "latency file not UTF-8": (lambda t, f: replay("--latency", _bytes(t, "fit.json", b'{"prefill_ms": "\xff"}'))(
        t, f), "fit.json: not UTF-8"),
    # a fit that bends below zero past the prefill pool's prompts, within the decode pool's: refused before any run
    "latency bends on the decode pool": (lambda t, f: [
        "sweep", "--trace", "builtin:chat:6", "--no-plots", "--out", str(t / "o"), "--prefill-workers", "1",
        "--decode-workers", "1", "--device-tokens", "8192", "--latency",
        _bytes(t, "bend.json", b'{"prefill_ms": [-1e-6, 0.01, 1.0], "decode_ms": [-25.74, 54.01, 5.74]}'),
        "--grid", "decode_device_tokens=8192,16384"],
        "gives -104 ms for 16384 tokens; a prefill of 1 to 16384 tokens must take more than 0 ms (a decode worker's "
        "router prices prompts up to --decode-device-tokens)"),
    # coefficients that overflow a price: an infinite floor (JSON's Infinity), a huge constant, a fit to huge points
    "latency floor Infinity": (lambda t, f: replay("--latency", _bytes(t, "inf.json", b'{"prefill_ms": [0, 0.01, 10], '
                                                   b'"decode_ms": [0, 0, 5], "decode_floor_ms": Infinity}'))(t, f),
                               "inf.json: its decode_floor is inf; a latency coefficient must be at most 1e+09"),
    "latency huge constant": (lambda t, f: replay("--latency", _bytes(t, "big.json", b'{"prefill_ms": [0, 0.01, 10], '
                                                  b'"decode_ms": [0, 0, 1e308]}'))(t, f),
                              "big.json: its decode_c is 1e+308; a latency coefficient must be at most 1e+09"),
    "fit-latency huge points": (lambda t, f: ["fit-latency", "-o", str(t / "fit.json"), _bytes(
        t, "huge.csv", b"kind,x,ms\nprefill,1,1\nprefill,2,1\nprefill,3,1e308\ndecode,0,1\ndecode,0.5,1\n"
        b"decode,1,1e308\n")], "a latency coefficient must be at most 1e+09 in size"),
    "fit-latency x past 1e12": (lambda t, f: ["fit-latency", "-o", str(t / "fit.json"), _bytes(
        t, "far.csv", b"kind,x,ms\nprefill,1e200,5\nprefill,2e200,6\nprefill,3e200,7\n")],  # (lstsq never returned)
        "prefill points must have x at most 1e+12"),
    "fit-latency negative pool": (lambda t, f: ["fit-latency", "--kv-pool-tokens", "-5", _bytes(
        t, "pts.csv", b"kind,x,ms\nprefill,512,20\nprefill,2048,50\nprefill,8192,100\n")],
        "argument --kv-pool-tokens: -5 is not allowed"),
    "router seed -1": (replay("--seed", "-1"), "argument --seed: -1 is not allowed; expected an integer >= 0"),
    "tokens index and request": (lambda t, f: ["tokens", "--trace", "builtin:chat:4", "--index", "2", "--request",
                                               "r3"], "argument --request: not allowed with argument --index"),
    "tokens index 0 and request": (lambda t, f: ["tokens", "--trace", "builtin:chat:4", "--index", "0", "--request",
                                                 "r3"], "argument --request: not allowed with argument --index"),
    "engine l3-dir empty": (lambda t, f: engine("--l3", "disk", "--l3-dir", ""),  # (was the working directory)
                            "--l3-dir: an empty path"),
    "engine pools past memory": (lambda t, f: engine("--l3-dir", str(t / "l3"), "--kv-bytes-per-token", "100000000"),
                                 "GiB of memory, more than the"),  # (was torch's allocation traceback)
    "engine l3-dir without l3": (lambda t, f: engine("--l3", "none", "--l3-dir", str(t)),
                                 "--l3-dir: --l3 none keeps no L3 tier"),
    "engine l3-dir missing": (lambda t, f: engine("--l3-dir", str(t / "typo" / "l3"), "--device-pages", "16",
                                                  "--kv-bytes-per-token", "8"),  # (was made: a cold start)
                              "does not exist; make the directory first"),
    "engine speed too small": (lambda t, f: engine("--speed", "1e-300"),
                               "argument --speed: 1e-300 is not allowed; expected a number in [1e-06, 1000000]"),
    "gen-trace requests past the cap": (lambda t, f: ["gen-trace", "--requests", "100000000000000", "-o",
                                                      str(t / "big.jsonl")],  # (ran for days, silent)
                                        "argument --requests: 100000000000000 is not allowed"),
    "gen-trace rate too small": (lambda t, f: ["gen-trace", "--rate", "1e-300", "--requests", "3",
                                               "-o", str(t / "x.jsonl")],
                                 "argument --rate: 1e-300 is not allowed; expected a number in [1e-06, 1000000]"),
    "azure bad timestamp": (lambda t, f: ["replay", "--no-plots", "--trace", azure(t, "bad.csv", ["yesterday"])],
                            "bad.csv:2: TIMESTAMP 'yesterday' is not an ISO date"),
    "azure timestamp past the calendar": (lambda t, f: ["replay", "--no-plots", "--trace",
                                                        azure(t, "bad.csv", ["2024-13-45 00:00:00"])],
                                          "bad.csv:2: TIMESTAMP '2024-13-45 00:00:00' is not a date and time: "
                                          "month must be in 1..12"),
    **{f"azure count {label}": (lambda t, f, text=text: ["replay", "--no-plots", "--trace", _bytes(
        t, "c.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,{text},10\n".encode())],
        f"c.csv:2: ContextTokens {shown} is {what}") for label, text, shown, what in [
            ("with an underscore", "1_000", "'1_000'", "not an integer"),  # (int() takes these three)
            ("with a space inside", "1 000", "'1 000'", "not an integer"),
            ("in other digits", "\u0661\u0660\u0660", "'\u0661\u0660\u0660'", "not an integer"),
            ("of 5,000 digits", "9" * 5000, "9" * 37 + "...", "past the cap of")]},
    # compare and sweep
    "policies empty": (lambda t, f: ["compare", *SMALL, "--policies", ""], "--policies: '' names no policy"),
    "policies commas": (lambda t, f: ["compare", *SMALL, "--policies", " , "], "names no policy"),
    "jobs 0": (lambda t, f: ["compare", *SMALL, "--jobs", "0"], "argument --jobs: 0 is not allowed"),
    "grid policy=bogus": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "policy=bogus"],
                          "--grid policy=bogus: unknown policy 'bogus'"),
    "grid page_size=0": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "page_size=0"],
                         "--grid page_size=0: --page-size: 0 is not allowed"),
    "grid unknown axis": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "colour=red"],
                          "grid axis 'colour' is not a setting; known: closed_loop, cost"),
    "grid axis typo": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "devce_tokens=1"],
                       "grid axis 'devce_tokens' is not a setting (did you mean 'device_tokens'?)"),
    "grid axis by its option": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "event_delay=0,1"],
                                "grid axis 'event_delay' is not a setting (it is 'event_delay_s', as summary.json "
                                "names it)"),
    "policies two unknown": (lambda t, f: ["compare", *SMALL, "--policies", "round_robin,kvall,min-ttft"],
                             "--policies: unknown policies 'kvall' (did you mean 'kv_all'?), 'min-ttft' (did you "
                             "mean 'min_ttft'?); expected names from round_robin"),
    # a sweep writes no inter-token series: the option is refused, not accepted and ignored
    "sweep itl series": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "workers=1", "--itl-series", "x.jsonl"],
                         "kvtier sweep: error: unrecognized arguments: --itl-series x.jsonl (see kvtier sweep --help)"),
    # a misspelt option is named by the subcommand that took it, with the nearest options it has
    "misspelt option": (lambda t, f: ["compare", *SMALL, "--polices", "kv_all"],
                        "kvtier compare: error: unrecognized arguments: --polices kv_all; did you mean --policies? "
                        "(see kvtier compare --help)"),
    # one given before the subcommand is kvtier's own, named by kvtier with kvtier's options
    "unknown option before the subcommand": (lambda t, f: ["--bogus", "replay", *SMALL],
                                             "kvtier: error: unrecognized arguments: --bogus (see kvtier --help)"),
    "kvtier's own option after the subcommand": (lambda t, f: ["--verbose", "replay", *SMALL, "--verbose"],
                                                 "kvtier replay: error: unrecognized arguments: --verbose (see kvtier "
                                                 "replay --help)"),
    "kvtier's own option misspelt": (lambda t, f: ["--verbse", "compare", *SMALL, "--polices", "kv_all"],
                                     "kvtier: error: unrecognized arguments: --verbse; did you mean --verbose? "
                                     "(see kvtier --help)"),
    "grid bad value": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "workers=x"],
                       "grid axis 'workers': 'x' is not an integer"),
    "grid bad number": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "host_ratio=4,lots"],
                        "grid axis 'host_ratio': 'lots' is not a number"),
    "grid bad choice": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "eviction=foo"],
                        "grid axis 'eviction': 'foo' is not one of node, page"),
    # a latency axis names a file or a preset, checked as the grid is read, not when a run begins
    "grid unknown latency": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "latency=dynamo-mocker,fast"],
                             "grid axis 'latency': fast: No such file, nor a latency preset"),
    "grid axis twice": (lambda t, f: ["sweep", *SMALL[:2], "--grid", "workers=1", "workers=2"],
                        "grid axis 'workers' is given twice: give its values once, as workers=V1,V2,..."),
    # plugins that cannot load or break the protocol: one line naming the plugin and what is wrong with it
    "plugin syntax error": (lambda t, f: replay("--policy", _bytes(t, "p.py", b"def (:\n") + ":P")(t, f),
                            "p.py:P': SyntaxError: invalid syntax"),
    "plugin raises on import": (lambda t, f: replay("--policy", _bytes(
        t, "p.py", b"raise RuntimeError('no GPU here')\n") + ":P")(t, f), "p.py:P': RuntimeError: no GPU here"),
    "plugin class needs an argument": (lambda t, f: replay("--policy", _bytes(t, "p.py", _PLUGIN + (
        b"    def __init__(self, k):\n        self.k = k\n")) + ":P")(t, f),
        "p.py:P': P() failed: TypeError: P.__init__() missing 1 required positional argument: 'k'"),
    "plugin without score": (lambda t, f: replay("--policy", _bytes(t, "p.py", _PLUGIN.replace(
        b"    def score", b"    def scored")) + ":P")(t, f), "p.py:P': P defines no score()"),
    "plugin with an empty name": (lambda t, f: replay("--policy", _bytes(t, "p.py", _PLUGIN.replace(
        b'name = "p"', b'name = ""')) + ":P")(t, f), "p.py:P': its name must be a non-empty printable string, got ''"),
    "plugin with a newline in its name": (lambda t, f: replay("--policy", _bytes(t, "p.py", _PLUGIN.replace(
        b'name = "p"', b'name = "a\\nb"')) + ":P")(t, f), "its name must be a non-empty printable string, got 'a\\nb'"),
    "plugin whose name raises": (lambda t, f: replay("--policy", _bytes(t, "p.py", _PLUGIN.replace(
        b'name = "p"', b'name = property(lambda self: 1 / 0)')) + ":P")(t, f),
        "p.py:P': reading its attributes raised ZeroDivisionError: division by zero"),
    "plugin exits on import": (lambda t, f: replay("--policy", _bytes(t, "p.py", b"import sys\nsys.exit(3)\n") + ":P")(
        t, f), "p.py:P': SystemExit: 3"),
    # a fit whose prefill time goes negative in the range a pass takes: refused, naming the time it gives
    "latency fit negative": (lambda t, f: replay("--device-tokens", "8192", "--latency", _bytes(
        t, "fit.json", json.dumps({"prefill_ms": [-1e-6, 0.0, 20.0], "decode_ms": [0.0, 0.0, 5.0]}).encode()))(t, f),
        "--latency: its prefill fit gives -47.1 ms for 8192 tokens; a prefill of 1 to 8192 tokens must take more"),
    "indexer latency fit negative": (lambda t, f: indexer("--latency", _bytes(t, "fit.json", json.dumps(
        {"prefill_ms": [-1e-6, 0.0, 20.0], "decode_ms": [0.0, 0.0, 5.0]}).encode())),
        "fit.json: its prefill fit gives -1.1e+06 ms for 1048576 tokens"),
    "fit-latency negative": (lambda t, f: ["fit-latency", _bytes(
        t, "pts.csv", b"kind,x,ms\nprefill,512,200\nprefill,2048,50\nprefill,8192,1\n"), "-o", str(t / "f.json")],
        "its prefill fit gives"),
    # checked before the run, so that a bad path costs no run and the error names the path given
    "itl-series is a directory": (lambda t, f: replay("--itl-series", str(t))(t, f),
                                  ": is a directory; name a file in it"),
    "itl-series in a missing directory": (lambda t, f: ["compare", *SMALL, "--itl-series", str(t / "no" / "x.jsonl")],
                                          "/no/x.jsonl: directory "),
    # (it was run, then renamed over requests.csv: the gaps' JSONL was left in it)
    "itl-series is requests.csv": (lambda t, f: replay("--out", _dir(t, "o"), "--itl-series",
                                                       str(t / "o" / "requests.csv"))(t, f),
                                   "requests.csv: is --out or one of its own outputs; name another file"),
    "itl-series is a plot": (lambda t, f: ["compare", "--trace", "builtin:chat:4", "--out", _dir(t, "o"),
                                           "--itl-series", "o/../o/ttft_cdf.png"],
                             "ttft_cdf.png: is --out or one of its own outputs"),
    # an output that is an input: the trace was overwritten, and a later run refused it
    "itl-series is the trace": (lambda t, f: ["replay", "--trace", _bytes(t, "t.jsonl", _MOONCAKE_LINE), "--no-plots",
                                              "--out", str(t / "o"), "--itl-series", str(t / "t.jsonl")],
                                "t.jsonl: is the --trace file the run reads; name another file"),
    "out holds the trace": (lambda t, f: ["replay", "--trace", _bytes(t, "requests.csv", _AZURE_LINES), "--no-plots",
                                          "--out", str(t)], "requests.csv: is the --trace file the run reads"),
    "itl-series is a plugin's file": (lambda t, f: ["compare", *SMALL, "--policies", "kv_all, " + _bytes(
        t, "p.py", _PLUGIN) + ":P", "--out", str(t / "o"), "--itl-series", str(t / "p.py")],
        "p.py: is the --policies plugin file the run reads"),
    "fit-latency over its points": (lambda t, f: ["fit-latency", _bytes(
        t, "pts.csv", b"kind,x,ms\nprefill,512,20\nprefill,2048,50\nprefill,8192,200\n"), "-o", str(t / "pts.csv")],
        "pts.csv: is the points file the fit reads"),
    "itl-series is --out": (lambda t, f: replay("--out", str(t / "o"), "--itl-series", str(t / "o"))(t, f),
                            "o: is --out or one of its own outputs"),
    "itl-series is a socket": (lambda t, f: replay("--itl-series", _socket(t, "s.sock"))(t, f), "s.sock: is a socket"),
    "itl-series is a link loop": (lambda t, f: replay("--itl-series", _loop(t, "gaps.jsonl"))(t, f),
                                  "gaps.jsonl: is a loop of symbolic links"),
    "fit-latency points through a link loop": (lambda t, f: ["fit-latency", _loop(t, "loop.csv"), "-o",
                                                             str(t / "f.json")], "loop.csv: Too many levels"),
    "sweep out holds a grid's latency fit": (lambda t, f: ["sweep", *SMALL, "--grid", "latency=dynamo-mocker," + _bytes(
        t, "sweep.json", latency_to_json(MockerLatency()).encode()), "--out", str(t)],
        "sweep.json: is the --grid latency file the run reads"),
    "sweep out holds the trace": (lambda t, f: ["sweep", "--trace", _bytes(t, "sweep.json", _MOONCAKE_LINE),
                                                "--no-plots", "--grid", "workers=1,2", "--out", str(t)],
                                  "sweep.json: is the --trace file the run reads"),
    # a host tier of no page: an --l3 tier behind it silently did nothing
    "host ratio of no page": (lambda t, f: ["replay", *SMALL, "--device-tokens", "32768", "--host-ratio", "0.0001",
                                            "--l3", "disk"], "--host-ratio 0.0001: a host tier of no page"),
    # gen-trace
    "gen-trace to a full device": (lambda t, f: ["gen-trace", "--requests", "3", "-o", "/dev/full"],
                                   "-o /dev/full: No space left on device"),
    "gen-trace requests 0": (lambda t, f: ["gen-trace", "--requests", "0", "-o", str(t / "x.jsonl")],
                             "argument --requests: 0 is not allowed"),
    "gen-trace rate -1": (lambda t, f: ["gen-trace", "--rate", "-1", "-o", str(t / "x.jsonl")],
                          "argument --rate: -1 is not allowed"),
    # numpy's generators take no negative seed: the option refuses it, and the line names the option
    "trace seed -1": (lambda t, f: ["replay", *SMALL[:2], "--trace-seed", "-1"],
                      "argument --trace-seed: -1 is not allowed; expected an integer >= 0"),
    "gen-trace seed -1": (lambda t, f: ["gen-trace", "--seed", "-1", "-o", str(t / "x.jsonl")],
                          "argument --seed: -1 is not allowed; expected an integer >= 0"),
    "gen-trace missing directory": (lambda t, f: ["gen-trace", "--requests", "3", "-o", str(t / "no" / "x.jsonl")],
                                    "/no/x.jsonl: directory "),
    # fit-latency
    "fit-latency missing csv": (lambda t, f: ["fit-latency", str(t / "none.csv")], "none.csv: No such file"),
    "latency preset unknown": (lambda t, f: ["replay", *SMALL, "--latency", "h100-llama"],
                               "h100-llama: No such file, nor a latency preset (dynamo-mocker, h200-llama-3.1-8b)"),
    "latency file missing": (lambda t, f: ["replay", *SMALL, "--latency", str(t / "l.json")],
                             "l.json: No such file"),
    # kvtier engine
    "engine missing trace": (lambda t, f: engine("--trace", str(t / "none.jsonl")), "not found"),
    "engine port in use": (lambda t, f: [*engine(), "--endpoint", f["busy_zmq"]], "cannot bind"),
    # ZMQ would bind port 99999 - 65536 = 34463 and say nothing.
    "engine port past 65535": (lambda t, f: [*engine(), "--replay", "tcp://127.0.0.1:99999"], "port in 0..65535"),
    "engine parent pid not its parent": (lambda t, f: engine("--parent-pid", "999999999"),  # (exited 0 at once)
                                         "--parent-pid 999999999: not this process's parent"),
    "engine empty name": (lambda t, f: engine("--name", ""), "argument --name: '' is not allowed"),
    "engine name of a lock file": (lambda t, f: engine("--name", ".w0.lock"),  # (another owner's lock, in refs/)
                                   "argument --name: '.w0.lock' is not allowed"),
    "engine not a ZMQ address": (lambda t, f: [*engine(), "--endpoint", "http://127.0.0.1:1"], "expected tcp://"),
    "engine seed -1": (lambda t, f: engine("--seed", "-1"), "argument --seed: -1 is not allowed; expected an integer"),
    "engine speed 0": (lambda t, f: engine("--speed", "0"), "argument --speed: 0 is not allowed"),
    "engine dump-interval -1": (lambda t, f: engine("--dump-interval", "-1"),
                                "argument --dump-interval: -1 is not allowed; expected a number >= 0"),
    "engine dump-interval nan": (lambda t, f: engine("--dump-interval", "nan"), "argument --dump-interval: nan"),
    "engine max-dumps 0": (lambda t, f: engine("--max-dumps", "0"), "argument --max-dumps: 0 is not allowed"),
    "engine disk-pages -1": (lambda t, f: engine("--disk-pages", "-1"), "argument --disk-pages: -1 is not allowed"),
    "engine page-size 0": (lambda t, f: engine("--page-size", "0"), "argument --page-size: 0 is not allowed"),
    "engine l3 without host": (lambda t, f: engine("--host-ratio", "0"), "--l3 disk: needs a host tier"),
    "engine residency over its trace": (lambda t, f: [*engine(), "--trace", _bytes(t, "t.jsonl", _MOONCAKE_LINE),
                                                      "--residency", str(t / "t.jsonl")],
                                        "t.jsonl: is the --trace file the engine replays"),
    "engine residency in a missing directory": (lambda t, f: engine("--residency", str(t / "no" / "r.json")),
                                                "--residency"),
    "engine l3-dir is a file": (lambda t, f: engine("--l3-dir", _bytes(t, "afile", b"x")), "--l3-dir"),
    # kvtier indexer
    "indexer listen foo": (lambda t, f: indexer("--listen", "foo"), "listen: 'foo' is not allowed"),
    "indexer port 99999": (lambda t, f: indexer("--listen", "127.0.0.1:99999"), "port in 0..65535"),
    "indexer address in use": (lambda t, f: indexer("--listen", f"127.0.0.1:{f['busy_port']}"),
                               "cannot listen on 127.0.0.1"),
    "indexer block-size 0": (lambda t, f: indexer("--block-size", "0"), "block_size: 0 is not allowed"),
    "indexer no endpoints": (lambda t, f: ["indexer"], "give at least one --endpoint"),
    "indexer bad endpoint": (lambda t, f: ["indexer", "--endpoint", "garbage"], "endpoint 'garbage'"),
    "indexer endpoint port past 65535": (lambda t, f: ["indexer", "--endpoint", "w=tcp://127.0.0.1:99999"],
                                         "port in 1..65535"),
    # str.isdigit() takes '²' and int() does not: refused as a bad value of the option, naming it
    "indexer endpoint dp superscript": (lambda t, f: ["indexer", "--endpoint", "w=tcp://127.0.0.1:1,dp=\u00b2"],
                                        "option 'dp=\u00b2': expected dp=N with N an integer >= 0"),
    "indexer listen port superscript": (lambda t, f: indexer("--listen", "127.0.0.1:\u00b2"),
                                        "listen: '127.0.0.1:\u00b2' is not allowed"),
    "indexer endpoint port superscript": (lambda t, f: ["indexer", "--endpoint", "w=tcp://127.0.0.1:\u00b2"],
                                          "port in 1..65535"),
    "engine endpoint port superscript": (lambda t, f: [*engine(), "--endpoint", "tcp://127.0.0.1:\u00b2"],
                                         "port in 0..65535"),
    "builtin trace count superscript": (lambda t, f: ["replay", "--trace", "builtin:chat:\u00b2", "--no-plots"],
                                        "expected builtin:KIND[:N] with N >= 1"),
    "indexer endpoint dp past its cap": (lambda t, f: ["indexer", "--endpoint",
                                                       "w=tcp://127.0.0.1:1,dp=99999999999999999999999"],
                                         "dp_rank 99999999999999999999999: expected an integer in [0, 65535]"),
    "indexer endpoint dp -1": (lambda t, f: ["indexer", "--endpoint", "w=tcp://127.0.0.1:1,dp=-1"],
                               "option 'dp=-1': expected dp=N with N an integer >= 0"),
    "indexer endpoint dump=yes": (lambda t, f: ["indexer", "--endpoint", "w=tcp://127.0.0.1:1,replay=tcp://h:2,dump=1"],
                                  "option 'dump=1': dump takes no value"),
    # one socket cannot be both: the live stream would be read as replay answers, or the replay never answered
    "indexer replay on the live address": (lambda t, f: [
        "indexer", "--endpoint", "w=tcp://127.0.0.1:1,replay=tcp://127.0.0.1:1"], "replay endpoint is the live one"),
    "indexer TOML empty worker": (lambda t, f: ["indexer", "--config", toml(
        t, '[[endpoints]]\nworker = ""\nendpoint = "tcp://127.0.0.1:1"\n')], "worker id is empty"),
    "indexer endpoint not ZMQ": (lambda t, f: ["indexer", "--endpoint", "w=garbage"], "expected tcp://"),
    "indexer snapshot in a missing directory": (lambda t, f: indexer("--snapshot", str(t / "no" / "x.snap")),
                                                "does not exist"),
    "indexer unknown policy": (lambda t, f: indexer("--policy", "nope"), "policy 'nope'"),
    "indexer llmd_kv without capacity": (lambda t, f: indexer("--policy", "llmd_kv"),
                                         "llmd_kv: the KV-cache-utilisation scorer needs each worker's device"),
    "indexer negative window": (lambda t, f: indexer("--window-tokens", "-3"), "window_tokens: -3 is not allowed"),
    "indexer TOML window type": (lambda t, f: ["indexer", "--config", toml(
        t, 'window_tokens = "128"\n[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')],
        "window_tokens: '128' is not allowed"),
    "indexer unknown http loop": (lambda t, f: indexer("--http-loop", "tornado"), "--http-loop: invalid choice"),
    "indexer TOML http loop": (lambda t, f: ["indexer", "--config", toml(
        t, 'http_loop = "tornado"\n[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')],
        "http_loop: 'tornado' is not allowed"),
    "indexer missing config": (lambda t, f: ["indexer", "--config", str(t / "none.toml")],
                               "none.toml: No such file or directory"),
    "indexer TOML wrong type": (lambda t, f: ["indexer", "--config", toml(
        t, 'block_size = "16"\n[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')],
        "block_size: '16' is not allowed"),
    "indexer TOML bool as int": (lambda t, f: ["indexer", "--config", toml(
        t, 'block_size = true\n[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')],
        "block_size: True is not allowed"),
    "indexer TOML endpoint type": (lambda t, f: ["indexer", "--config", toml(
        t, '[[endpoints]]\nworker = 5\nendpoint = "tcp://127.0.0.1:1"\n')], "endpoints[0].worker: 5"),
    "indexer TOML dp_rank bool": (lambda t, f: ["indexer", "--config", toml(
        t, '[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\ndp_rank = true\n')],
        "endpoints[0].dp_rank: True"),
    "indexer TOML endpoints not tables": (lambda t, f: ["indexer", "--config", toml(t, 'endpoints = 3\n')],
                                          "endpoints must be [[endpoints]] tables"),
    "indexer TOML syntax": (lambda t, f: ["indexer", "--config", toml(t, 'block_size = \n')], "svc.toml"),
    "indexer TOML listen int": (lambda t, f: ["indexer", "--config", toml(
        t, 'listen = 8000\n[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')], "listen: 8000"),
    "indexer snapshot garbage": (lambda t, f: indexer("--listen", "127.0.0.1:0", "--snapshot",
                                                      _bytes(t, "snap", b"\x93garbage")), "snap"),
    # files read whole: a device or a FIFO is refused unread (never read for ever, or waited on), a file past its
    # cap after the cap, a file the csv module chokes on by its line
    "latency fit from a device": (lambda t, f: replay("--latency", "/dev/zero")(t, f),
                                  "--latency /dev/zero: is not a regular file"),
    "latency fit from a FIFO": (lambda t, f: replay("--latency", _fifo(t, "fit.json"))(t, f),
                                "fit.json: is not a regular file"),
    "latency fit too large": (lambda t, f: replay("--latency", _sparse(t, "fit.json"))(t, f),
                              "fit.json: larger than 1,048,576 bytes"),
    "fit-latency from a device": (lambda t, f: ["fit-latency", "/dev/zero"], "/dev/zero: is not a regular file"),
    "fit-latency field past the csv limit": (lambda t, f: ["fit-latency", _bytes(
        t, "p.csv", b"kind,x,ms\nprefill," + b"1" * 200_000 + b",5\n")], "p.csv:2: field larger than field limit"),
    "fit-latency not UTF-8": (lambda t, f: ["fit-latency", _bytes(t, "p.csv", b"kind,x,ms\n\xae\n")],
                              "p.csv: not UTF-8 (invalid start byte at byte 10): expected a CSV of kind,x,ms"),
    "indexer config from a FIFO": (lambda t, f: ["indexer", "--config", _fifo(t, "svc.toml")],
                                   "svc.toml: is not a regular file"),
    "indexer config too large": (lambda t, f: ["indexer", "--config", _sparse(t, "svc.toml")],
                                 "svc.toml: larger than 1,048,576 bytes"),
    "indexer config nested too deeply": (lambda t, f: ["indexer", "--config", toml(
        t, "x = " + "[" * 10_000 + "]" * 10_000 + "\n")], "svc.toml: nested too deeply"),
    "indexer snapshot from a device": (lambda t, f: indexer("--listen", "127.0.0.1:0", "--snapshot", "/dev/zero"),
                                       "snapshot /dev/zero: is not a regular file"),
}


def _dir(tmp: Path, name: str) -> str:
    (tmp / name).mkdir(parents=True)
    return str(tmp / name)


def _socket(tmp: Path, name: str) -> str:
    """A Unix socket's file (bound, then closed: the file stays)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp / name))
    return str(tmp / name)


def _loop(tmp: Path, name: str) -> str:
    """A symbolic link to itself."""
    (tmp / name).symlink_to(name)
    return str(tmp / name)


def _fifo(tmp: Path, name: str) -> str:
    os.mkfifo(tmp / name)
    return str(tmp / name)


#: A one-request Mooncake trace, and a two-request Azure one.
_MOONCAKE_LINE = b'{"timestamp": 0, "input_length": 128, "output_length": 4, "hash_ids": [1]}\n'
_AZURE_LINES = (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                b"2023-11-16 18:15:50.9951690,396,109\n")

#: A plugin the cases above break one way each.
_PLUGIN = (b"from kvtier.indexer.routing.plugins import PolicyBase\n\n\nclass P(PolicyBase):\n    name = \"p\"\n\n"
           b"    def score(self, ctx, worker):\n        return 0.0\n\n")


def _bytes(tmp: Path, name: str, data: bytes) -> str:
    (tmp / name).write_bytes(data)
    return str(tmp / name)


def _sparse(tmp: Path, name: str) -> str:
    """64 MiB of zero bytes and no newline, written as a sparse file (nothing but its size)."""
    with open(tmp / name, "wb") as f:
        f.truncate(64 << 20)
    return str(tmp / name)


#: What the CLI says while a first start compiles the kernels (a cold numba cache, as on a fresh clone): progress
#: before the work that finds the error (a port in use, a snapshot that is garbage), not a line about the input.
NOTICES = ("kvtier: loading ", "kvtier: kernels ready after ")


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gets_one_line_and_exit_2(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             busy_port: int, busy_zmq: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build, expected = CASES[name]
    monkeypatch.chdir(tmp_path)
    argv = build(tmp_path, {"busy_port": busy_port, "busy_zmq": busy_zmq})
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code if isinstance(exc.code, int) else 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith(NOTICES)]
    assert rc == 2, (argv, err)
    assert len(err) == 1 and "error: " in err[0], err
    assert expected in err[0], err


def test_think_times_that_add_up_past_the_clock_stop_the_run_in_a_line(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Each think time is within the cap, but a closed-loop session's turns add them up, after latencies no trace
    check knows: the turn that would arrive past the latest arrival a run takes stops the run (exit 2, one error
    line after the run's banner)."""
    trace = mooncake(tmp_path, "th.jsonl", [rec(session_id="s"), rec(session_id="s", think_s=1e8)])
    assert main(["replay", "--no-plots", "--trace", trace, "--out", str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("kvtier: error: request 'r1': its session's turns and think times "
                                               "take it to 100,000,000."), err


def test_gen_trace_stops_where_arrivals_pass_the_timestamps_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A trace whose arrivals pass what a trace's timestamps may hold is refused as it is written (with --rate at
    its floor, only some ten million requests reach the real cap: it is lowered here)."""
    monkeypatch.setattr(cli_module, "MAX_TIMESTAMP_MS", 60_000.0)
    assert main(["gen-trace", "--rate", "0.01", "--requests", "5", "-o", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtier: error: --rate 0.01: request ") and "past the 60 s a trace's timestamps" in err


def test_a_caches_page_cap_counts_the_window_pool_it_makes() -> None:
    """A window pool of swa_pages 0 holds as many pages as the device: counted so (it was counted as none)."""
    over = MAX_CACHE_PAGES // 2 + 1
    assert CacheConfig(device_pages=over // 2, swa_window_pages=1, swa_pages=0).window_pool_pages == over // 2
    with pytest.raises(ConfigError, match=f"{2 * over:,} device, host and window-KV pages; a cache holds at most"):
        CacheConfig(device_pages=over, host_ratio=0.0, swa_window_pages=1, swa_pages=0)
    CacheConfig(device_pages=over, host_ratio=0.0)  # no window: no pool


def test_ctrl_c_mid_run_is_one_line_and_status_130(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C printed a KeyboardInterrupt traceback from wherever the run was."""
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "simulate", interrupted)
    assert main(["replay", *SMALL]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "kvtier: interrupted"


def test_ctrl_c_inside_a_compiled_kernel_is_one_line_and_status_130(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A Ctrl-C that lands inside a numba kernel surfaces as a SystemError ("returned a result with an exception
    set") caused by the KeyboardInterrupt: it printed that traceback and exited 1. A SystemError of its own still
    raises."""
    # (a SIGTERM there has its own line and status)
    for cause, status, line in [(KeyboardInterrupt(), 130, "kvtier: interrupted"),
                                (cli_module.Stopped(signal.SIGTERM), 143, "kvtier: stopped by SIGTERM")]:
        def interrupted(*args: object, cause: BaseException = cause, **kwargs: object) -> None:
            try:
                raise cause
            except KeyboardInterrupt as exc:
                raise SystemError("CPUDispatcher(<function strip_tokens>) returned a result with an exception set") \
                    from exc

        monkeypatch.setattr(experiment, "simulate", interrupted)
        assert main(["replay", *SMALL]) == status
        assert capsys.readouterr().err.strip().splitlines()[-1] == line

    def broken(*args: object, **kwargs: object) -> None:
        raise SystemError("a bug")

    monkeypatch.setattr(experiment, "simulate", broken)
    with pytest.raises(SystemError, match="a bug"):
        main(["replay", *SMALL])


def test_fit_latency_refuses_its_output_before_fitting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An -o in a missing directory was refused only after the fit had been printed, as if it had succeeded."""
    points = _bytes(tmp_path, "p.csv", b"kind,x,ms\nprefill,512,30\nprefill,2048,150\nprefill,8192,1000\n")
    out = tmp_path / "missing" / "fit.json"
    assert main(["fit-latency", points, "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == f"kvtier: error: -o {out}: directory {out.parent} does not exist"


@pytest.mark.parametrize(("command", "method", "says"), [
    ("replay", b"    def filter(self, ctx, workers):\n        return []\n",
     "policy 'p': filter kept [], expected a non-empty subset of the workers"),
    ("compare", b"    def pick(self, ctx, scores):\n        return 'w99'\n",
     "policy 'p': picked 'w99', not a scored worker"),
    ("replay", b"    def score(self, ctx, worker):\n        raise ValueError('no such table ' * 100)\n",
     "policy 'p': score() raised ValueError: no such table no such table"),
    ("replay", b"    def score(self, ctx, worker):\n        return float('nan')\n",
     "policy 'p': score() returned NaN for w0, w1"),
    ("replay", b"    def routed(self, keys, num_tokens, worker):\n        raise KeyError(worker)\n",
     "policy 'p': routed() raised KeyError: "),
    ("replay", b"    def score(self, ctx, worker):\n        raise SystemExit(5)\n",  # not a silent exit 5
     "policy 'p': score() raised SystemExit: 5"),
    ("replay", b"    def filter(self, ctx, workers):\n        return (w for w in workers)\n",
     "policy 'p': filter kept <generator object"),
    ("replay", b"    def pick(self, ctx, scores):\n        return list(scores)\n",  # unhashable
     "policy 'p': picked [StreamId(worker='w0', dp_rank=0), ")])
def test_a_plugin_that_fails_mid_run_gets_a_line_and_exit_2(
        command: str, method: bytes, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only routing shows it: the run has begun (its banner and progress bar are out), then one short line says what
    the plugin did (broke its protocol, or raised: its own ValueError is no bad input of the user's), on a line of
    its own, exit 2, and no traceback."""
    monkeypatch.chdir(tmp_path)
    spec = _bytes(tmp_path, "p.py", _PLUGIN + method) + ":P"
    rc = main([command, *SMALL, "--policies" if command == "compare" else "--policy", spec])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"kvtier: error: {says}") and len(err.splitlines()[-1]) < 500, err


def test_an_itl_series_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    """The runs' work is not spent first: the path is checked before any run, and nothing is left behind (no
    output directory, no part file)."""
    assert main(["replay", *SMALL, "--out", str(tmp_path / "o"), "--itl-series", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []  # no output directory, no part file


def test_an_itl_series_in_the_out_directory_a_run_makes_is_taken(tmp_path: Path) -> None:
    """--itl-series in the --out the run makes was refused ("directory ... does not exist"), where --out alone is
    made; one in a directory that nothing makes still is, with no output directory left."""
    out = tmp_path / "o"
    assert main(["replay", *SMALL, "--out", str(out), "--itl-series", str(out / "itl.jsonl")]) == 0
    assert (out / "itl.jsonl").stat().st_size > 0 and (out / "summary.json").is_file()
    assert main(["replay", *SMALL, "--out", str(tmp_path / "p"), "--itl-series", str(tmp_path / "q" / "i")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_outputs_that_are_fifos_or_links_are_not_replaced_by_a_file(tmp_path: Path) -> None:
    """Outputs were written beside their path and renamed over it: a FIFO, a device or a symbolic link given as
    ``--itl-series`` (``/dev/stdout``) or ``-o`` was replaced by a regular file (``/dev/full`` among them, run as root).
    A FIFO or a device is written through; a link keeps linking to the file it names, replaced whole."""
    fifo = tmp_path / "gaps.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["replay", *SMALL, "--out", str(tmp_path / "o"), "--itl-series", str(fifo)]) == 0
    reader.join(60)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert len(got[0].splitlines()) == 4 and got[0].startswith(b'{"policy": "kv_all"')
    (tmp_path / "real.jsonl").write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to("real.jsonl")
    assert main(["gen-trace", "--requests", "3", "-o", str(link)]) == 0
    assert link.is_symlink() and len((tmp_path / "real.jsonl").read_text().splitlines()) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gaps.fifo", "link.jsonl", "o", "real.jsonl"]


def test_a_linked_output_is_still_written_whole(tmp_path: Path) -> None:
    """Through a symbolic link, the file it names is staged and replaced (written in place, a stopped write left a
    truncated file where the old one was)."""
    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_text("old")
    link.symlink_to(target.name)
    with pytest.raises(KeyboardInterrupt), wholes([link]) as (part,):
        part.write_text("half")
        raise KeyboardInterrupt
    assert target.read_text() == "old" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "real.txt"]  # (no part left)
    with wholes([link]) as (part,):
        part.write_text("new")
    assert target.read_text() == "new" and link.is_symlink()


def test_a_file_reached_through_a_descriptor_is_written_through(tmp_path: Path) -> None:
    """``/dev/stdout``, ``/dev/stderr`` or ``/proc/self/fd/N`` with the stream redirected to a file: the file was
    replaced by a rename, and whoever else wrote to it (this process's own later lines, a supervisor's log) wrote to
    the replaced one; where the file was deleted, a file named "... (deleted)" was made. They are written through."""
    held = tmp_path / "held.txt"
    with open(held, "w") as f:
        fd_path = Path(f"/proc/self/fd/{f.fileno()}")
        link = tmp_path / "link"
        link.symlink_to(fd_path)
        with wholes([fd_path, link]) as parts:
            assert parts == [fd_path, link]
            parts[0].write_text("through")
        assert held.read_text() == "through"
        held.unlink()
        with wholes([fd_path]) as (part,):
            part.write_text("to the deleted file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # (no "held.txt (deleted)" made)


def test_a_device_is_judged_by_itself_not_by_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``-o /dev/null`` was refused for a user who cannot write to ``/dev``: a device or a FIFO is written through,
    so only it must be writable (faked here: the tests run as root, whom every directory lets write)."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    real = os.access
    monkeypatch.setattr(outpath.os, "access", lambda p, mode: Path(p) != tmp_path and real(p, mode))
    assert unwritable(fifo) is None
    assert unwritable(tmp_path / "new.txt") == f"directory {tmp_path} is not writable"


@pytest.mark.parametrize("command", ["replay", "fit-latency"])
def test_an_output_on_the_file_stdout_goes_to_is_refused(tmp_path: Path, command: str) -> None:
    """``--itl-series /dev/stdout`` (or ``fit-latency -o /dev/stdout``) with stdout redirected to a file: the output
    was written through a second opening of that file, then the results table printed over its start (or the file
    replaced, and what was printed lost)."""
    pts = tmp_path / "pts.csv"
    pts.write_text("kind,x,ms\nprefill,512,20\nprefill,2048,50\nprefill,8192,200\n")
    argv = (["replay", *SMALL, "--out", str(tmp_path / "o"), "--itl-series", "/dev/stdout"] if command == "replay"
            else ["fit-latency", str(pts), "-o", "/dev/stdout"])
    with open(tmp_path / "out.txt", "w") as out:
        r = subprocess.run([sys.executable, "-m", "kvtier", *argv], cwd=ROOT, stdout=out, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    option = "--itl-series" if command == "replay" else "-o"
    errors = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(NOTICES)]
    assert len(errors) == 1 and f"error: {option} /dev/stdout: is the file this " in errors[0], r.stderr
    assert "standard output goes to" in errors[0]
    assert not (tmp_path / "o").exists()  # (refused before --out is made)


def test_a_latency_preset_is_no_input_file_whatever_the_directory_holds(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--latency`` names a preset before a file: a file of a preset's name in the working directory is not the
    run's input, and an output may be written there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dynamo-mocker").write_text("")
    assert main(["replay", *SMALL, "--latency", "dynamo-mocker", "--out", "o", "--itl-series", "dynamo-mocker"]) == 0
    assert (tmp_path / "dynamo-mocker").read_text().startswith('{"policy": "kv_all"')


def test_through_a_real_process(tmp_path: Path) -> None:
    """The installed entry point: exit status 2 and one stderr line, for a few of the table's inputs."""
    for argv in (["replay", "--page-size", "0"], ["indexer", "--listen", "foo", "--endpoint", "w=tcp://h:1"],
                 ["engine", "--speed", "0"], ["replay", "--trace", str(tmp_path)]):
        out = subprocess.run([sys.executable, "-m", "kvtier", *argv], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and "error:" in lines[0], (argv, out.stderr)


@pytest.mark.parametrize("command", [["replay"], ["compare", "--policies", "kv_all,round_robin"],
                                     ["sweep", "--grid", "workers=2,4"]])
def test_a_stdout_that_cannot_take_the_table_loses_no_result(tmp_path: Path, command: list[str]) -> None:
    """A full or closed stdout (a pager quit early, ``> /dev/full``) failed the command before its results were
    written: they are written first, and the table that could not be printed costs a warning naming where it is."""
    out = tmp_path / "o"
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "kvtier", *command, *SMALL, "--out", str(out)], cwd=ROOT,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "kvtier: warning: the results table could not be printed (No space left on device)" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == (["sweep.csv", "sweep.json"] if command[0] == "sweep"
                                                     else ["requests.csv", "summary.json"])


def test_gen_trace_reports_its_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long trace is written with a line on stderr every GEN_PROGRESS_EVERY requests, not in silence."""
    monkeypatch.setattr(cli_module, "GEN_PROGRESS_EVERY", 2)
    assert main(["gen-trace", "--requests", "5", "-o", str(tmp_path / "t.jsonl")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["kvtier: 2 of 5 requests written", "kvtier: 4 of 5 requests written"]
    assert err[2].startswith("wrote 5 chat requests")


def test_options_that_change_nothing_get_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An option given that these runs never read (the L3 tier's with none, event-loss recovery's with no loss, an
    Azure trace's prefix groups with another trace) ran silently, reading as if it mattered; a sweep axis that may
    make it apply silences it."""
    assert main(["replay", *SMALL, "--out", str(tmp_path / "r"), "--l3-tokens", "1000", "--prefetch-policy",
                 "timeout", "--loss-burst", "3", "--prefix-groups", "2"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["kvtier: warning: --l3-tokens changes nothing without an L3 tier (--l3 disk or external)",
                      "kvtier: warning: --prefetch-policy changes nothing without an L3 tier (--l3 disk or external)",
                      "kvtier: warning: --loss-burst changes nothing without --event-loss",
                      "kvtier: warning: --prefix-groups changes nothing but with an Azure CSV trace"]
    assert main(["sweep", *SMALL, "--out", str(tmp_path / "s"), "--grid", "l3=none,disk", "--l3-tokens", "4096"]) == 0
    assert "warning: --l3-tokens" not in capsys.readouterr().err
    # The storage link's with no L3 tier, the host link's with no tier to load back from, a write or prefetch
    # policy's setting under another policy, a sliding-window model's with a full-attention one, the SLO's with none.
    assert main(["replay", *SMALL, "--out", str(tmp_path / "r2"), "--host-ratio", "0", "--storage-link",
                 "nvme-gen5", "--storage-gbps", "3", "--gpu-link", "h200", "--h2d-gbps", "9", "--no-load-back",
                 "--selective-threshold", "4", "--swa-ratio", "0.5", "--no-swa-events", "--slo-out-of-reach",
                 "price", "--sla-e2e-ms", "9000"]) == 0
    warned = [line.split("warning: ")[1] for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["--storage-link changes nothing without an L3 tier (--l3 disk or external)",
                      "--storage-gbps changes nothing without an L3 tier (--l3 disk or external)",
                      "--gpu-link changes nothing without a host or L3 tier (--host-ratio, --l3)",
                      "--h2d-gbps changes nothing without a host or L3 tier (--host-ratio, --l3)",
                      "--no-load-back changes nothing without a host or L3 tier (--host-ratio, --l3)",
                      "--selective-threshold changes nothing but with --write-policy write_through_selective",
                      "--swa-ratio changes nothing but with a sliding-window model (--model)",
                      "--no-swa-events changes nothing but with a sliding-window model (--model)",
                      "--slo-out-of-reach changes nothing without a TTFT or TPOT bound (--sla-ttft-ms, --sla-tpot-ms)"]
    assert main(["replay", *SMALL, "--out", str(tmp_path / "r3"), "--l3", "disk", "--prefetch-timeout-s",
                 "0.2"]) == 0
    warned = [line.split("warning: ")[1] for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["--prefetch-timeout-s changes nothing but with --prefetch-policy timeout"]
    # Each is silent where it applies, or where a sweep axis may make it apply.
    assert main(["replay", *SMALL, "--out", str(tmp_path / "r4"), "--l3", "disk", "--storage-gbps", "3",
                 "--write-policy", "write_through_selective", "--selective-threshold", "4", "--model",
                 "gpt-oss-20b", "--swa-ratio", "0.5", "--sla-ttft-ms", "500", "--slo-out-of-reach", "price"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["sweep", *SMALL, "--out", str(tmp_path / "s2"), "--grid", "host_ratio=0,2", "--no-load-back",
                 "--h2d-gbps", "9"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_azure_trace_without_shared_prefixes_says_nothing_can_hit(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An Azure CSV trace holds lengths only: with the default --shared-prefix-blocks 0 every prompt is unique and
    every hit rate reads 0, which ran silently. It is a warning now, silent where sharing is synthesised."""
    trace = azure(tmp_path, "a.csv", [f"2024-05-10 00:00:0{i}" for i in range(4)])
    assert main(["replay", "--trace", trace, "--limit", "20", "--no-plots", "--out", str(tmp_path / "a")]) == 0
    assert "--shared-prefix-blocks 0 (the default) no two prompts share a block" in capsys.readouterr().err
    assert main(["replay", "--trace", trace, "--limit", "20", "--no-plots", "--out", str(tmp_path / "b"),
                 "--shared-prefix-blocks", "4"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_tokens_by_index_reads_the_trace_up_to_that_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtier tokens --index N`` read (and checked) the whole trace first: 16 s and 788 MB for one record of a
    million-line file. Now the records up to N alone: a bad record past it is not read; --request still scans."""
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    trace = _bytes(tmp_path, "t.jsonl", (good * 2 + "{not json\n").encode())
    assert main(["tokens", "--trace", trace, "--index", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 10
    assert main(["tokens", "--trace", trace, "--request", "r0"]) == 2
    assert "t.jsonl:3: not JSON" in capsys.readouterr().err


# --- random argument vectors -------------------------------------------------------------------------

_VALUES = ["0", "-1", "1", "2", "nan", "inf", "-inf", "1e309", "x", "", "3.5", "true", "builtin:chat:2", "16",
           "127.0.0.1:0", "foo", "w0=tcp://127.0.0.1:1", "kv_all", "none", "disk", "99999", "a:b"]
_REPLAY_OPTS = ["--page-size", "--workers", "--device-tokens", "--host-ratio", "--l3", "--l3-tokens", "--model",
                "--write-policy", "--prefetch-policy", "--prefill-budget", "--max-running", "--h2d-gbps",
                "--storage-gbps", "--cost", "--event-delay", "--event-loss", "--recovery", "--replay-buffer",
                "--loss-burst", "--host-credit", "--disk-credit", "--temperature", "--seed", "--until", "--limit",
                "--time-scale", "--trace-seed", "--policy", "--gpu-link", "--storage-link"]
_INDEXER_OPTS = ["--endpoint", "--block-size", "--listen", "--cost", "--policy", "--snapshot"]


def _argv(opts: list[str]) -> st.SearchStrategy[list[str]]:
    pair = st.tuples(st.sampled_from(opts), st.sampled_from(_VALUES)).map(list)
    noise = st.sampled_from(["--open-loop", "--bogus", "-v", "extra"]).map(lambda s: [s])
    return st.lists(st.one_of(pair, pair, pair, noise), max_size=6).map(lambda parts: [x for p in parts for x in p])


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if rc == 2:
        lines = [line for line in err.splitlines() if line.strip() and "%" not in line]  # tqdm bars
        assert lines and "error:" in lines[-1], err


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=_argv(_REPLAY_OPTS))
def test_random_replay_arguments_never_escape_as_a_traceback(args: list[str], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _run(["replay", "--trace", "builtin:chat:3", "--no-plots", "--allow-unfinished", *args,
          "--trace", "builtin:chat:3"], capsys)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=_argv(_INDEXER_OPTS))
def test_random_indexer_arguments_never_escape_as_a_traceback(args: list[str], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    started: list[service.IndexerService] = []

    def serve(cfg: service.ServiceConfig, load: Callable[[], object]) -> None:  # what serve() checks, then stop
        load()
        svc = service.IndexerService(cfg)
        svc.start()
        started.append(svc)
        svc.stop()

    monkeypatch.setattr(service, "serve", serve)
    _run(["indexer", *args], capsys)


@pytest.mark.parametrize("how", ["Ctrl-C", "a run fails", "a join fails"])
def test_a_compare_that_stops_leaves_no_part_files(how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Each run streams its records to a hidden part of requests.csv (and of --itl-series), joined once all are
    done: a compare stopped after its first run left that run's parts behind; one stopped while joining them (a
    full disk), a summary beside a half-written requests.csv."""
    from kvtier.sim import report

    real, calls = experiment.simulate, []

    def second_stops(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2 and how != "a join fails":
            raise KeyboardInterrupt if how == "Ctrl-C" else ValueError("the run failed")
        return real(*args, **kwargs)

    def disk_full(path: Path, parts: Any, header: bytes = b"") -> None:
        path.write_bytes(header + b"half")
        raise ValueError("no space left on device")

    monkeypatch.setattr(experiment, "simulate", second_stops)
    monkeypatch.setattr(report, "join_files", disk_full)
    out, itl = tmp_path / "out", tmp_path / "itl.jsonl"
    argv = ["compare", *SMALL, "--policies", "round_robin,kv_all", "--jobs", "1", "--out", str(out),
            "--itl-series", str(itl)]
    if how == "Ctrl-C":
        assert main(argv) == 130
    else:
        with pytest.raises(ValueError, match=r"the run failed|no space left"):
            main(argv)
    assert len(calls) == 2
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("command", ["replay", "compare"])
def test_a_refused_policy_makes_no_output_directory(tmp_path: Path, command: str) -> None:
    """A policy typo is refused in one line, exit 2, and leaves nothing behind: --out was made first, an empty
    out/replay/ in the user's working directory."""
    out = tmp_path / "out"
    flag = ["--policy", "kv_al"] if command == "replay" else ["--policies", "kv_all,kv_al"]
    assert main([command, *SMALL, *flag, "--out", str(out)]) == 2
    assert not out.exists()
