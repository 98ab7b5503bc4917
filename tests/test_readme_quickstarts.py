"""The README's quick starts run as written (scripts/readme_quickstart.py executes its ```bash quickstart-NAME
blocks), print what the README says they print, and leave nothing running."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "readme_quickstart.py"
OPERATOR_PORTS = (5557, 5558, 5567, 5568, 8077)


def _run(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: past connections' TIME_WAIT is no use
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_readme_has_both_quick_starts() -> None:
    out = _run("--list")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["researcher", "operator"]


def test_a_failing_block_fails_the_run(tmp_path: Path) -> None:
    """The runner is what CI trusts: a block that fails part-way fails it, naming the block, and nothing after the
    failing command runs (-e); a failure inside a pipeline counts too (pipefail)."""
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```bash quickstart-good\necho fine\n```\n\n"
                      "```bash quickstart-bad\necho before\nfalse | cat\necho after\n```\n\n"
                      "```bash\nexit 3  # not a quick start: never run\n```\n")
    out = _run("--readme", str(readme), "--cwd", str(tmp_path))
    assert out.returncode == 1
    assert "failed: bad" in out.stderr and "good" not in out.stderr
    assert "fine\n" in out.stdout and "before\n" in out.stdout and "after\n" not in out.stdout
    assert _run("--readme", str(readme), "--cwd", str(tmp_path), "good").returncode == 0
    missing = _run("--readme", str(readme), "nosuch")
    assert missing.returncode == 2 and "no quick start nosuch" in missing.stderr


def test_a_block_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("```bash quickstart-slow\nsleep 300 &\necho $! > bg.pid\nsleep 300\n```\n")
    out = _run("--readme", str(readme), "--cwd", str(tmp_path), "--timeout", "3", timeout=60)
    assert out.returncode == 1 and "killed after 3 s" in out.stdout
    bg = int((tmp_path / "bg.pid").read_text())
    assert not Path(f"/proc/{bg}").exists() or "zombie" in Path(f"/proc/{bg}/status").read_text().lower()


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.mark.parametrize("how", ["interrupt", "reader gone"])
def test_an_interrupted_run_stops_what_its_block_started(tmp_path: Path, how: str) -> None:
    """Ctrl-C reaches the runner alone (the block has a session of its own), and a transcript piped to a reader that
    goes away (``| head``) ends it too: either way the block's servers, which would run on holding their ports, are
    stopped with the runner."""
    readme = tmp_path / "README.md"
    readme.write_text("```bash quickstart-servers\nsleep 300 &\necho $! > bg.pid\necho started\n"
                      "while true; do echo serving; sleep 0.05; done\n```\n")
    runner = subprocess.Popen([sys.executable, str(SCRIPT), "--readme", str(readme), "--cwd", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert runner.stdout is not None
        for line in runner.stdout:  # the block is under way, its server started
            if line == b"started\n":
                break
        bg = int((tmp_path / "bg.pid").read_text())
        assert not _gone(bg)
        if how == "interrupt":
            runner.send_signal(signal.SIGINT)
            assert runner.wait(timeout=30) == 130
            assert runner.stderr is not None and b"interrupted" in runner.stderr.read()
        else:
            runner.stdout.close()  # its next transcript line meets a broken pipe
            assert runner.wait(timeout=30) != 0
        deadline = time.monotonic() + 10.0
        while not _gone(bg):
            assert time.monotonic() < deadline, "the block's server still runs"
            time.sleep(0.05)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


@pytest.mark.slow
def test_researcher_quick_start() -> None:
    out = _run("researcher")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr
    text = out.stdout
    for policy in ("round_robin", "kv_device", "kv_host", "dynamo", "min_ttft"):
        assert re.search(rf"^{policy} +hit 0\.\d{{3}}  TTFT p90 \d+ ms$", text, re.MULTILINE), policy
    assert "KVTIER_NB_SIZE=small: the small CI size" in text and "Headline numbers (KVTIER_NB_SIZE=small;" in text
    # The plugin appears under its declared name, beside the built-in policy.
    runs = json.loads((ROOT / "out" / "quickstart" / "plugin" / "summary.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["kv_host", "cached_then_idle"]
    assert re.search(r"^cached_then_idle +500 ", text, re.MULTILINE)
    assert (ROOT / "out" / "quickstart" / "hit_rate_by_tier.png").stat().st_size > 0


@pytest.mark.slow
def test_operator_quick_start() -> None:
    busy = [p for p in OPERATOR_PORTS if not _port_free(p)]
    if busy:
        pytest.fail(f"the operator quick start binds fixed ports; these are in use: {busy}")
    out = _run("operator")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr
    answers = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            body = json.loads(line)
            answers.setdefault(next(iter(body)), body)
    health, query = answers["status"], answers["total_blocks"]
    assert health["status"] == "ok" and health["workers"] == 2
    # The prompt engine a served is cached there to its full length, on b not at all: a real hit.
    a, b = query["workers"]["a"], query["workers"]["b"]
    assert query["total_blocks"] > 0 and a["device"] == query["total_blocks"] and b["host"] == 0
    assert query["recommended"] == "a"
    routed = next(json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith('{"total_blocks"') and
                  '"request_id"' in ln)
    assert routed["worker"] == "a" and routed["predicted"]["ttft_ms"] > 0
    assert answers["request_id"]["in_flight"] is True  # the first-token report found the booking
    assert re.search(r"^kvtier_events_rejected_total\{worker=\"a\"\} 0$", out.stdout, re.MULTILINE)
    assert re.search(r"^kvtier_ttft_prediction_error_seconds_count 1$", out.stdout, re.MULTILINE)
    # The block's trap stopped the engines and the indexer: every port is free again.
    assert [p for p in OPERATOR_PORTS if not _port_free(p)] == []


def test_the_operator_quick_start_run_with_plain_bash_stops_when_a_server_fails(tmp_path: Path) -> None:
    """Saved to a file and run with ``bash`` (no ``-e``, as the README offers), the block went on past a server that
    did not start (its port taken) and exited 0 after querying an index that never caught up. It stops there with a
    non-zero status."""
    import zmq

    sys.path.insert(0, str(ROOT / "scripts"))
    from readme_quickstart import quickstarts

    busy = [p for p in OPERATOR_PORTS if not _port_free(p)]
    if busy:
        pytest.fail(f"the operator quick start binds fixed ports; these are in use: {busy}")
    body = quickstarts((ROOT / "README.md").read_text())["operator"]
    script = tmp_path / "operator.sh"
    script.write_text(body)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind("tcp://127.0.0.1:5557")  # engine a's port, taken
    try:
        out = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        holder.close(linger=0)
        ctx.term()
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "quickstart: a server exited" in out.stdout
    assert "total_blocks" not in out.stdout  # (no query was asked of an index that never caught up)
    assert [p for p in OPERATOR_PORTS if not _port_free(p)] == []
