"""A live engine process: replays a trace through a real EngineNode in wall-clock time.

It publishes the cache's events over ZMQ (with replay and state dumps), so an indexer
service can be tried, or tested, against real engines. Prompts are "computed" instantly.
Without ``--l3-dir`` copies complete after their modeled transfer time on the wall clock and the
L3 tier keeps metadata only; with ``--l3-dir DIR`` the engine moves real bytes (torch, on the CPU)
and keeps its L3 pages as files in DIR (``--l3 disk``: its own; ``--l3 external``: a pool several
engines share), so a restarted engine with the same ``--name`` comes back warm. When the trace is
done the process writes its residency (per tier, the event hashes it holds) as JSON and
keeps serving replay and dump requests until SIGTERM or ``--hold`` seconds.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import math
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, DataPath, ModeledDataPath, TorchDataPath
from kvtier.engine.l3.pagedir import SyncPolicy
from kvtier.engine.l3.pagefile import Layout
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.node import EngineNode
from kvtier.sim.experiment import resolve_trace
from kvtier.sim.report import whole
from kvtier.sim.trace import TIME_SCALE, Request, TokenBank
from kvtier.util.fields import Domain, OneLineParser, add_options
from kvtier.util.outpath import unwritable
from kvtier.util.signals import STOP_SIGNALS, handling
from kvtier.wire.protocol import DEFAULT_BLOCK_SIZE
from kvtier.wire.transport.publisher import DUMP_INTERVAL_S, MAX_DUMPS
from kvtier.wire.transport.subscriber import MAX_DP_RANK

#: The engine's default device capacity: CacheConfig's (one default per setting).
_DEVICE_PAGES = CacheConfig().device_pages
#: A replay says how far it is every this many seconds (a trace at --speed takes minutes).
PROGRESS_S = 15.0


def residency_json(cache: TieredCache) -> bytes:
    """``--residency``'s content: per tier name, the engine hashes of the pages held there, sorted (JSON). The
    caller holds the node's lock. O(pages)."""
    return json.dumps({t.name: sorted(hs) for t, hs in cache.residency().items()}).encode()


def write_residency(data: bytes, path: Path, stopped: Callable[[], bool]) -> None:
    """Writes ``data`` to ``path``: a file whole or not at all (a failed write leaves no part file); a FIFO through,
    without blocking: it waits for a reader, and for the reader to take what it wrote, until ``stopped()`` (a stop
    signal only sets a flag, after which a blocked call would be retried: an engine writing to a FIFO no process
    reads would outlive every SIGTERM); :class:`StoppedWrite` then. O(len(data))."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except FileNotFoundError:
        fifo = False
    if not fifo:
        with whole(path) as part:
            part.write_bytes(data)
        return
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # (ENXIO: no reader yet)
                raise
        if stopped():
            raise StoppedWrite("the engine was stopped before a process opened the FIFO to read it")
        time.sleep(0.05)
    try:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:  # the pipe is full: its reader has yet to take what is in it
                if stopped():
                    raise StoppedWrite("the engine was stopped before the FIFO's reader took it whole") from None
                select.select([], [fd], [], 0.05)
    finally:
        os.close(fd)


class StoppedWrite(Exception):
    """The engine was stopped (SIGTERM, Ctrl-C, its parent gone) while a write waited on a FIFO's reader."""


class EngineError(Exception):
    """A bad option or an unusable resource, reported as one line."""


