"""Fault-injection survey: what a demanding user does to a run, and whether titanlite survives it.

    .venv/bin/python scripts/fault_survey.py [--part all|faults|inputs] [--only TEXT] [--output survey.json]

Faults: kills, signals (SIGHUP and SIGSTOP too), damaged checkpoints, a full disk, a read-only or busy run
folder, a half-written file of the run folder (metrics.jsonl, the lock, markers, checksums), a lock whose pid
another process reuses, divergence, changed settings on resume. A fault is survived when the run ends as it
should (exit status, one last line) and, where it goes on, its losses equal an uninterrupted run's bit for bit
(nothing lost beyond the last checkpoint).
Bad inputs (config files that are not text, names and paths that are valid strings but wrong among them, dataset
folders with a dangling symlink or a bad file, rendezvous endpoints that never answer): each must end in one
`titanlite: error:` line, exit 2, no traceback, nothing written. Inputs that look odd but are fine (a symlinked
dataset subfolder) must train, and say what they left out. --only runs the cases whose name
holds TEXT (or one of several, comma-separated).
Every case runs ./run_train.sh for real (CPU, gloo, the debug model at seq 32); about 30 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' helpers: tiny random transformers models, a port that never answers
from tests.helpers import last_wins  # noqa: E402 (after the path that finds it)

BASE = [
    "--training.seq_len",
    "32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.steps",
    "12",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "4",
]
LAYOUTS = {1: ["--training.local_batch_size", "8"], 2: ["--training.local_batch_size", "4"]}


class Skipped(Exception):
    """A case left out by --only."""


def skippable(case):
    """A case that --only may leave out (its folder() raises Skipped before it runs anything)."""

    def run(*args, **kwargs) -> None:
        try:
            case(*args, **kwargs)
        except Skipped:
            pass

    return run


class Survey:
    def __init__(self, root: Path, only: str = ""):
        self.root, self.rows, self.references, self.only = root, [], {}, only

    def chosen(self, name: str) -> bool:
        """Whether --only (comma-separated texts) leaves case `name` in."""
        return not self.only or any(text in name for text in self.only.split(","))

    def env(self, **extra) -> dict:
        e = {**os.environ, "TITANLITE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        e.pop("TITANLITE_FAULT", None)
        return {**e, **extra}

    def folder(self, name: str, case: bool = True) -> Path:
        if case and not self.chosen(name):
            raise Skipped(name)
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def args(self, folder: Path, ngpu: int = 1, *extra: str) -> list[str]:
        """run_train.sh with the survey's base flags and the case's `extra`, each option's last value only (titanlite
        refuses an option given twice)."""
        base = ["--job.dump_folder", str(folder), "--job.name", "run", *BASE, *LAYOUTS[ngpu], *extra]
        return [str(REPO / "run_train.sh"), *last_wins(base)]

    def run(self, folder: Path, ngpu: int = 1, *extra: str, timeout: int = 600, **env) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.args(folder, ngpu, *extra),
            cwd=REPO,
            env=self.env(NGPU=str(ngpu), **env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, folder: Path, ngpu: int = 1, *extra: str, **env) -> subprocess.Popen:
        return subprocess.Popen(
            self.args(folder, ngpu, *extra),
            cwd=REPO,
            env=self.env(NGPU=str(ngpu), **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a signal to "every process" reaches the job's only
        )

    def losses(self, folder: Path) -> list[float]:
        path = folder / "run" / "metrics.jsonl"
        return [json.loads(line)["loss"] for line in path.read_text().splitlines()] if path.exists() else []

    def reference(self, ngpu: int) -> list[float]:
        if ngpu not in self.references:
            folder = self.folder(f"reference{ngpu}", case=False)
            proc = self.run(folder, ngpu)
            assert proc.returncode == 0, proc.stderr[-2000:]
            self.references[ngpu] = self.losses(folder)
        return self.references[ngpu]

    def exact(self, folder: Path, ngpu: int) -> tuple[bool, str]:
        ours, ref = self.losses(folder), self.reference(ngpu)
        return ours == ref, "losses equal the uninterrupted run's" if ours == ref else f"losses differ: {ours} vs {ref}"

    def record(self, kind: str, name: str, ok: bool, detail: str) -> None:
        self.rows.append({"kind": kind, "name": name, "ok": ok, "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {kind:<9} {name:<44} {detail[:150]}", flush=True)


def last_line(proc) -> str:
    lines = [line for line in (proc.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def wait_for_steps(folder: Path, steps: int, job: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    path = folder / "run" / "metrics.jsonl"
    while time.time() < deadline and job.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        time.sleep(0.1)


def launcher_and_workers(job: subprocess.Popen) -> list[int]:
    """The launcher's child processes (its forkserver and helpers) and the workers its forkserver forked, last."""
    children = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
    ]
    workers = [
        int(p)
        for child in children
        for p in subprocess.run(["pgrep", "-P", str(child)], capture_output=True, text=True).stdout.split()
    ]
    return children + workers


# ---- faults ----------------------------------------------------------------------------------------------


@skippable
def fault_kill_restart(s: Survey, name: str, ngpu: int, spec: str) -> None:
    folder = s.folder(name)
    proc = s.run(folder, ngpu, MAX_RESTARTS="1", TITANLITE_FAULT=spec)
    ok, detail = s.exact(folder, ngpu)
    s.record("fault", name, proc.returncode == 0 and ok, f"exit {proc.returncode}; {detail}")


@skippable
def fault_signal_then_rerun(s: Survey, name: str, sig: int, to_worker: bool | str) -> None:
    folder = s.folder(name)
    job = s.start(folder, 2)
    wait_for_steps(folder, 5, job)
    if to_worker == "every process":  # Slurm at its time limit, scancel, kill -TERM -PGID
        os.killpg(job.pid, sig)
    else:
        os.kill(launcher_and_workers(job)[-1] if to_worker else job.pid, sig)
    job.communicate(timeout=300)
    first = job.returncode
    proc = s.run(folder, 2)
    ok, detail = s.exact(folder, 2)
    s.record(
        "fault",
        name,
        first == 128 + sig and proc.returncode == 0 and ok,
        f"exit {first} then {proc.returncode}; {detail}",
    )


