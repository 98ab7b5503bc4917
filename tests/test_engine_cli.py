"""`kvtier engine` as a process: its capacity named as the simulator names it, and a prompt stop on SIGTERM."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.cache import Admission, PrefillPlan, TieredCache
from kvtier.sim import live

ROOT = Path(__file__).resolve().parent.parent

# The engine as `kvtier engine` runs it, in a process whose interpreter teardown takes a minute: an exit handler
# stands in for the modules (torch's among them) whose finalisation takes seconds.
_SLOW_TEARDOWN = ("import atexit, sys, time; atexit.register(time.sleep, 60); "
                  "from kvtier.sim.cli import main; sys.exit(main(sys.argv[1:]))")


@contextlib.contextmanager
def _engine(*argv: str) -> Iterator[subprocess.Popen[str]]:
    """``kvtier engine`` with ``argv`` on free ports, in a process whose teardown is slow (killed if left running)."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TEARDOWN, "engine", "--endpoint", "tcp://127.0.0.1:0",
                             "--replay", "tcp://127.0.0.1:0", *argv],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_exits_soon_after_sigterm_without_the_interpreter_teardown(tmp_path: Path) -> None:
    res = tmp_path / "res.json"
    with _engine("--trace", "builtin:sysprompt:5", "--speed", "1000", "--residency", str(res)) as proc:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the engine's one stderr line once the trace is done (waits for it)
        assert "trace done" in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        # A loose bound: the stop itself takes well under a second; the teardown this skips takes 60 s.
        rc = proc.wait(timeout=10)
        assert rc == 0
        assert res.is_file()  # what the engine writes before it serves on was written, and the exit was clean


def _opened_device_pages(*argv: str) -> int:
    args = live.build_parser().parse_args(
        ["--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--trace", "builtin:chat:2", *argv])
    cache, node, _, _ = live._open(args)
    node.close()
    return cache.config.device_pages


def test_device_tokens_sizes_the_engine_as_the_simulator_does() -> None:
    """``--device-tokens`` counts tokens, rounded down to whole pages as ``ClusterConfig`` does; ``--device-pages``
    stays the same capacity in pages."""
    assert _opened_device_pages("--device-tokens", "32768") == 512  # 64-token pages, CacheConfig's default
    assert _opened_device_pages("--device-tokens", "32768", "--page-size", "16") == 2048
    assert _opened_device_pages("--device-tokens", "1000", "--page-size", "64") == 15
    assert _opened_device_pages("--device-pages", "2048") == 2048
    assert _opened_device_pages() == 1024  # CacheConfig's default: one default per setting


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    args = live.build_parser().parse_args(["--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
                                           "--hold", "0", *argv])
    rc = live.run(args)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("outcome", ["served", "refused"])