def _memory_available() -> int | None:
    """Bytes of memory this machine can give a new allocation now (Linux's MemAvailable), or None where unknown.
    O(1)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _store(args: argparse.Namespace) -> PageStore | None:
    if args.l3 == "none":
        return None
    shared = args.l3 == "external"
    if args.l3_dir is None:
        return PageStore(args.disk_pages, shared=shared)
    try:
        layout = Layout(args.model, args.page_size, "bfloat16", kv_bytes_per_token=args.kv_bytes_per_token)
    except ValueError as exc:
        raise EngineError(f"--model: {str(exc).removeprefix('layout: ')}") from None
    if not os.path.exists(args.l3_dir):  # (a mistyped path would start cold, saying only "adopted 0 pages")
        raise EngineError(f"--l3-dir {args.l3_dir}: does not exist; make the directory first (the engine makes "
                          "only its own folders inside it)")
    try:
        store = PageStore(args.disk_pages, Path(args.l3_dir), shared=shared, layout=layout, owner=args.name,
                          sync=SyncPolicy(args.l3_sync))
    except OSError as exc:
        raise EngineError(f"--l3-dir {args.l3_dir}: {exc.strerror or exc}") from None
    st = store.stats
    print(f"engine {args.name}: L3 {store.pages_path}: adopted {st.adopted} pages; removed {st.tmp_removed} "
          f"temporary and {st.unheld_removed} unheld files; dropped {st.dropped_at_start} held pages", flush=True)
    return store


def _open(args: argparse.Namespace) -> tuple[TieredCache, EngineNode, DataPath, list[Request]]:
    if args.parent_pid is not None and os.getppid() != args.parent_pid:  # (it stopped at once, "after 0 requests")
        raise EngineError(f"--parent-pid {args.parent_pid}: not this process's parent (that is {os.getppid()})")
    problem = unwritable(args.residency) if args.residency else None
    if problem is None and args.residency and Path(args.trace).is_file() and \
            os.path.realpath(args.residency) == os.path.realpath(args.trace):
        problem = "is the --trace file the engine replays; name another file"
    if problem is not None:
        raise EngineError(f"--residency {args.residency}: {problem}")
    try:
        trace = resolve_trace(args.trace, seed=args.seed, time_scale=1.0 / args.speed)
    except (ValueError, FileNotFoundError) as exc:
        raise EngineError(str(exc)) from None
    except OSError as exc:
        raise EngineError(f"--trace {args.trace}: {exc.strerror or exc}") from None
    if args.device_tokens is not None:
        if args.device_tokens < 4 * args.page_size:
            raise EngineError(f"--device-tokens: {args.device_tokens} holds fewer than 4 pages of --page-size "
                              f"{args.page_size}")
        args.device_pages = args.device_tokens // args.page_size
    try:
        cfg = CacheConfig(page_size=args.page_size, device_pages=args.device_pages, host_ratio=args.host_ratio,
                          l3_write_behind=args.l3 != "none")
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    if args.l3 != "none" and cfg.host_pages == 0:
        raise EngineError(f"--l3 {args.l3}: needs a host tier (--host-ratio > 0)")
    if args.l3 == "external" and args.l3_dir is None:  # (a pool in this process: no other engine reads it, and an
        # indexer credits every worker with what is announced there)
        raise EngineError("--l3 external: a pool shared with other engines needs --l3-dir (the directory they share)")
    if args.l3 == "none" and args.l3_dir is not None:  # (it would be ignored: no page is ever written there)
        raise EngineError(f"--l3-dir: --l3 none keeps no L3 tier; give --l3 disk or external to keep pages in "
                          f"{args.l3_dir}")
    if args.l3_dir is not None and not args.l3_dir.strip():  # (Path("") is the working directory)
        raise EngineError("--l3-dir: an empty path; name the directory to keep L3 pages in")
    if args.l3_dir is not None and args.kv_bytes_per_token % 2:
        raise EngineError(f"--kv-bytes-per-token: {args.kv_bytes_per_token} is odd; the pages hold 2-byte (bfloat16) "
                          "elements")
    dp: DataPath
    if args.l3_dir is not None:
        if importlib.util.find_spec("torch") is None:
            raise EngineError("--l3-dir moves real KV bytes with torch, which is not installed: "
                              "pip install 'kvtier[engine]'")
        # Real bytes: a page of page_size tokens x kv_bytes_per_token, moved by torch on the CPU.
        pools = (args.device_pages + cfg.host_pages) * args.page_size * args.kv_bytes_per_token
        free = _memory_available()
        if free is not None and pools > free:
            raise EngineError(f"--l3-dir: the device and host pools (--device-pages {args.device_pages}, --host-ratio "
                              f"{args.host_ratio:g}, --kv-bytes-per-token {args.kv_bytes_per_token}) need "
                              f"{pools / 2**30:,.1f} GiB of memory, more than the {free / 2**30:,.1f} GiB available")
        try:
            dp = TorchDataPath(args.device_pages, cfg.host_pages, (args.page_size, args.kv_bytes_per_token // 2),
                               device="cpu")
        except RuntimeError as exc:  # (torch's allocation failure, where the memory available was not known)
            raise EngineError(f"--l3-dir: the device and host pools ({pools / 2**30:,.1f} GiB) could not be "
                              f"allocated: {str(exc).splitlines()[0]}") from None
    else:
        dp = ModeledDataPath(args.page_size * 1024, time.monotonic,
                             Bandwidths(d2h=2e8, h2d=2e8, storage_write=5e7, storage_read=5e7))
    store: PageStore | None = None
    try:  # (a start that fails lets go of what it made: in a process that goes on, the copy thread kept the pools)
        store = _store(args)
        cache = TieredCache(cfg, dp, store, name=args.name)
        try:
            node = EngineNode(cache, args.endpoint, args.replay, dp_rank=args.dp_rank,
                              dump_interval_s=args.dump_interval, max_dumps=args.max_dumps)
        except (zmq.ZMQError, ValueError) as exc:  # (ValueError: an address no socket could bind)
            raise EngineError(f"cannot bind {args.endpoint} / {args.replay}: {exc}") from None
    except BaseException:
        _close(dp, store)
        raise
    return cache, node, dp, trace


def _close(dp: DataPath, store: PageStore | None) -> None:
    """Stops the copy thread of a real data path (which holds its pools) and lets go of the L3 store's directory."""
    if isinstance(dp, TorchDataPath):
        dp.close()
    if store is not None:
        store.close()