@skippable
def fault_kill_launcher(s: Survey) -> None:
    folder = s.folder("SIGKILL the launcher, rerun")
    job = s.start(folder, 2)
    wait_for_steps(folder, 6, job)
    workers = launcher_and_workers(job)
    os.kill(job.pid, signal.SIGKILL)
    job.communicate(timeout=60)
    time.sleep(2)
    orphans = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    proc = s.run(folder, 2)
    ok, detail = s.exact(folder, 2)
    took_over = "taking it over" in proc.stdout
    s.record(
        "fault",
        "SIGKILL the launcher, rerun",
        not orphans and took_over and proc.returncode == 0 and ok,
        f"orphaned workers {orphans}; lock taken over {took_over}; exit {proc.returncode}; {detail}",
    )


@skippable
def damaged_newest(s: Survey, name: str, damage) -> None:
    """Train to step 8, damage step-8, rerun to 12: must fall back to step-4 and end with the exact losses."""
    folder = s.folder(name)
    first = s.run(folder, 1, "--training.stop_after_step", "8")
    damage(folder / "run" / "step-8")
    proc = s.run(folder, 1)
    fell_back = f"resumed from {folder / 'run' / 'step-4'} at step 4" in proc.stdout
    warning = next((line for line in proc.stdout.splitlines() if "WARNING skipping" in line), "")
    plain = warning.endswith("resuming from step-4 instead") and "Error" not in warning
    ok, detail = s.exact(folder, 1)
    s.record(
        "fault",
        name,
        first.returncode == 0 and proc.returncode == 0 and fell_back and plain and ok,
        f"fell back to step-4: {fell_back}; warning in plain words: {plain}; exit {proc.returncode}; {detail}",
    )


def overwrite(path: Path, at: int | None = None, data: bytes = bytes(range(16))) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if at is None else at)
        f.write(data)


@skippable
def fault_all_damaged(s: Survey) -> None:
    folder = s.folder("every checkpoint damaged")
    s.run(folder, 1, "--training.stop_after_step", "8")
    for step in (4, 8):
        overwrite(next((folder / "run" / f"step-{step}").glob("*.distcp")))
    before = s.losses(folder)
    proc = s.run(folder, 1)
    refused = proc.returncode == 2 and "no usable checkpoint" in last_line(proc) and s.losses(folder) == before
    fresh = s.run(folder, 1, "--checkpoint.start_from_scratch")
    ok, detail = s.exact(folder, 1)
    s.record(
        "fault",
        "every checkpoint damaged",
        refused and fresh.returncode == 0 and ok,
        f"refused with exit 2 and nothing overwritten: {refused}; start_from_scratch: {detail}",
    )


def run_on_tmpfs(s: Survey, folder: Path, mount: str) -> subprocess.CompletedProcess:
    """One single-process run whose dump folder is a fresh tmpfs at folder/disk, set up by the shell line `mount`
    ($0 the mount point) in a mount namespace of its own."""
    disk = folder / "disk"
    disk.mkdir()
    cmd = ["unshare", "-m", "sh", "-c", mount, str(disk), *s.args(disk, 1)]
    return subprocess.run(cmd, cwd=REPO, env=s.env(NGPU="1"), capture_output=True, text=True, timeout=600)


@skippable
def fault_full_disk(s: Survey) -> None:
    proc = run_on_tmpfs(s, s.folder("full disk"), 'mount -t tmpfs -o size=30m tmpfs "$0" && exec "$@"')
    line = last_line(proc)
    ok = proc.returncode == 1 and "ran out of space" in line and "Traceback" not in proc.stderr
    s.record("fault", "full disk during a save", ok, f"exit {proc.returncode}: {line}")


@skippable
def fault_busy_folder(s: Survey) -> None:
    folder = s.folder("second launch on a busy folder")
    first = s.start(folder, 1)
    deadline = time.time() + 120
    while not (folder / "run" / ".lock").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.1)
    second = s.run(folder, 1)
    first.communicate(timeout=600)
    ok, detail = s.exact(folder, 1)
    refused = second.returncode == 2 and "is in use by another job" in last_line(second)
    s.record(
        "fault",
        "second launch on a busy folder",
        refused and first.returncode == 0 and ok,
        f"second refused: {refused}; first: {detail}",
    )


@skippable
def fault_torn_file(s: Survey, name: str, tear, said: str) -> None:
    """Train to step 8, leave a half-written file of the run folder as a crash would, rerun to 12: the rerun says
    in one line what it dropped or took over and ends with the uninterrupted run's losses."""
    folder = s.folder(name)
    first = s.run(folder, 1, "--training.stop_after_step", "8")
    tear(folder / "run")
    proc = s.run(folder, 1)
    noted = said in proc.stdout
    ok, detail = s.exact(folder, 1)
    s.record(
        "fault", name, first.returncode == 0 and proc.returncode == 0 and noted and ok, f"noted: {noted}; {detail}"
    )


def torn_lock(run: Path) -> None:
    (run / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 12})[:-4])  # cut mid-record


def reused_pid_lock(run: Path) -> None:
    """A lock whose pid is now this survey's own (live) process, recorded with an earlier start time: what a
    container or node restart leaves when it reuses the dead launcher's pid."""
    stat = Path(f"/proc/{os.getpid()}/stat").read_text().rpartition(")")[2].split()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    holder = {"host": os.uname().nodename, "pid": os.getpid(), "job": "launcher 1", "started": "earlier"}
    (run / ".lock").write_text(json.dumps({**holder, "pid_start": int(stat[19]) - 1, "boot_id": boot}))


@skippable
def fault_read_only_folder(s: Survey) -> None:
    mount = 'mount -t tmpfs tmpfs "$0" && mkdir "$0/run" && mount -o remount,ro "$0" && exec "$@"'
    proc = run_on_tmpfs(s, s.folder("read-only run folder"), mount)
    line = last_line(proc)
    ok = proc.returncode == 2 and "read-only" in line and "Traceback" not in proc.stderr
    s.record("fault", "read-only run folder", ok, f"exit {proc.returncode}: {line}")


