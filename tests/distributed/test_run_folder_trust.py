"""Checkpoints and run folders that can be trusted: on resume the config is the source of truth (a new LR takes
effect at once; changes that would make the saved state wrong are refused, naming the key), one job per run
folder, checksums that find a changed byte and fall back to the older intact checkpoint, DCP failures and a
full disk as one line, no silent restart, and the rank that died is the one named."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    REPO,
    TINY,
    env,
    last_wins,
    logged,
    metrics,
    run_train_sh,
    train_in_pool,
    wait_for_steps,
    worker_pids,
)
from tests.pool import PoolFailure
from titanlite.base.failures import reason_in
from titanlite.components.optim import lr_factor
from titanlite.config import LRScheduler

pytestmark = pytest.mark.distributed

# One process, 10 steps of 2 windows of 32 tokens, a checkpoint every 5 steps, every step logged.
TEN = [
    *TINY,
    "--training.steps",
    "10",
    "--training.local_batch_size",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
]


@pytest.fixture(scope="module")
def ten(tmp_path_factory):
    """A finished run folder of TEN (step-5 and step-10), never changed: tests copy it."""
    run_dir = tmp_path_factory.mktemp("ten")
    train_in_pool(1, TEN, run_dir)
    return run_dir


def copy_of(ten, dest, steps=(5, 10)):
    """A copy of the TEN run folder holding the given checkpoints and the records up to the newest of them."""
    (dest / "run").mkdir(parents=True)
    for step in steps:
        shutil.copytree(ten / "run" / f"step-{step}", dest / "run" / f"step-{step}")
    records = [r for r in metrics(ten) if r["step"] <= max(steps)]
    (dest / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return dest


def last_line(proc) -> str:
    return reason_in(proc.stderr)


def damage(file, at=None):
    """Overwrite 16 bytes of `file`, in its middle or `at` an offset: the same size, so only a checksum can tell."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2 if at is None else at)
        f.write(bytes(range(16)))


# ---- the config is the source of truth on resume ---------------------------------------------------------


def test_a_new_lr_and_warmup_take_effect_from_the_first_resumed_step(tmp_path, ten):
    run = copy_of(ten, tmp_path, steps=(5,))
    proc = train_in_pool(1, [*TEN, "--optimizer.lr", "1e-4", "--lr_scheduler.warmup_steps", "7"], run)
    assert "resume: changed since step-5, in effect from step 6: " in proc.stdout
    assert "lr_scheduler.warmup_steps 2 -> 7" in proc.stdout and "optimizer.lr 0.003 -> 0.0001" in proc.stdout
    schedule = LRScheduler(warmup_steps=7)
    resumed = [r for r in metrics(run) if r["step"] > 5]
    assert [r["step"] for r in resumed] == [6, 7, 8, 9, 10]
    for r in resumed:  # the LR of step s is the new peak times the new schedule at s (0-based s - 1)
        assert r["lr"] == pytest.approx(1e-4 * lr_factor(r["step"] - 1, schedule, 10), rel=1e-6), r