def run(args: argparse.Namespace) -> int:
    """Replays the trace, then serves replay and dump requests until ``--hold`` ends or SIGTERM (or Ctrl-C, or
    SIGHUP unless ignored) comes: a clean stop either way. The process's own handlers of those signals are back when
    this returns (an engine run in a process that goes on, such as a test's or a notebook's, leaves no handler behind
    that swallows them)."""
    stop = {"now": False, "signal": False}
    # A supervisor's stop, Ctrl-C, or the terminal closed: the same clean stop (nohup's SIGHUP stays ignored).
    with handling((signal.SIGINT, *STOP_SIGNALS), lambda *_: stop.update(now=True, signal=True)):
        return _serve(args, stop)


def _serve(args: argparse.Namespace, stop: dict[str, bool]) -> int:
    def halted() -> bool:
        """SIGTERM came, or (``--parent-pid``) the process that started this one died: it was adopted."""
        if args.parent_pid is not None and os.getppid() != args.parent_pid:
            stop["now"] = True
        return stop["now"]

    try:
        cache, node, dp, trace = _open(args)
    except EngineError as exc:
        print(f"kvtier engine: error: {exc}", file=sys.stderr)
        return 2
    bank = TokenBank(seed=args.seed)
    span = trace[-1].arrival if trace else 0.0
    print(f"engine {args.name}: publishing on {node.publisher.endpoint}, replay {node.publisher.replay_endpoint}, "
          f"{len(trace)} requests over {span:.1f} s at --speed {args.speed:g}", flush=True)
    t0 = said = time.monotonic()
    done = too_long = 0  # requests replayed; prompts that could not be cached (longer than the device holds)
    rc = 0
    try:
        for req in trace:
            while not halted() and time.monotonic() - t0 < req.arrival:
                node.step()
                time.sleep(0.002)
            if halted():
                break
            with node.lock:
                adm = cache.admit(req.request_id, bank.packed(req))
            admitted = time.monotonic()
            # Its prefix's load-backs (and L3 prefetch, per the policy) land first: else the prefill recomputes the
            # loading prefix and the pages past it stay uncached.
            while not halted():
                with node.lock:
                    if cache.ready(adm, admitted, time.monotonic()):
                        break
                node.step()
                time.sleep(0.002)
            with node.lock:
                plan = None if halted() else cache.begin_prefill(adm, last_resort=not dp.ops)
            # Copies in flight (backups to host, writes to L3) hold device pages until polled, and a replay behind its
            # schedule never waits above: a prompt that finds no room waits for them to land. Then it is alone on
            # the engine, and only a prompt the device cannot hold finds none.
            while plan is None and dp.ops and not halted():
                node.step()
                time.sleep(0.002)
                with node.lock:
                    plan = cache.begin_prefill(adm, last_resort=not dp.ops)
            with node.lock:
                if plan is not None:
                    cache.finish_prefill(adm)
                elif not halted():
                    too_long += 1
                cache.release(adm)
            node.flush()
            done += 1
            if time.monotonic() - said >= PROGRESS_S:
                said = time.monotonic()
                print(f"engine {args.name}: {done} of {len(trace)} requests served after {said - t0:.0f} s",
                      flush=True)
        while dp.ops and not halted():
            node.step()
            time.sleep(0.002)
        node.step()
        if args.residency:
            try:
                with node.lock:
                    data = residency_json(cache)
                write_residency(data, Path(args.residency), halted)
            except (OSError, StoppedWrite) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                print(f"kvtier engine: error: --residency {args.residency}: {why}", file=sys.stderr, flush=True)
                rc = 2
        if done < len(trace):
            print(f"engine {args.name}: stopped after {done} of {len(trace)} requests", file=sys.stderr, flush=True)
        else:
            device = cache.config.device_pages * cache.config.page_size
            skipped = (f"{too_long} of {done} prompts did not fit the device ({device:,} tokens) and were not "
                       "cached; ") if too_long else ""
            failed = cache.l3.write_failures if cache.l3 is not None else 0
            if failed:  # (a full disk: each batch logged sparsely above, the pages kept off the L3 tier)
                skipped += f"{failed} copy batches to L3 failed and their pages were not stored there; "
            serving = ("stopping, as asked" if halted() else "serving replay and dump requests "
                       + ("until SIGTERM" if math.isinf(args.hold) else f"for {args.hold:g} s more (--hold)"))
            print(f"engine {args.name}: trace done; {skipped}{serving}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + args.hold
        while not halted() and time.monotonic() < deadline:
            time.sleep(0.02)  # the publisher's thread keeps answering replay and dump requests
    finally:
        node.close()
        _close(dp, cache.store)
        if cache.store is not None:
            if cache.store.directory is not None:
                failed = cache.l3.write_failures if cache.l3 is not None else 0
                print(f"engine {args.name}: L3 {cache.store.stats}, write_failures={failed}", flush=True)
            cache.store.close()
    if stop["signal"]:
        _exit_now(rc)
    return rc


def _exit_now(code: int) -> None:
    """Ends the process once SIGTERM asked for it and the engine has let go of what it held (sockets, page files).

    What is left, the interpreter's teardown of every loaded module, does nothing an engine needs and takes seconds
    where torch is loaded (``--l3-dir``); a supervisor that sent SIGTERM waits for the exit, so it is skipped,
    as SIGTERM's default action would skip it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hold(text: str) -> float:
    """``--hold``: seconds >= 0, or ``inf`` (numbers read by :class:`Domain` are finite)."""
    return math.inf if text.strip().lower() in ("inf", "infinity") else float(Domain(float, lo=0).parse(text))


def _engine_name(text: str) -> str:
    """``--name``: the worker id an indexer names this engine by, and its L3 owner directory."""
    if not text or "/" in text or text.startswith("."):  # (an L3 directory's own files start with '.')
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; expected a non-empty name without '/' that does "
                                         "not start with '.'")
    return text


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or OneLineParser(prog="kvtier engine", description=__doc__)
    count = Domain(int, lo=1)
    p.add_argument("--name", type=_engine_name, default="w0", help="engine name (the worker id an indexer should use)")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind")
    p.add_argument("--replay", default="tcp://127.0.0.1:5558", help="ROUTER replay endpoint to bind")
    p.add_argument("--dp-rank", type=Domain(int, lo=0, hi=MAX_DP_RANK).parse, default=None,
                   help="data-parallel rank carried in each batch")
    p.add_argument("--dump-interval", type=Domain(float, lo=0).parse, default=DUMP_INTERVAL_S,
                   help="least seconds between two state dumps answered to one peer of the replay socket; a "
                        "request sooner gets the end marker alone, which indexers read as no dump (0: no limit)")
    p.add_argument("--max-dumps", type=count.parse, default=MAX_DUMPS,
                   help="most state dumps in progress at once; a request past it is refused the same way")
    p.add_argument("--trace", default="builtin:chat:300",
                   help="trace file or builtin:chat|agentic|sysprompt[:N] (N requests; builtin:KIND alone: 1,000)")
    p.add_argument("--seed", type=Domain(int, lo=0).parse, default=0, help="seed of builtin traces and token ids")
    p.add_argument("--speed", type=TIME_SCALE.parse, default=10.0, help="replay speed-up over the trace's timestamps")
    add_options(p, CacheConfig, ["page_size"])
    device = p.add_mutually_exclusive_group()
    device.add_argument("--device-tokens", type=count.parse, default=None,
                        help="device KV capacity in tokens, as the simulator's --device-tokens (rounded down to "
                             "whole pages of --page-size; at least 4 pages) (default: --device-pages x --page-size, "
                             f"{_DEVICE_PAGES * DEFAULT_BLOCK_SIZE:,} at their defaults)")
    device.add_argument("--device-pages", type=Domain(int, lo=4).parse, default=_DEVICE_PAGES,
                        help="the same capacity in pages of --page-size tokens (the engine's native unit)")
    add_options(p, CacheConfig, ["host_ratio"])
    p.add_argument("--l3", choices=["none", "disk", "external"], default="disk",
                   help="storage tier: this engine's disk, or a pool shared with other engines (in --l3-dir)")
    p.add_argument("--disk-pages", type=count.parse, default=16384,
                   help="L3 capacity in pages of --page-size tokens (the simulator's --l3-tokens counts tokens)")
    p.add_argument("--l3-dir", help="keep L3 pages as files here (real bytes, warm restarts); without it the L3 "
                                    "tier is modeled (metadata only)")
    p.add_argument("--l3-sync", choices=[s.value for s in SyncPolicy], default=SyncPolicy.NONE.value,
                   help="when page files are forced to disk: never, per page, or per copy batch")
    p.add_argument("--model", default="kvtier-live", help="model name in the L3 layout (pages of other models "
                                                          "sharing --l3-dir are never served)")
    p.add_argument("--kv-bytes-per-token", type=Domain(int, lo=2).parse, default=1024,
                   help="KV bytes per token with --l3-dir (the page files' size; even: bfloat16 elements)")
    p.add_argument("--residency", help="write the final residency as JSON here: per tier, the engine hashes of the "
                                       "pages held there (docs/outputs.md)")
    p.add_argument("--hold", type=_hold, default=math.inf,
                   help="seconds to keep serving replay and dump requests after the trace, or inf: until SIGTERM, "
                        "as a real engine keeps serving (default: inf)")
    p.add_argument("--parent-pid", type=Domain(int, lo=1).parse, default=None,
                   help="exit once this process is no longer this one's parent (it died): for test harnesses, "
                        "so that engines never outlive a run that crashed")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