def test_an_engine_run_in_process_gives_back_the_signal_handlers(outcome: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The engine stops cleanly on SIGTERM and Ctrl-C through handlers of its own; run inside a process that goes on
    (a test's, a notebook's), it left them installed, so that process ignored Ctrl-C and SIGTERM from then on (and
    so did every worker a process pool forked from it)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    argv = ("--trace", "builtin:chat:2") if outcome == "served" else ("--trace", "builtin:chat:2", "--l3", "external")
    rc, _ = _run(capsys, *argv)
    assert rc == (0 if outcome == "served" else 2)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_device_tokens_below_four_pages_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--device-tokens", "192")
    assert rc == 2
    assert err == "kvtier engine: error: --device-tokens: 192 holds fewer than 4 pages of --page-size 64\n"


def test_hold_takes_seconds_or_inf(capsys: pytest.CaptureFixture[str]) -> None:
    """``--hold inf`` is the default spelled out; it was refused as "not allowed; expected a number in [0, inf]"."""
    parse = live.build_parser().parse_args
    assert parse(["--hold", "inf"]).hold == parse([]).hold == math.inf
    assert parse(["--hold", "2.5"]).hold == 2.5
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse(["--hold", bad])
        assert "argument --hold" in capsys.readouterr().err


def test_device_tokens_and_pages_are_one_choice() -> None:
    with pytest.raises(SystemExit) as info:
        live.build_parser().parse_args(["--device-tokens", "32768", "--device-pages", "2048"])
    assert info.value.code == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_ctrl_c_mid_trace_stops_the_engine_cleanly_and_says_where(tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT) stops the engine as SIGTERM does: no traceback, exit 0, the residency written; and a trace cut
    short is not reported done but stopped, after how many of its requests. So does SIGHUP (the terminal closed),
    which skipped the clean stop and the residency."""
    res = tmp_path / "res.json"
    with _engine("--trace", "builtin:chat:300", "--speed", "1", "--residency", str(res)) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # published: the trace is being replayed (300 requests take minutes)
        assert "publishing on" in line, line + proc.stderr.read()
        proc.send_signal(sig)
        rc = proc.wait(timeout=10)
        err = proc.stderr.read()
        assert rc == 0 and "Traceback" not in err, err
        assert re.fullmatch(r"engine w0: stopped after \d+ of 300 requests\n", err), err
        assert res.is_file()


def test_a_residency_fifo_no_one_reads_does_not_outlive_sigterm(tmp_path: Path) -> None:
    """``--residency`` naming a FIFO that no process reads: opening it to write would wait for a reader, and the
    engine's SIGTERM handler only sets a flag, after which such a call goes back to waiting. One SIGTERM, whether it
    comes while the trace is replayed or while the engine waits for a reader, stops the engine, and the line says
    the residency was not written."""
    fifo = tmp_path / "res.fifo"
    os.mkfifo(fifo)
    with _engine("--trace", "builtin:chat:2", "--speed", "1000", "--hold", "0", "--residency", str(fifo)) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # its signal handlers are in place
        assert "publishing on" in line, line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the engine outlived SIGTERM while writing its residency") from None
        err = proc.stderr.read()
        assert rc == 2 and "Traceback" not in err, err
        assert re.search(rf"kvtier engine: error: --residency {re.escape(str(fifo))}: the engine was stopped before "
                         r"a process opened the FIFO to read it\n", err), err


def test_a_residency_fifo_is_written_through_once_a_reader_opens_it(tmp_path: Path) -> None:
    """A FIFO's reader that opens it after the trace is done gets the whole residency; the engine waits for it."""
    fifo = tmp_path / "res.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "engine", "--endpoint", "tcp://127.0.0.1:0", "--replay",
                             "tcp://127.0.0.1:0", "--trace", "builtin:chat:2", "--speed", "1000", "--hold", "0",
                             "--residency", str(fifo)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with open(fifo, "rb") as reader:  # (waits for the engine to open it)
            data = json.loads(reader.read())
        assert proc.wait(timeout=60) == 0
        assert set(data) >= {"DEVICE"} and data["DEVICE"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prompts_that_do_not_fit_the_device_are_counted_not_dropped_silently(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(capsys, "--trace", "builtin:agentic:5", "--device-tokens", "4096", "--l3", "none")
    assert rc == 0
    assert re.search(r"trace done; [1-5] of 5 prompts did not fit the device \(4,096 tokens\) and were not cached",
                     err), err


def test_a_replay_behind_its_schedule_caches_every_prompt_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """A replay behind its schedule (a high --speed, a slow machine) never waited for an arrival, so the engine's
    copies to host were never polled: their device pages stayed held, and prompts the device holds easily were
    counted as not fitting it and left uncached (101 of 120 at --speed 1000). The longest prompt here is 4,294
    tokens, the device 12,800."""
    rc, err = _run(capsys, "--trace", "builtin:sysprompt:120", "--device-pages", "200", "--host-ratio", "1",
                   "--speed", "100000")
    assert rc == 0 and err == "engine w0: trace done; serving replay and dump requests for 0 s more (--hold)\n", err


def test_a_prompt_waits_for_its_prefix_to_load_back_before_its_prefill(capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine began each prefill as soon as it admitted the request, while the prefix it found on host (or in
    L3) was still loading back: the prefill recomputed it, and every page past the loading node was left uncached
    and unannounced (at --device-tokens 16384, 301 prefills of this trace began early). A prefill now begins once
    its load-backs and, per the prefetch policy, its L3 prefetch have landed."""
    seen = {"loads": 0, "prefetches": 0, "early": 0, "dropped": 0}
    admit, begin, finish = TieredCache.admit, TieredCache.begin_prefill, TieredCache.finish_prefill

    def admitted(cache: TieredCache, *a: Any, **k: Any) -> Admission:
        adm = admit(cache, *a, **k)
        seen["loads"] += bool(cache.waiting_for(adm))
        seen["prefetches"] += adm.prefetch_op is not None
        return adm

    def begun(cache: TieredCache, adm: Admission, *a: Any, **k: Any) -> PrefillPlan | None:
        seen["early"] += bool(cache.waiting_for(adm)) or adm.prefetch_op is not None
        return begin(cache, adm, *a, **k)

    def finished(cache: TieredCache, adm: Admission, *a: Any, **k: Any) -> None:
        seen["dropped"] += any(n.device is None and n.loading is not None for n in cache.tree.match(adm.tokens))
        finish(cache, adm, *a, **k)

    monkeypatch.setattr(TieredCache, "admit", admitted)
    monkeypatch.setattr(TieredCache, "begin_prefill", begun)
    monkeypatch.setattr(TieredCache, "finish_prefill", finished)
    rc, _ = _run(capsys, "--trace", "builtin:chat:120", "--speed", "1000", "--device-tokens", "16384")
    assert rc == 0
    assert seen["loads"] >= 20 and seen["prefetches"] >= 5, seen  # both kinds of load were there to wait for
    assert seen["early"] == seen["dropped"] == 0, seen


def test_a_start_that_fails_lets_go_of_its_copy_thread_and_pools(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    """An endpoint that could not be bound failed the start after the real data path was made: its copy thread, and
    with it both KV pools, stayed alive in a process that goes on (a test's, a notebook's), one set a failed start."""
    import socket
    import threading

    def copy_threads() -> int:
        return sum(t.name == "kv-copy" for t in threading.enumerate())

    before = copy_threads()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = live.build_parser().parse_args([
            "--endpoint", f"tcp://127.0.0.1:{busy.getsockname()[1]}", "--replay", "tcp://127.0.0.1:0", "--hold", "0",
            "--trace", "builtin:chat:2", "--l3-dir", str(tmp_path), "--device-pages", "16", "--host-ratio", "1",
            "--kv-bytes-per-token", "8"])
        assert live.run(args) == 2
    assert "cannot bind" in capsys.readouterr().err
    assert copy_threads() == before
    rc, _ = _run(capsys, "--trace", "builtin:chat:2", "--l3-dir", str(tmp_path), "--device-pages", "16",
                 "--host-ratio", "1", "--kv-bytes-per-token", "8")  # the same owner's directory, held no more
    assert rc == 0 and copy_threads() == before


def test_an_external_pool_without_a_directory_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --l3-dir an engine's pool lives in its process: no other engine could read what it announces as
    EXTERNAL, which an indexer credits to every worker."""
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--l3", "external")
    assert rc == 2
    assert err == ("kvtier engine: error: --l3 external: a pool shared with other engines needs --l3-dir (the "
                   "directory they share)\n")


def test_a_residency_that_cannot_be_written_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A path the start-up check passes but the write refuses (/proc takes no new files, even from root) is named as
    the option, not as the temporary file the write used."""
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--l3", "none", "--residency", "/proc/kvtier-res.json")
    assert rc == 2
    assert [line for line in err.splitlines() if line.startswith("kvtier engine: error: ")] == [
        "kvtier engine: error: --residency /proc/kvtier-res.json: No such file or directory"], err
    assert "Traceback" not in err and ".res-" not in err
    (tmp_path / "f").write_text("")
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--residency", str(tmp_path / "f" / "x.json"))
    assert rc == 2 and err == f"kvtier engine: error: --residency {tmp_path / 'f' / 'x.json'}: {tmp_path / 'f'} " \
                              "is not a directory\n"


def test_a_residency_write_that_fails_leaves_nothing_and_one_that_succeeds_follows_the_umask(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk failed the write after its temporary file was made, and the file stayed; a residency written was
    mode 0600 whatever the umask (the temporary file's mode, kept by the rename)."""
    real = Path.write_bytes

    def full(self: Path, *args: Any, **kwargs: Any) -> int:
        real(self, b"")  # made, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    res = tmp_path / "r.json"
    monkeypatch.setattr(Path, "write_bytes", full)
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--l3", "none", "--residency", str(res))
    assert rc == 2 and f"kvtier engine: error: --residency {res}: No space left on device" in err, err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    umask = os.umask(0o022)
    try:
        rc, _ = _run(capsys, "--trace", "builtin:chat:2", "--l3", "none", "--residency", str(res))
    finally:
        os.umask(umask)
    assert rc == 0 and stat.S_IMODE(res.stat().st_mode) == 0o644
    assert set(json.loads(res.read_text())) == {"DEVICE", "HOST", "DISK", "EXTERNAL"}


def test_l3_writes_that_fail_are_said_at_the_end(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A full L3 disk fails every write: the log said they were "counted in write_failures", a count the engine then
    printed nowhere, and the run ended as any other."""
    from kvtier.engine.l3 import pagedir

    def full(*args: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pagedir, "encode", full)
    rc = live.run(live.build_parser().parse_args([
        "--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--hold", "0", "--trace", "builtin:chat:20",
        "--speed", "1000", "--device-pages", "128", "--l3-dir", str(tmp_path)]))
    out, err = capsys.readouterr()
    assert rc == 0
    failed = re.search(r"trace done; .*?(\d+) copy batches to L3 failed and their pages were not stored there; ", err)
    assert failed and int(failed.group(1)) > 0, err
    assert f"write_failures={failed.group(1)}" in out, out


def test_an_odd_kv_bytes_per_token_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The page files hold 2-byte (bfloat16) elements: an odd byte count cannot be their size, so it is refused,
    not rounded down."""
    rc, err = _run(capsys, "--trace", "builtin:chat:2", "--l3-dir", str(tmp_path), "--kv-bytes-per-token", "3")
    assert rc == 2
    assert err == "kvtier engine: error: --kv-bytes-per-token: 3 is odd; the pages hold 2-byte (bfloat16) elements\n"


def test_l3_pages_of_another_kv_size_live_apart(tmp_path: Path) -> None:
    """The KV size per token is part of the L3 layout: an engine started with another ``--kv-bytes-per-token`` over
    the same ``--l3-dir`` opens a directory of its own, and one started with an empty ``--model`` is one line."""
    def store_dir(*argv: str) -> Path | None:
        args = live.build_parser().parse_args(
            ["--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--l3", "disk", "--l3-dir",
             str(tmp_path), "--page-size", "16", *argv])
        store = live._store(args)
        assert store is not None
        store.close()
        return store.pages_path

    small, big = store_dir("--kv-bytes-per-token", "64"), store_dir("--kv-bytes-per-token", "128")
    assert small is not None and big is not None and small.parent != big.parent
    assert small == store_dir("--kv-bytes-per-token", "64")
    with pytest.raises(live.EngineError, match=r"^--model: the model name must not be empty$"):
        store_dir("--model", "")


def test_a_long_trace_says_how_long_it_takes_and_how_far_it_is(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The first line gives the trace's span at --speed, and a line every PROGRESS_S says how far the replay is: the
    README's engine example was silent for 44 s between its first line and 'trace done'."""
    monkeypatch.setattr(live, "PROGRESS_S", 0.0)
    args = live.build_parser().parse_args(["--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0",
                                           "--hold", "0", "--trace", "builtin:chat:3", "--speed", "1000"])
    assert live.run(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^engine w0: publishing on .*, 3 requests over \d+\.\d s at --speed 1000$", out, re.M), out
    assert re.search(r"^engine w0: 3 of 3 requests served after \d+ s$", out, re.M), out
