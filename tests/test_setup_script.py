"""scripts/setup.sh, the install both README commands begin with, run against a stand-in for pip."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_multiprocess import ROOT, gone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_during_the_install_stops_pip_too(tmp_path: Path, sig: int, status: int) -> None:
    """Ctrl-C during a first install ended both scripts at once while pip, run in the background (where a script's
    jobs ignore Ctrl-C), went on writing into .venv: running the command again started a second pip beside it. Here
    a stand-in for pip records its pid and its child's (pip's build backend) and waits; Ctrl-C goes to the script's
    process group, as a terminal sends it, SIGTERM to the script alone, as kill sends it."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pips = tmp_path / "pips"
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/bash\nif [ "$1 $2" = "-m pip" ]; then\n    sleep 61 & echo $$ $! >> {pips}\n'
                      f'    exec sleep 60\nfi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    err = tmp_path / "err"
    with err.open("w") as log:
        proc = subprocess.Popen(["bash", "scripts/setup.sh"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (pips.exists() and pips.read_text().strip()):
            assert time.monotonic() < deadline and proc.poll() is None, err.read_text()
            time.sleep(0.05)
        started = [int(p) for p in pips.read_text().split()]
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=30) == status, err.read_text()
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in started):
            assert time.monotonic() < deadline, "pip (or what it started) went on after the stop"
            time.sleep(0.05)
        assert err.read_text().splitlines()[-1] == "kvtier: install stopped; bash scripts/setup.sh starts it again"
        assert not (tmp_path / ".venv" / "install.stamp").exists()
    finally:
        for pid in [int(p) for p in pips.read_text().split()] if pips.exists() else []:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