@skippable
def fault_read_only_mid_run(s: Survey) -> None:
    """The run folder made read-only after step 3 (the run as root without CAP_DAC_OVERRIDE, so that permissions
    hold): the step-4 save fails, one line naming it, exit 2, no traceback (the lock's release says it could not)."""
    name = "run folder made read-only mid-run"
    folder = s.folder(name)
    job = subprocess.Popen(
        ["setpriv", "--bounding-set=-dac_override", *s.args(folder, 1)],
        cwd=REPO,
        env=s.env(NGPU="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_steps(folder, 3, job)
    os.chmod(folder / "run", 0o555)
    try:
        _, err = job.communicate(timeout=300)
    finally:
        os.chmod(folder / "run", 0o755)
    line = next((x for x in reversed(err.splitlines()) if x.strip()), "")
    ok = job.returncode == 2 and err.count("titanlite: error:") == 1 and "Traceback" not in err
    s.record("fault", name, ok, f"exit {job.returncode}, {err.count('titanlite: error:')} error line(s): {line}")


@skippable
def fault_stopped_rank(s: Survey) -> None:
    """SIGSTOP rank 1 mid-run: the other rank's collective times out; the last line should name rank 1."""
    folder = s.folder("SIGSTOP a rank")
    job = s.start(folder, 2, "--comm.train_timeout_seconds", "10")
    wait_for_steps(folder, 4, job)
    workers = launcher_and_workers(job)
    os.kill(workers[-1], signal.SIGSTOP)
    _, err = job.communicate(timeout=300)
    line = (err or "").strip().splitlines()[-1] if (err or "").strip() else ""
    named = "timed out waiting for rank" in line and "which is stopped (process" in line
    s.record("fault", "SIGSTOP a worker (stopped rank)", named, f"exit {job.returncode}: {line}")


@skippable
def fault_hung_rank(s: Survey) -> None:
    """Rank 1 hangs outside the collectives after step 3 (a Python loop): rank 0 times out and names it."""
    folder = s.folder("hung rank")
    proc = s.run(folder, 2, "--comm.train_timeout_seconds", "10", TITANLITE_FAULT="hang@3:1")
    line = last_line(proc)
    named = "timed out waiting for rank 1 (pid" in line and "which never began step 4" in line
    s.record("fault", "rank 1 hangs outside the collectives", named, f"exit {proc.returncode}: {line[:160]}")


@skippable
def fault_nan(s: Survey) -> None:
    folder = s.folder("NaN loss, rerun")
    proc = s.run(folder, 2, TITANLITE_FAULT="nan@7")
    again = s.run(folder, 2)
    ok, detail = s.exact(folder, 2)
    s.record(
        "fault",
        "NaN loss at step 7, rerun",
        proc.returncode == 3 and again.returncode == 0 and ok,
        f"exit {proc.returncode} then {again.returncode}; {detail}",
    )


@skippable
def fault_divergence(s: Survey) -> None:
    folder = s.folder("divergence, lower LR")
    every2 = ["--training.max_norm", "0", "--checkpoint.interval", "2"]  # a checkpoint before it diverges at step 4
    proc = s.run(folder, 1, "--optimizer.lr", "100", *every2)
    again = s.run(folder, 1, "--optimizer.lr", "3e-3", *every2)
    ok = proc.returncode == 3 and again.returncode == 0 and "optimizer.lr 100.0 -> 0.003" in again.stdout
    s.record("fault", "divergence, resume with a lower LR", ok, f"exit {proc.returncode} then {again.returncode}")


@skippable
def fault_killed_rank_named(s: Survey) -> None:
    folder = s.folder("killed rank named")
    proc = s.run(folder, 2, TITANLITE_FAULT="kill@5:1")
    again = s.run(folder, 2)
    ok, detail = s.exact(folder, 2)
    named = last_line(proc).startswith("titanlite: error: rank 1: killed by SIGKILL")
    s.record(
        "fault",
        "rank 1 SIGKILLed without restarts",
        named and again.returncode == 0 and ok,
        f"named: {named} ({last_line(proc)[:80]}); rerun: {detail}",
    )


@skippable
def fault_changed_lr(s: Survey) -> None:
    folder = s.folder("changed LR on resume")
    s.run(folder, 1, "--training.stop_after_step", "4")
    proc = s.run(folder, 1, "--optimizer.lr", "1e-4")
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    lr5 = next(r["lr"] for r in records if r["step"] == 5)
    s.record(
        "fault",
        "resume with a new optimizer.lr",
        proc.returncode == 0 and lr5 < 1e-4 + 1e-12,
        f"lr at step 5: {lr5:.3g}",
    )


@skippable
def fault_refused_change(s: Survey, name: str, *change: str) -> None:
    folder = s.folder(name)
    s.run(folder, 1, "--training.stop_after_step", "4")
    before = sorted(p.name for p in (folder / "run").iterdir())
    proc = s.run(folder, 1, *change)
    after = sorted(p.name for p in (folder / "run").iterdir())
    s.record("fault", name, proc.returncode == 2 and before == after, last_line(proc)[:150])


@skippable
def fault_branch_from_older(s: Survey, keep: int) -> None:
    """A resume from an older checkpoint than the newest (checkpoint.load_step) is refused before launch, every file
    of the run folder left byte-identical (asked with keep_latest_k too, whose retention would have deleted the
    original's checkpoints); the branch the line names, in a run folder of its own, trains on with the original's
    losses."""
    name = f"branch from an older checkpoint, keep_latest_k {keep}"
    folder = s.folder(name)
    first = s.run(folder, 1)  # step-4, step-8, step-12
    run = folder / "run"
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}
    older = min(int(p.name.removeprefix("step-")) for p in run.glob("step-*"))
    refused = s.run(folder, 1, "--checkpoint.load_step", str(older), "--checkpoint.keep_latest_k", str(keep))
    after = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}
    line = last_line(refused)
    branch = [
        "--checkpoint.initial_load_path",
        str(run / f"step-{older}"),
        "--checkpoint.initial_load_model_only",
        "false",
    ]
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(folder), "--job.name", f"run-from-{older}", *BASE]
    branched = subprocess.run(
        [*cmd, *LAYOUTS[1], *branch], cwd=REPO, env=s.env(NGPU="1"), capture_output=True, text=True, timeout=600
    )
    path = folder / f"run-from-{older}" / "metrics.jsonl"
    losses = [json.loads(x)["loss"] for x in path.read_text().splitlines()] if path.exists() else []
    ok = (
        first.returncode == 0
        and refused.returncode == 2
        and "would train on from step" in line
        and after == before
        and branched.returncode == 0
        and losses == s.reference(1)[older:]
    )
    s.record(
        "fault",
        name,
        ok,
        f"exit {refused.returncode}, {len(before)} files byte-identical: {after == before}; branch exit "
        f"{branched.returncode}, losses {'equal' if losses == s.reference(1)[older:] else 'differ'}: {line[:80]}",
    )


