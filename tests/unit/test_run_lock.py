"""`titanlite check` refuses a one-node launch on a run folder that a live job of this host holds, at once,
and lets one through that a dead job left behind (the launcher then takes that lock over)."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO, env
from titanlite.base.errors import ConfigError
from titanlite.components import run_lock


def lock(run_dir, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": pid, "job": "launcher 1", "started": "2026-11-24 06:00:00"}
    (run_dir / run_lock.LOCK_FILE).write_text(json.dumps(holder))


def test_a_live_holder_is_refused_and_a_dead_one_is_not(tmp_path):
    run_lock.check_free(tmp_path / "free")  # no lock
    lock(tmp_path / "busy", os.getpid())
    with pytest.raises(ConfigError, match=r"is in use by another job \(pid \d+ on .*, since 2026-11-24 06:00:00\)"):
        run_lock.check_free(tmp_path / "busy")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock(tmp_path / "stale", dead.pid)
    run_lock.check_free(tmp_path / "stale")


def test_check_stops_a_second_launch_in_one_line(tmp_path):
    lock(tmp_path / "run", os.getpid())
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "check", "--job.dump_folder", str(tmp_path)]
    proc = subprocess.run([*cmd, "--job.name", "run"], cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"titanlite: error: the run folder {tmp_path / 'run'} is in use by another job")