@pytest.mark.slow  # about 16 s; CI runs it (the LR test beside it stays in the default suite)
def test_resuming_with_a_lower_lr_gets_past_the_non_finite_step(tmp_path):
    args = [
        *TINY,
        "--training.steps",
        "8",
        "--training.local_batch_size",
        "2",
        "--training.max_norm",
        "0",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    diverged = run_train_sh([*args, "--optimizer.lr", "100"], tmp_path)
    assert diverged.returncode == 3, diverged.stderr[-3000:]
    assert "is not finite" in last_line(diverged) and "resume with a lower optimizer.lr" in last_line(diverged)
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-2"]
    resumed = train_in_pool(1, [*args, "--optimizer.lr", "3e-3"], tmp_path)  # what the advice says
    assert "optimizer.lr 100.0 -> 0.003" in resumed.stdout
    records = [r for r in metrics(tmp_path) if r["step"] > 2]
    assert [r["step"] for r in records] == list(range(3, 9)) and all(r["lr"] <= 3e-3 for r in records)


@pytest.mark.parametrize(
    "change, key",
    [
        (["--training.seq_len", "64"], "training.seq_len=64 differs from the 32"),
        # seed, shuffle and split are slow (CI runs them): seq_len, dataset and the model's keys stay.
        pytest.param(["--training.seed", "7"], "training.seed=7 differs from the 42", marks=pytest.mark.slow),
        (
            ["--training.dataset", "local", "--training.dataset_path", str(REPO / "tests" / "data" / "validation.txt")],
            "training.dataset='local' differs from the 'stdlib'",
        ),
        pytest.param(["--data.shuffle", "false"], "data.shuffle=False differs from the True", marks=pytest.mark.slow),
        pytest.param(
            ["--validation.split_fraction", "0.05"],
            "validation.split_fraction=0.05 differs from the 0.01",
            marks=pytest.mark.slow,
        ),
        (["--model.n_layers", "2"], "model.n_layers=2 differs from the 0"),
        (["--model.tokenizer", "gpt2"], "model.tokenizer='gpt2' differs from the 'byte'"),
        (["--config", "train_configs/llama3_debug.toml"], "model.name='llama3' differs from the 'gpt2'"),
    ],
    ids=["seq_len", "seed", "dataset", "shuffle", "split", "n_layers", "tokenizer", "family"],
)
def test_a_change_that_would_make_the_saved_state_wrong_is_refused_before_launch(ten, change, key, capsys):
    from titanlite.commands.cli import main

    assert main(last_wins(["check", *TEN, "--job.dump_folder", str(ten), "--job.name", "run", *change])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0] and "that step-10 was saved with" in err[0], err


def test_leaving_the_dataloader_out_allows_a_data_change(ten, capsys):
    from titanlite.commands.cli import main

    args = last_wins(["check", *TEN, "--job.dump_folder", str(ten), "--job.name", "run", "--training.seq_len", "64"])
    assert main([*args, "--checkpoint.exclude_from_loading", "dataloader"]) == 0, capsys.readouterr().err
    assert main([*args, "--checkpoint.exclude_from_loading", "dataloader", "--model.n_layers", "2"]) == 2
    assert "model.n_layers=2" in capsys.readouterr().err


# ---- a branch never touches what the run saved after it --------------------------------------------------


def snapshot(folder: Path) -> dict:
    """Every file under `folder` and its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_resume_from_an_older_checkpoint_is_refused_and_its_branch_leaves_the_run_byte_identical(
    tmp_path, ten, capsys
):
    from titanlite.commands.cli import main

    run = copy_of(ten, tmp_path)
    before = snapshot(run / "run")
    args = last_wins([*TEN, "--job.dump_folder", str(run), "--job.name", "run", "--training.steps", "12"])
    assert main(["check", *args, "--checkpoint.load_step", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "checkpoint.load_step=5 would train on from step 5" in err[0], err
    assert "overwriting what the run saved after that (step-10 and its metrics from step 6)" in err[0], err
    assert f"--job.name run-from-5 --checkpoint.initial_load_path {run / 'run' / 'step-5'}" in err[0], err
    # Leaving out the step count would train from step 0 over step-5 and step-10: refused the same way.
    assert main(["check", *args, "--checkpoint.exclude_from_loading", "train_state,lr_scheduler"]) == 2
    assert "leaves out train_state, so this run would train from step 0" in capsys.readouterr().err
    # The worker refuses it too (a launch without `check`), before writing anything.
    with pytest.raises(PoolFailure, match="checkpoint.load_step=5 would train on from step 5"):
        train_in_pool(1, [*TEN, "--training.steps", "12", "--checkpoint.load_step", "5"], run)
    # The branch the line names, in a run folder of its own: steps 6-10 of the original, bitwise.
    step5 = run / "run" / "step-5"
    branch = ["--checkpoint.initial_load_path", str(step5), "--checkpoint.initial_load_model_only", "false"]
    proc = train_in_pool(1, [*TEN, *branch], run, job_name="run-from-5")
    assert f"resumed from {step5} at step 5: loaded model, optimizer, lr_scheduler, dataloader, train_state" in (
        proc.stdout
    )
    records = [json.loads(line) for line in (run / "run-from-5" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6, 11))
    assert [r["loss"] for r in records] == [r["loss"] for r in metrics(ten)[5:]]
    assert snapshot(run / "run") == before


def test_retention_and_a_restarted_start_from_scratch_keep_to_their_own_checkpoints(tmp_path, ten):
    """A start from scratch in a folder of another run's checkpoints: keep_latest_k never deletes those, and an
    elastic restart of the same launch resumes from what it saved itself rather than starting over again."""
    run = copy_of(ten, tmp_path)
    before = snapshot(run / "run")
    scratch = [*TEN, "--checkpoint.start_from_scratch", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1"]
    train_in_pool(1, [*scratch, "--training.stop_after_step", "4"], run, TITANLITE_LAUNCH_ID="launch-a")
    assert sorted(p.name for p in (run / "run").glob("step-*")) == ["step-10", "step-4", "step-5"]
    restarted = train_in_pool(1, scratch, run, TITANLITE_LAUNCH_ID="launch-a")
    assert f"resumed from {run / 'run' / 'step-4'} at step 4" in restarted.stdout
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ten)]
    # Its own step-10 replaced the other run's (start_from_scratch says so); the other's step-5 is untouched.
    assert sorted(p.name for p in (run / "run").glob("step-*")) == ["step-10", "step-5"]
    assert {k: v for k, v in snapshot(run / "run").items() if k.parts[0] == "step-5"} == {
        k: v for k, v in before.items() if k.parts[0] == "step-5"
    }


# ---- one job per run folder ------------------------------------------------------------------------------


@pytest.mark.slow  # CI runs it; unit/test_run_lock.py stops a second launch in `check` in the default suite
def test_a_second_launch_on_a_busy_run_folder_exits_2_and_the_first_finishes_exactly(tmp_path, ten):
    args = last_wins([*TEN, "--job.dump_folder", str(tmp_path), "--job.name", "run"])
    release = tmp_path / "release"  # the first job waits after step 1 until this exists: busy for certain
    first = subprocess.Popen(
        [str(REPO / "run_train.sh"), *args],
        cwd=REPO,
        env=env(NGPU="1", TITANLITE_FAULT="wait@1", TITANLITE_FAULT_RELEASE=str(release)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (tmp_path / "run" / ".lock").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    launcher = [
        sys.executable,
        "-m",
        "titanlite.commands.launch",
        "--standalone",
        "--nproc-per-node",
        "1",
        f"--log-dir={tmp_path / 'logs'}",
        "-m",
        "titanlite.commands.train",
    ]
    try:
        second = subprocess.run([*launcher, *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    finally:
        release.touch()
    out, err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert (
        second.stderr.strip()
        .splitlines()[-1]
        .startswith(f"titanlite: error: the run folder {tmp_path / 'run'} is in use by another job (pid ")
    )
    assert first.returncode == 0, err[-3000:]
    assert [r["loss"] for r in metrics(tmp_path)] == [r["loss"] for r in metrics(ten)]  # bitwise
    assert not (tmp_path / "run" / ".lock").exists()  # released at the end


def test_a_lock_left_by_a_dead_launcher_is_taken_over_with_a_note(tmp_path, caplog):
    from titanlite.components import run_lock

    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"host": os.uname().nodename, "pid": int(dead.stdout), "job": "launcher x", "started": "earlier"}
    (folder / ".lock").write_text(json.dumps(holder))
    caplog.set_level(logging.INFO, logger="titanlite")
    lock = run_lock.acquire(folder, "launcher y")
    notes = logged(caplog)
    assert lock.mine and notes and "left by a job that is gone" in notes[0]
    with pytest.raises(Exception, match="is in use by another job"):
        run_lock.acquire(folder, "launcher z")
    assert run_lock.acquire(folder, "launcher y").mine is False  # the same job's other launcher shares it
    lock.release()
    assert not (folder / ".lock").exists()


# ---- checksums -------------------------------------------------------------------------------------------


@pytest.mark.slow  # about 25 s; CI runs it (scripts/fault_survey.py repeats it by hand)
def test_a_same_size_corruption_is_found_and_the_older_checkpoint_resumes_exactly(tmp_path, ten):
    corrupted = copy_of(ten, tmp_path / "corrupted")
    damage(next((corrupted / "run" / "step-10").glob("*.distcp")))
    args = [*TEN, "--training.steps", "12"]
    explicit = run_train_sh([*args, "--checkpoint.load_step", "10"], corrupted)
    assert explicit.returncode == 2 and "does not match its checksum" in last_line(explicit), explicit.stderr[-3000:]
    proc = train_in_pool(1, args, corrupted)
    step10 = corrupted / "run" / "step-10"
    assert f"WARNING skipping {step10}: __0_0.distcp does not match its checksum" in proc.stdout
    assert f"resumed from {corrupted / 'run' / 'step-5'} at step 5" in proc.stdout
    direct = copy_of(ten, tmp_path / "direct", steps=(5,))
    train_in_pool(1, [*args, "--checkpoint.load_step", "5"], direct)
    assert [r["loss"] for r in metrics(corrupted)] == [r["loss"] for r in metrics(direct)]  # bitwise, steps 1-12


def test_no_usable_checkpoint_is_exit_2_listing_each_unless_told_to_start_from_scratch(tmp_path, ten):
    run = copy_of(ten, tmp_path)
    for step in (5, 10):  # truncated: found before launch
        distcp = next((run / "run" / f"step-{step}").glob("*.distcp"))
        os.truncate(distcp, distcp.stat().st_size // 2)
    proc = run_train_sh(TEN, run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = last_line(proc)
    assert f"no usable checkpoint in {run / 'run'}: step-10: __0_0.distcp is truncated" in line, line
    assert "step-5: __0_0.distcp is truncated" in line and "checkpoint.start_from_scratch = true" in line
    assert metrics(run)  # nothing was overwritten
    fresh = train_in_pool(1, [*TEN, "--checkpoint.start_from_scratch"], run)
    assert "starting from scratch (checkpoint.start_from_scratch); the run folder's step-10, step-5 are not loaded" in (
        fresh.stdout
    )
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ten)]


# ---- failures as one line --------------------------------------------------------------------------------


@pytest.mark.slow  # about 15 s; CI runs it (test_checkpoint.py's damaged-checkpoint tests stay in the default suite)
def test_a_checkpoint_dcp_cannot_read_is_skipped_for_the_older_one_or_one_line(tmp_path, ten):
    """Saved without checksums (by an earlier titanlite), its first record's header damaged: only DCP can tell."""
    run = copy_of(ten, tmp_path)
    step10 = run / "run" / "step-10"
    (step10 / "checksums.json").unlink()
    damage(next(step10.glob("*.distcp")), at=0)
    explicit = run_train_sh([*TEN, "--checkpoint.load_step", "10"], run)
    assert explicit.returncode == 2 and "Traceback" not in explicit.stderr, explicit.stderr[-3000:]
    assert last_line(explicit).startswith(
        f"titanlite: error: rank 0: {step10} cannot be loaded into this run: UnpicklingError"
    ), explicit.stderr[-3000:]
    proc = train_in_pool(1, TEN, run)  # steps 6-10 again, from step-5
    assert (
        f"WARNING skipping {step10}: DCP could not read its files back; saved without checksums, which file is "
        "damaged cannot be told; resuming from step-5 instead" in proc.stdout
    )
    assert "UnpicklingError" not in proc.stdout
    assert f"resumed from {run / 'run' / 'step-5'} at step 5" in proc.stdout
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ten)]  # the same run, bitwise