def faults(s: Survey) -> None:
    fault_kill_restart(s, "SIGKILL rank 1 after step 6, restart", 2, "kill@6:1")
    fault_kill_restart(s, "SIGKILL rank 0 after step 9, restart", 2, "kill@9:0")
    fault_kill_restart(s, "SIGKILL the only rank after step 5, restart", 1, "kill@5:0")
    fault_signal_then_rerun(s, "SIGTERM to the launcher, rerun", signal.SIGTERM, to_worker=False)
    fault_signal_then_rerun(s, "SIGINT to the launcher, rerun", signal.SIGINT, to_worker=False)
    fault_signal_then_rerun(s, "SIGTERM to a worker, rerun", signal.SIGTERM, to_worker=True)
    fault_signal_then_rerun(s, "SIGHUP to the launcher, rerun", signal.SIGHUP, to_worker=False)
    fault_signal_then_rerun(s, "SIGTERM to every process, rerun", signal.SIGTERM, to_worker="every process")
    fault_kill_launcher(s)
    fault_torn_file(
        s,
        "torn last line of metrics.jsonl, rerun",
        lambda run: (run / "metrics.jsonl").open("a").write('{"step": 9, "lo'),
        "dropped 1 line(s) that are not whole records",
    )
    fault_torn_file(s, "torn lock file, rerun", torn_lock, "is not a whole lock record (a torn write); taking it over")
    fault_torn_file(s, "lock whose pid a live process reuses", reused_pid_lock, "now belongs to another process")
    fault_read_only_folder(s)
    fault_read_only_mid_run(s)
    damaged_newest(s, "newest .distcp truncated", lambda p: os.truncate(next(p.glob("*.distcp")), 100))
    damaged_newest(s, "newest .distcp: 16 bytes overwritten", lambda p: overwrite(next(p.glob("*.distcp"))))
    damaged_newest(s, "newest: first record header overwritten", lambda p: overwrite(next(p.glob("*.distcp")), at=0))
    damaged_newest(s, "newest .metadata overwritten", lambda p: overwrite(p / ".metadata", at=0))
    damaged_newest(s, "newest marker deleted", lambda p: (p / "titanlite.json").unlink())
    damaged_newest(s, "newest marker torn", lambda p: os.truncate(p / "titanlite.json", 10))
    damaged_newest(s, "newest checksums.json torn", lambda p: os.truncate(p / "checksums.json", 10))
    damaged_newest(
        s,
        "newest checksums.json deleted + bytes changed",
        lambda p: ((p / "checksums.json").unlink(), overwrite(next(p.glob("*.distcp")), at=0)),
    )
    fault_all_damaged(s)
    fault_full_disk(s)
    fault_busy_folder(s)
    fault_nan(s)
    fault_divergence(s)
    fault_killed_rank_named(s)
    fault_stopped_rank(s)
    fault_hung_rank(s)
    fault_changed_lr(s)
    fault_refused_change(s, "resume with another training.seq_len", "--training.seq_len", "64")
    fault_refused_change(s, "resume with another training.seed", "--training.seed", "3")
    fault_refused_change(s, "resume with another model.n_layers", "--model.n_layers", "2")
    fault_refused_change(s, "resume with another family", "--config", "train_configs/llama3_debug.toml")
    fault_refused_change(s, "resume with another tokenizer", "--model.tokenizer", "byte")
    fault_refused_change(
        s,
        "resume with another dataset",
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(REPO / "tests" / "data" / "validation.txt"),
    )
    fault_refused_change(s, "load_step naming a missing checkpoint", "--checkpoint.load_step", "7")
    fault_branch_from_older(s, 0)
    fault_branch_from_older(s, 1)


# ---- bad inputs ------------------------------------------------------------------------------------------

BAD_ENV = [
    ("NGPU", "0"),
    ("NGPU", "-1"),
    ("NGPU", "abc"),
    ("NNODES", "x"),
    ("MAX_RESTARTS", "-1"),
    ("TITANLITE_DEVICE", "gpu"),
    ("TITANLITE_DEVICE", "cuda"),
    ("NNODES", "2"),  # without RDZV_ENDPOINT
    ("LOG_RANK", "3"),  # a rank NGPU=1 has not: it would hide every line
    ("LOG_RANK", ","),
    ("START_METHOD", "threads"),
    ("OMP_NUM_THREADS", "0"),
    ("OMP_NUM_THREADS", "abc"),
    ("OMP_NUM_THREADS", "-1"),
]
# Several variables at once: (name, {variable: value}).
BAD_ENVS = [
    ("RDZV_ENDPOINT without a port", {"NNODES": "2", "RDZV_ENDPOINT": "node0"}),
    ("RDZV_ENDPOINT port 70000", {"NNODES": "2", "RDZV_ENDPOINT": "node0:70000"}),
]
LONG = "a" * 300  # a path component longer than the 255 bytes a name may have
BAD_ARGS = [
    ["--training.stepz", "3"],
    ["--nosection", "1"],
    ["--optimizer.lr", "inf"],
    ["--optimizer.lr", "nan"],
    ["--optimizer.lr", "-1"],
    ["--optimizer.lr", "abc"],
    ["--training.seq_len", "0"],
    ["--training.local_batch_size", "-2"],
    ["--training.steps", "0"],
    ["--metrics.log_freq", "0"],
    ["--checkpoint.load_step", "7"],
    ["--checkpoint.load_step", "-5"],
    ["--config", "train_configs/nope.toml"],
    ["--model.flavor", "bogus"],
    ["--model.name", "bert"],
    ["--training.dataset", "local"],
    ["--training.dataset", "local", "--training.dataset_path", "/nonexistent/data.jsonl"],
    ["--checkpoint.exclude_from_loading", "bogus"],
    ["--checkpoint.exclude_from_loading", "model"],  # fresh weights with the old optimizer moments
    ["--checkpoint.initial_load_model_only", "false"],  # no initial_load_path to take a whole state from
    ["--lr_scheduler.min_lr_factor", "2"],
    ["--optimizer.beta1", "1"],
    ["--model.flavor", "hf", "--model.hf_assets_path", "/nonexistent"],
    ["--training.global_batch_size", "7"],
    ["--validation.enable", "--validation.split_fraction", "0"],
    ["--data.shard_size_mb", "0"],
    ["--compile.components", "bogus"],
    ["--activation_checkpoint.mode", "bogus"],
    ["--profiling.enable_profiling", "--profiling.profile_freq", "1"],
    ["--checkpoint.async_mode", "bogus"],
    ["--training.mixed_precision_param", "fp8"],
    ["--checkpoint.keep_latest_k", "-1"],
    ["--parallelism.data_parallel_shard_degree", "0"],
    ["--parallelism.tensor_parallel_degree", "3"],
    ["--parallelism.pipeline_parallel_degree", "3"],
    ["--validation.enable", "--validation.seq_len", "100000"],
    ["--checkpoint.initial_load_path", "/nonexistent/step-3"],
    ["--training.enable_cpu_offload"],
    ["--checkpoint.enable", "--checkpoint.start_from_scratch", "--checkpoint.load_step", "3"],
    ["--training.stop_after_step", "50"],
    ["--comm.init_timeout_seconds", "0"],
    ["--training.loss_chunk_tokens", "-7"],
    ["--validation.freq", "0"],
    ["--data.num_workers", "-1"],
    ["--training.seed", str(10**23)],
    ["--metrics.enable_wandb", "--training.steps", "2"],  # run with the survey's broken wandb on PYTHONPATH, below
    # every number bounded before launch
    ["--optimizer.muon_ns_steps", "100000000"],
    ["--model.mtp_layers", "1000000"],
    ["--config", "train_configs/deepseek_v3_debug.toml", "--model.mtp_layers", "1000"],  # BASE's seq_len 32
    ["--model.n_layers", "100000"],
    ["--optimizer.eps", "0"],
    # every option meant: a setting of a feature that is off
    ["--optimizer.muon_lr", "0.01"],
    ["--optimizer.muon_params", "layers.*.weight"],
    ["--training.mtp_loss_coefficient", "0.3"],
    ["--training.spike_window", "50"],
    ["--float8.filter_fqns", "attention"],
    ["--float8.enable", "--float8.filter_fqns", "output,atention"],
    ["--moe.aux_loss_coef", "0.01"],
    # paths and names
    ["--job.name", "../escape"],
    ["--job.name", "/tmp/abs-run"],
    ["--config", f"/tmp/{LONG}.toml"],
    ["--training.dataset", "local", "--training.dataset_path", f"/tmp/{LONG}/x.txt"],
    ["--model.flavor", "hf", "--model.hf_assets_path", f"/tmp/{LONG}"],
    ["--checkpoint.initial_load_path", f"/tmp/{LONG}/step-3"],
    ["--training.dataset", "someowner/somedata"],  # no network here: not in the cache, the hub unreachable
]