def mount_tmpfs_command(folder, megabytes):
    """A command prefix that runs what follows with a tmpfs of `megabytes` MiB at `folder` (a private mount
    namespace, as root or through a user namespace); None where neither is allowed here."""
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {folder}"], capture_output=True)
        if probe.returncode == 0:
            return [*prefix, "sh", "-c", f'mount -t tmpfs -o size={megabytes}m tmpfs {folder} && exec "$@"', "tmpfs"]
    return None


@pytest.mark.slow  # a launch on a tmpfs of 1 MB; CI runs it
def test_a_full_disk_is_one_line_naming_the_folder(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    wrap = mount_tmpfs_command(disk, 30)  # the config, metrics and logs fit; the first checkpoint does not
    if wrap is None:
        pytest.skip("no way to mount a small tmpfs here (needs root or user namespaces)")
    gpt2 = ["--model.tokenizer", "gpt2"]  # 50,304 rows of embedding and their AdamW moments: about 39 MB a checkpoint
    cmd = [
        *wrap,
        str(REPO / "run_train.sh"),
        *last_wins([*TEN, *gpt2, "--job.dump_folder", str(disk), "--job.name", "run"]),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(NGPU="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert last_line(proc).startswith(
        f"titanlite: error: rank 0: the disk holding {disk / 'run'} ran out of space ("
    ), proc.stderr


def test_the_killed_rank_is_the_one_named(tmp_path):
    args = [*TINY, "--training.steps", "6", "--training.local_batch_size", "2"]
    proc = run_train_sh(args, tmp_path, ngpu=2, TITANLITE_FAULT="kill@3:1")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert last_line(proc).startswith("titanlite: error: rank 1: killed by SIGKILL"), proc.stderr[-3000:]


# Without checkpoints slow (CI runs it): the checkpointed one keeps the line and the status in the default suite.
@pytest.mark.parametrize(
    "checkpoints", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["checkpointed", "no-checkpoints"]
)
def test_a_sigterm_to_a_worker_is_its_own_line_and_status(tmp_path, checkpoints):
    args = [*TINY, "--training.steps", "400", "--training.local_batch_size", "2"]
    args += ["--checkpoint.enable", "--checkpoint.interval", "1000"] if checkpoints else []
    cmd = [str(REPO / "run_train.sh"), *last_wins(["--job.dump_folder", str(tmp_path), "--job.name", "run", *args])]
    job = subprocess.Popen(cmd, cwd=REPO, env=env(NGPU="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(job, tmp_path, 3)
    workers = worker_pids(job.pid)  # run_train.sh execs the launcher
    assert len(workers) == 1, workers
    os.kill(int(workers[0]), signal.SIGTERM)  # to the worker, not the launcher
    out, err = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    line = reason_in(err)
    assert line.startswith("titanlite: error: rank 0: stopped by SIGTERM after step "), err[-3000:]
    if checkpoints:
        assert line.endswith("with a checkpoint of it; run the same command to resume"), line
    else:
        assert line.endswith("nothing was saved (checkpoint.enable is false)"), line


@pytest.mark.slow  # CI runs it; the default suite names a killed rank (above)
def test_the_workers_of_a_sigkilled_launcher_end_with_it(tmp_path):
    # An orphaned worker would train on beside the job a new launch starts in the same run folder. The workers are
    # forked from the launcher's forkserver, which ends with the launcher; each worker ends with the server.
    args = [*TINY, "--training.steps", "400", "--training.local_batch_size", "2"]
    cmd = [str(REPO / "run_train.sh"), *last_wins(["--job.dump_folder", str(tmp_path), "--job.name", "run", *args])]
    job = subprocess.Popen(cmd, cwd=REPO, env=env(NGPU="2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(job, tmp_path, 2)
    workers = worker_pids(job.pid)
    assert len(workers) == 2, workers
    job.kill()
    job.wait(timeout=60)  # not communicate(): a worker that outlived it would hold its pipes open
    deadline = time.monotonic() + 30
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in stat_of(w)]
    for stream in (job.stdout, job.stderr):
        stream.close()
    assert not alive, f"workers {alive} outlived their SIGKILLed launcher"


def stat_of(pid: str) -> str:
    """The state field of /proc/PID/stat ('' once the process is gone): Z for a zombie, which has ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


# ---- bad inputs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "launch_env, args, fragment",
    [
        ({"NGPU": "0"}, [], "NGPU='0' is not a number of processes per node"),
        ({"NGPU": "-1"}, [], "NGPU='-1' is not a number of processes per node"),
        ({"NGPU": "abc"}, [], "NGPU='abc' is not a number of processes per node"),
        ({"NNODES": "2"}, [], "NNODES=2 needs RDZV_ENDPOINT=host:port"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0"}, [], "RDZV_ENDPOINT='node0' is not host:port with a port from 1"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "node0:70000"}, [], "RDZV_ENDPOINT='node0:70000' is not host:port"),
        (
            {"LOG_RANK": "1"},
            [],
            "LOG_RANK='1' is not a list of this node's ranks; set it to ranks from 0 to 0 (NGPU=1)",
        ),
        ({"LOG_RANK": ","}, [], "LOG_RANK=',' is not a list of this node's ranks"),
        ({}, ["--optimizer.lr", "inf"], "optimizer.lr=inf is not a finite number"),
        ({}, ["--training.seed", str(10**23)], f"training.seed={10**23} does not fit in a 64-bit integer"),
        (
            {},
            ["--checkpoint.load_step", "7"],
            "checkpoint.load_step=7 resumes from a checkpoint, but checkpoint.enable",
        ),
    ],
    ids=[
        "ngpu0",
        "ngpu-1",
        "ngpu-abc",
        "nnodes-no-endpoint",
        "endpoint-no-port",
        "endpoint-bad-port",
        "log-rank-none",
        "log-rank-empty",
        "lr-inf",
        "seed-1e23",
        "load_step-without-enable",
    ],
)
def test_bad_launch_inputs_are_one_line_and_exit_2(tmp_path, launch_env, args, fragment):
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--job.name", "run", *TINY, *args]
    proc = subprocess.run(
        cmd, cwd=REPO, env=env(**{"NGPU": "1", **launch_env}), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"titanlite: error: {fragment}"), proc.stderr[-3000:]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_dump_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    from titanlite.commands.cli import main

    (tmp_path / "file").write_text("not a folder")
    assert main(["check", *TINY, "--job.dump_folder", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"titanlite: error: {tmp_path / 'file'} is a file, so the run folder {tmp_path / 'file' / 'debug_model'} "
        "cannot be made; set job.dump_folder to a folder"
    )


@pytest.mark.slow  # CI runs it; the default suite names a killed rank (test_the_killed_rank_is_the_one_named)
def test_a_native_crash_names_the_rank_and_prints_its_python_stack(tmp_path):
    """A rank that dies in C (SIGSEGV) is named, and faulthandler printed where its Python code was."""
    args = [*TINY, "--training.steps", "6", "--training.local_batch_size", "2"]
    proc = run_train_sh(args, tmp_path, ngpu=2, TITANLITE_FAULT="segv@3:1")
    assert proc.returncode == 128 + signal.SIGSEGV, proc.stderr[-3000:]
    assert last_line(proc).startswith("titanlite: error: rank 1: crashed in native code (SIGSEGV)"), proc.stderr
    output = proc.stdout + proc.stderr
    assert "Fatal Python error: Segmentation fault" in output
    assert "in after_step" in output  # the stack names the function that crashed


@pytest.mark.slow  # about 45 s: the 5 s timeout, then torchrun's 30 s grace before it SIGKILLs the stopped rank
def test_a_stopped_rank_is_named_by_the_rank_that_timed_out_waiting_for_it(tmp_path):
    """SIGSTOP to rank 1 after step 2: rank 0's collective times out, and the line names rank 1 as stopped (its
    process in state T), rather than reporting rank 0's gloo timeout as the cause."""
    args = [*TINY, "--training.steps", "6", "--training.local_batch_size", "2", "--comm.train_timeout_seconds", "5"]
    proc = run_train_sh(args, tmp_path, ngpu=2, TITANLITE_FAULT="stop@2:1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = last_line(proc)
    assert line.startswith("titanlite: error: rank 0: timed out waiting for rank 1, which is stopped (process "), line
    assert "in state T: SIGSTOP, Ctrl-Z or a debugger" in line and "on step 2; here: RuntimeError: Timed out" in line