def corpus(folder: Path, files: dict[str, str]) -> Path:
    """A dataset folder of text files, enough of each for the survey's windows."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def data_and_rendezvous_inputs(s: Survey) -> None:
    """Dataset folders with a dangling symlink or a file that fails mid-prepare, and rendezvous endpoints that never
    answer: one line naming the real cause (not the cache folder), exit 2, nothing written, in bounded time."""
    from tests.unit.test_rendezvous_input import free_port, listener

    text = "The quick brown fox jumps over the lazy dog. " * 400
    data = corpus(s.root / "dangling", {"a.txt": text})
    (data / "b.txt").unlink(missing_ok=True)
    os.symlink(s.root / "moved-away.txt", data / "b.txt")
    cache = s.root / "dangling-cache"
    case(
        s,
        "dataset folder with a dangling symlink",
        ["--training.dataset", "local", "--training.dataset_path", str(data), "--data.cache_dir", str(cache)],
        said=f"{data / 'b.txt'} is a symlink, but its target {s.root / 'moved-away.txt'} does not exist",
        nothing_at=cache,
    )
    data = corpus(s.root / "bad-line", {"a.jsonl": json.dumps({"text": text}) + "\n", "b.jsonl": '{"txt": 1}\n'})
    cache = s.root / "bad-line-cache"
    case(
        s,
        "prepare failing on a bad file leaves no progress.jsonl",
        ["--training.dataset", "local", "--training.dataset_path", str(data), "--data.cache_dir", str(cache)],
        said='b.jsonl line 1 has no "text" string',
        nothing_at=cache,
    )
    rows = "".join(json.dumps({"text": f"{i}: {text}"}) + "\n" for i in range(40)).encode()
    compressors = {
        "zst": lambda data: zstandard.ZstdCompressor().compress(data),
        "gz": gzip.compress,
        "bz2": bz2.compress,
        "xz": lzma.compress,
    }
    for codec, compress in compressors.items():
        data = corpus(s.root / f"truncated-{codec}", {"a.txt": text, "b.jsonl": json.dumps({"text": text}) + "\n"})
        whole = compress(rows)
        (data / f"c.jsonl.{codec}").write_bytes(whole[: len(whole) // 2])  # an interrupted download
        cache = s.root / f"truncated-{codec}-cache"
        case(
            s,
            f"dataset folder with a truncated .{codec} beside good files",
            ["--training.dataset", "local", "--training.dataset_path", str(data), "--data.cache_dir", str(cache)],
            said=f"{data / f'c.jsonl.{codec}'} is truncated: its .{codec} stream ends after {len(whole) // 2:,} bytes",
            nothing_at=cache,
        )
    rendezvous = {"NNODES": "2", "RDZV_TIMEOUT": "5"}
    with listener() as port:  # accepts connections, never answers
        endpoint = {**rendezvous, "RDZV_ENDPOINT": f"127.0.0.1:{port}"}
        case(
            s,
            "RDZV_ENDPOINT a silent listener, NODE_RANK=0",
            [],
            said=f"port {port} is in use by another program",
            within=60,
            **endpoint,
            NODE_RANK="0",
        )
        case(
            s,
            "RDZV_ENDPOINT a silent listener, NODE_RANK=1",
            [],
            said="accepted a connection but did not answer as a rendezvous store within 5 s",
            within=60,
            **endpoint,
            NODE_RANK="1",
        )
    case(
        s,
        "RDZV_ENDPOINT with nobody listening, NODE_RANK=1",
        [],
        said="nothing answered as a rendezvous store",
        within=60,
        **rendezvous,
        RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
        NODE_RANK="1",
    )


@skippable
def symlinked_subfolder(s: Survey) -> None:
    """A dataset folder whose subfolder is a symlink to a folder: read like a real one, and the hidden file left out
    is named; the run trains."""
    name = "dataset folder with a symlinked subfolder"
    folder = s.folder(name)
    text = "The quick brown fox jumps over the lazy dog. " * 400
    elsewhere = corpus(folder / "elsewhere", {"b.txt": text})
    data = corpus(folder / "data", {"a.txt": text, ".notes": "not corpus"})
    os.symlink(elsewhere, data / "linked")
    proc = s.run(
        folder, 1, "--training.dataset", "local", "--training.dataset_path", str(data), "--training.steps", "4"
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("titanlite: data:")), "")
    ok = proc.returncode == 0 and "(2 files: 2 .txt; 1 hidden file(s) or folder(s) left out (.notes))" in line
    s.record("input", name, ok, f"exit {proc.returncode}: {line}")


def bad_inputs(s: Survey) -> None:
    symlinked_subfolder(s)
    data_and_rendezvous_inputs(s)
    hf_folder_inputs(s)
    command_inputs(s)
    for key, value in BAD_ENV:
        case(s, f"{key}={value}", [], **{key: value})
    for name, variables in BAD_ENVS:
        case(s, name, [], **variables)
    broken = s.root / "broken_site" / "wandb"  # a wandb that is installed but does not import
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "__init__.py").write_text("raise ImportError('a dependency of wandb is missing')\n")
    for args in BAD_ARGS:
        extra = {"PYTHONPATH": str(broken.parent)} if "--metrics.enable_wandb" in args else {}
        case(s, " ".join(args), args, **extra)
    file_folder = s.root / "a_file"
    file_folder.write_text("not a folder")
    case(s, "job.dump_folder naming a file", ["--job.dump_folder", str(file_folder)])
    binary, latin1, fifo = s.root / "binary.toml", s.root / "latin1.toml", s.root / "fifo.txt"
    binary.write_bytes(bytes(range(256)))
    latin1.write_bytes('[job]\ndescription = "café"\n'.encode("latin-1"))
    for path in (fifo, s.root / "fifo.toml"):
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    case(s, "--config a binary file", ["--config", str(binary)])
    case(s, "--config a Latin-1 file", ["--config", str(latin1)])
    case(s, "--config a folder", ["--config", str(s.root)])
    case(s, "--config a FIFO", ["--config", str(s.root / "fifo.toml")])
    case(s, "a key given twice", ["--optimizer.lr", "1e-3", "--optimizer.lr", "2e-3"], "is given twice", twice=True)
    bom = s.root / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[optimizer]\nlr = -1.0\n")  # a byte-order mark, then a bad value: read, refused
    case(s, "--config with a byte-order mark", ["--config", str(bom)], "optimizer.lr=-1.0")
    case(s, "--job.name ''", ["--job.name", ""])
    case(s, "--job.name .", ["--job.name", "."])
    case(s, "dataset_path a FIFO", ["--training.dataset", "local", "--training.dataset_path", str(fifo)])
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(s.root / "corpus.sock"))
        case(
            s, "dataset_path a socket", ["--training.dataset", "local", "--training.dataset_path", server.getsockname()]
        )


def hf_folder_inputs(s: Survey) -> None:
    """Hugging Face folders that would not train as their config.json says (a field of the wrong JSON type, dropout,
    weights of another dtype or shape than config.json makes, a NaN, an MoE field out of range): run_train.sh
    refuses each before launch, naming the field or tensor in the folder's own names."""
    names = ["wrong JSON type", "dropout", "float64", "shape", "NaN", "experts", *QUANTIZED_AND_SHARDED]
    if not any(s.chosen(f"HF folder: {n}") for n in names):
        return
    import safetensors.torch as st
    import torch

    from tests.unit.test_hf_families import random_model
    from tests.unit.test_qwen3_moe import random_model as random_moe

    base = s.root / "hf-qwen3"
    random_model("qwen3").save_pretrained(base)

    def variant(name: str, config: dict | None = None, tensors=None, source: Path = base) -> Path:
        folder = s.root / f"hf-{name}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        if config:
            path = folder / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
        if tensors:
            path = folder / "model.safetensors"
            st.save_file(tensors(st.load_file(path)), path, metadata={"format": "pt"})
        return folder

    def nan(t: dict) -> dict:
        t["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
        return t

    def sharded(name: str) -> Path:
        """The base folder in two shards with an index, 'lm_head.weight' in both with different values and left out
        of the index: the copy to read is not said."""
        folder = variant(name)
        tensors = st.load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = sorted(tensors)  # 'lm_head.weight' first
        first, second = names[: len(names) // 2], names[len(names) // 2 :]
        files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        st.save_file({n: tensors[n] for n in first}, folder / files[0], metadata={"format": "pt"})
        stray = {names[0]: tensors[names[0]] + 1}
        st.save_file({**{n: tensors[n] for n in second}, **stray}, folder / files[1], metadata={"format": "pt"})
        weight_map = {**dict.fromkeys(first[1:], files[0]), **dict.fromkeys(second, files[1])}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return folder

    def fp8(name: str, scale: float | None = None, config: bool = True) -> Path:
        """The base folder with its projections in e4m3 128 x 128 blocks, as published FP8 folders hold them, the
        first scale of layer 0's o_proj set to `scale` (given one); `config`: with the quantization_config."""
        from titanlite.components.hf_quantized import quantize_fp8

        def quantized(t: dict) -> dict:
            for key in [k for k in t if k.endswith("_proj.weight")]:
                t[key], t[key + "_scale_inv"] = quantize_fp8(t[key], (128, 128))
            if scale is not None:
                t["model.layers.0.self_attn.o_proj.weight_scale_inv"][0, 0] = scale
            return t

        method = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
        return variant(name, {"quantization_config": method} if config else None, tensors=quantized)

    def mxfp4(name: str) -> Path:
        """A random gpt-oss folder with its experts in MXFP4 (blocks and scales), one exponent 255 (E8M0's NaN)."""
        from tests.unit.test_gpt_oss import random_gpt_oss

        source = s.root / "hf-gpt-oss"
        if not source.exists():
            random_gpt_oss(intermediate_size=64).save_pretrained(source)  # both expert widths multiples of 32

        def packed(t: dict) -> dict:
            for key in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
                experts, width, rows = t.pop(key).shape  # [E, in, out]: blocks run over `in`
                t[key + "_blocks"] = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8)
                t[key + "_scales"] = torch.full((experts, rows, width // 32), 120, dtype=torch.uint8)
            t["model.layers.0.mlp.experts.down_proj_scales"][0, 0, 0] = 255
            return t

        return variant(name, {"quantization_config": {"quant_method": "mxfp4"}}, tensors=packed, source=source)

    moe = s.root / "hf-qwen3-moe"
    random_moe().save_pretrained(moe)
    folders = {
        "wrong JSON type": (variant("str", {"num_hidden_layers": "4"}), 'num_hidden_layers="4" is not a whole number'),
        "dropout": (variant("dropout", {"attention_dropout": 0.1}), "attention_dropout=0.1: titanlite trains without"),
        "float64": (variant("f64", tensors=lambda t: {k: v.double() for k, v in t.items()}), "are float64"),
        "shape": (variant("vocab", {"vocab_size": 320}), "but its config.json makes it"),
        "NaN": (variant("nan", tensors=nan), "holds 1 NaN value"),
        "experts": (variant("moe", {"num_experts_per_tok": 0}, source=moe), "num_experts_per_tok=0"),
        "duplicate tensor": (sharded("dup"), "is stored in both model-00001-of-00002.safetensors and model-00002"),
        "zero FP8 scale": (fp8("fp8-zero", 0.0), "holds 1 scale that is not finite and positive (the first: 0.0)"),
        "negative FP8 scale": (fp8("fp8-neg", -1.0), "holds 1 scale that is not finite and positive (the first: -1.0)"),
        "MXFP4 exponent": (mxfp4("mxfp4-255"), "holds 1 exponent above 252 (the first: 255)"),
        "FP8 scales without config": (fp8("fp8-noconfig", config=False), "has no quantization_config to read them by"),
    }
    for name, (folder, said) in folders.items():
        args = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
        case(s, f"HF folder: {name}", args, said=said)


def command_inputs(s: Survey) -> None:
    """The other commands' front doors: eval, generate and convert take a run's trained settings from its checkpoint
    and refuse a flag that contradicts them; an export never writes half a folder, into another model's folder or
    onto the kernel's file systems; nonsensical numbers are refused. Each one line, exit 2, nothing written."""
    if not any(s.chosen(n) for n in COMMAND_CASES):
        return
    run = s.folder("moe-bias", case=False)
    moe = ["--config", "train_configs/qwen3_moe_debug.toml", "--model.tokenizer", "byte", "--moe.balance", "bias"]
    proc = s.run(run, 1, *moe, "--training.steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    folder = ["--job.dump_folder", str(run), "--job.name", "run"]
    other = s.root / "other-model"
    other.mkdir(exist_ok=True)
    (other / "model.safetensors").write_text("another model's weights")
    export = s.root / "export" / "hf"
    cases = {
        "eval with a flag the checkpoint contradicts": (["eval", *folder, "--moe.balance", "aux_loss"], "contradicts"),
        "generate with a flag the checkpoint contradicts": (
            ["generate", "--prompt", "x", *folder, "--model.n_layers", "1"],
            "contradicts",
        ),
        "export a model its family cannot express": (
            ["convert", "to-hf", "--output", str(export), *folder],
            "cannot express moe.balance='bias'",
        ),
        "export into another model's folder": (
            ["convert", "to-hf", "--output", str(other), *folder],
            "holds files no titanlite export wrote",
        ),
        "export onto /proc": (["convert", "to-hf", "--output", "/proc/titanlite-export", *folder], "kernel's proc"),
        "export onto a file": (["convert", "to-hf", "--output", "/etc/hostname", *folder], "is a file"),
        "generate --temperature nan": (["generate", "--prompt", "x", "--temperature", "nan", *folder], "finite"),
        "compare --max-diff inf": (["compare", str(run), str(run), "--max-diff", "inf"], "finite"),
        "plan --gpu-mem-gib 0": (["plan", "--gpu-mem-gib", "0"], "--gpu-mem-gib"),
        "eval --output a folder": (["eval", *folder, "--output", str(s.root)], "is a folder; name a file"),
        "unknown command": (["trian"], "unknown command 'trian' (did you mean 'train'?); see titanlite --help"),
        "check --nproc-per-node 0": (["check", "--nproc-per-node", "0"], "check --nproc-per-node must be at least 1"),
        "check --nproc-per-node above the world size": (
            ["check", "--world-size", "2", "--nproc-per-node", "4"],
            "is more than --world-size 2",
        ),
        "check --nproc-per-node not dividing the world size": (
            ["check", "--world-size", "4", "--nproc-per-node", "3"],
            "does not divide --world-size 4",
        ),
        "prepare --workers -1": (["prepare", "--workers", "-1"], "prepare --workers must be at least 0, not -1"),
        "prepare --workers 100000": (["prepare", "--workers", "100000"], "is more than the"),
        "a config key twice (check)": (
            ["check", "--optimizer.lr", "1e-3", "--optimizer.lr", "2e-3"],
            "optimizer.lr is given twice on the command line",
        ),
        "generate --prompt twice": (["generate", "--prompt", "a", "--prompt", "b", *folder], "is given twice"),
        "eval --output name too long": (["eval", *folder, "--output", f"/tmp/{LONG}.json"], "eval --output: its name"),
        "export --output name too long": (
            ["convert", "to-hf", "--output", f"/tmp/{LONG}", *folder],
            "convert to-hf --output: its name",
        ),
        "compare a run folder name too long": (["compare", f"/tmp/{LONG}", str(run)], "compare RUN_DIR: its name"),
        "compare --metrics no run logged": (
            ["compare", str(run / "run"), str(run / "run"), "--metrics", "perplexity"],
            "no run logged 'perplexity'",
        ),
        "plan --top 0": (["plan", "--top", "0"], "--top must be at least 1"),
        "prepare an unreachable hub dataset": (
            ["prepare", "--training.dataset", "someowner/somedata"],
            "is not in this machine's Hugging Face cache",
        ),
    }
    assert set(cases) == set(COMMAND_CASES)
    for name, (argv, said) in cases.items():
        command_case(s, name, argv, said, empty=(export.parent,))
    left = sorted(p.name for p in other.iterdir())
    s.record("bad input", "another model's folder kept", left == ["model.safetensors"], f"left {left}")
    out = s.root / "not-yet" / "made" / "generated.json"  # a folder that can be made: made, before generating
    proc = subprocess.run(
        [sys.executable, "-m", "titanlite.commands.cli", "generate", "--prompt", "x", "--output", str(out), *folder],
        cwd=REPO,
        env=s.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    made = proc.returncode == 0 and out.is_file()
    s.record("input", "generate --output into a missing folder", made, last_line(proc) or f"exit {proc.returncode}")


QUANTIZED_AND_SHARDED = [
    "duplicate tensor",
    "zero FP8 scale",
    "negative FP8 scale",
    "MXFP4 exponent",
    "FP8 scales without config",
]
COMMAND_CASES = [
    "eval with a flag the checkpoint contradicts",
    "generate with a flag the checkpoint contradicts",
    "export a model its family cannot express",
    "export into another model's folder",
    "export onto /proc",
    "export onto a file",
    "generate --temperature nan",
    "compare --max-diff inf",
    "plan --gpu-mem-gib 0",
    "eval --output a folder",
    "unknown command",
    "check --nproc-per-node 0",
    "check --nproc-per-node above the world size",
    "check --nproc-per-node not dividing the world size",
    "prepare --workers -1",
    "prepare --workers 100000",
    "a config key twice (check)",
    "generate --prompt twice",
    "eval --output name too long",
    "export --output name too long",
    "compare a run folder name too long",
    "compare --metrics no run logged",
    "plan --top 0",
    "prepare an unreachable hub dataset",
]


def case(
    s: Survey,
    name: str,
    args: list[str],
    said: str = "",
    nothing_at: Path | None = None,
    within: float = 300,
    twice: bool = False,
    **env,
) -> None:
    """One bad input: exit 2 with one `titanlite: error:` line (holding `said`), no traceback, no metrics, nothing at
    `nothing_at`, within `within` seconds. The case's options replace the base's (`twice`: the command line keeps
    both, for the case of an option given twice)."""
    if not s.chosen(name):
        return
    folder = s.folder("bad", case=False)
    ngpu = env.pop("NGPU", "1")
    flags = ["--job.dump_folder", str(folder), "--job.name", "run", *BASE, *args]
    cmd = [str(REPO / "run_train.sh"), *(flags if twice else last_wins(flags))]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=s.env(NGPU=ngpu, **env), capture_output=True, text=True, timeout=within
        )
    except subprocess.TimeoutExpired:
        s.record("bad input", name, False, f"still running after {within:.0f} s")
        return
    judge(s, name, proc, said, [folder, *([nothing_at] if nothing_at else [])], start)


def judge(s: Survey, name: str, proc, said: str, empty: list[Path], start: float) -> None:
    """A bad input was handled: exit 2, its last line the one `titanlite: error:` line (holding `said`), no
    traceback, and each folder of `empty` absent or empty (nothing written)."""
    line = last_line(proc)
    written = [str(p) for p in empty if p.exists() and any(p.iterdir())]
    ok = (
        proc.returncode == 2
        and line.startswith("titanlite: error: ")
        and (proc.stderr or "").count("titanlite: error:") == 1
        and said in line
        and "Traceback" not in proc.stderr
        and not written
    )
    wrote = f" (wrote in {', '.join(written)})" if written else ""
    s.record("bad input", name, ok, f"exit {proc.returncode} after {time.monotonic() - start:.0f} s{wrote}: {line}")


def command_case(s: Survey, name: str, argv: list[str], said: str = "", empty: tuple[Path, ...] = ()) -> None:
    """One bad input to a titanlite command other than training (`titanlite ARGV`), judged as `case` judges."""
    if not s.chosen(name):
        return
    start = time.monotonic()
    cmd = [sys.executable, "-m", "titanlite.commands.cli", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=s.env(), capture_output=True, text=True, timeout=300)
    judge(s, name, proc, said, list(empty), start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="")
    parser.add_argument("--part", choices=["all", "faults", "inputs"], default="all")
    parser.add_argument(
        "--only", default="", help="run only the cases whose name holds this text (or one of several, comma-separated)"
    )
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="titanlite-survey-"))
    survey = Survey(root, opts.only)
    if opts.part in ("all", "faults"):
        faults(survey)
    if opts.part in ("all", "inputs"):
        bad_inputs(survey)
    for kind in ("fault", "input", "bad input"):
        rows = [r for r in survey.rows if r["kind"] == kind]
        if rows:
            print(f"{kind}s: {sum(r['ok'] for r in rows)} of {len(rows)} handled")
    if opts.output:
        Path(opts.output).write_text(json.dumps(survey.rows, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["ok"] for r in survey.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
