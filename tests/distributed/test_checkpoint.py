"""DCP checkpoints: exact resume, resume on another layout, corrupt and interrupted saves, retention,
async saves, seed checkpoints and Hugging Face export, all with real runs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import (
    REPO,
    TINY,
    assert_close,
    cli_in_pool,
    env,
    last_wins,
    losses,
    metrics,
    run_train_sh,
    torchrun,
    train_in_pool,
)

pytestmark = pytest.mark.distributed

TWENTY = [*TINY, "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "5"]
LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp4": (4, ["--training.local_batch_size", "2"]),
    "pp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
}


def run(layout, run_dir, *extra):
    nproc, args = LAYOUTS[layout]
    proc = train_in_pool(nproc, [*TWENTY, *args, *extra], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def launched(layout, run_dir, *extra):
    """The same run as run(), through torchrun's fresh workers."""
    nproc, args = LAYOUTS[layout]
    proc = torchrun(nproc, [*TWENTY, *args, *extra], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def fsdp4_runs(tmp_path_factory):
    """FSDP x 4: 20 steps straight, and a run stopped after step 10 (its step-10 checkpoint is reused)."""
    straight, stopped = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("stopped")
    run("fsdp4", straight)
    run("fsdp4", stopped, "--training.stop_after_step", "10")
    return straight, stopped


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """straight_run(layout) -> the folder of an uninterrupted 20-step run on `layout`, made once per module: the
    reference of the bitwise resume and of the process-based saver on that layout."""
    cache = {}

    def get(layout):
        if layout not in cache:
            folder = tmp_path_factory.mktemp(f"straight_{layout}")
            run(layout, folder)
            cache[layout] = folder
        return cache[layout]

    return get


def resume_copy(stopped, dest):
    """A run folder holding only what the stopped run left at step 10."""
    (dest / "run").mkdir(parents=True)
    shutil.copytree(stopped / "run" / "step-10", dest / "run" / "step-10")
    shutil.copy(stopped / "run" / "metrics.jsonl", dest / "run" / "metrics.jsonl")
    return dest


# Slow (CI runs them): the default suite's bitwise resume is test_resilience.py's killed FSDP x 4 worker, restarted.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) for name in ("single", "fsdp4", "pp2")])
def test_resume_is_bitwise_exact(tmp_path, fsdp4_runs, straight_run, layout):
    if layout == "fsdp4":
        straight, stopped = fsdp4_runs
    else:
        straight, stopped = straight_run(layout), tmp_path / "stopped"
        run(layout, stopped, "--training.stop_after_step", "10")
    assert [r["step"] for r in metrics(stopped)] == list(range(1, 11))
    assert sorted(p.name for p in (stopped / "run").glob("step-*")) == ["step-10", "step-5"]
    proc = run(layout, stopped)
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    resumed, expected = metrics(stopped), metrics(straight)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed[10:]] == [r["loss"] for r in expected[10:]]  # bitwise
    assert [r["grad_norm"] for r in resumed[10:]] == [r["grad_norm"] for r in expected[10:]]


# Slow (CI runs them): the default suite resumes on another layout in test_muon.py (a Muon checkpoint).
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) for name in ("tp2", "pp2")])
def test_resume_on_another_layout_continues_the_same_run(tmp_path, fsdp4_runs, layout):
    straight, stopped = fsdp4_runs
    run(layout, resume_copy(stopped, tmp_path))
    assert_close([r["loss"] for r in metrics(tmp_path)[10:]], [r["loss"] for r in metrics(straight)[10:]], 1e-5)


@pytest.mark.parametrize("damage", ["truncated", pytest.param("missing", marks=pytest.mark.slow)])
def test_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, fsdp4_runs, damage):
    straight, stopped = fsdp4_runs
    dest = resume_copy(stopped, tmp_path)
    shutil.copytree(straight / "run" / "step-15", dest / "run" / "step-15")
    data = max((dest / "run" / "step-15").glob("*.distcp"), key=lambda p: p.stat().st_size)
    if damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)  # a file cut short mid-way
    else:
        data.unlink()  # a file deleted
    proc = run("fsdp4", dest)
    assert f"WARNING skipping {dest / 'run' / 'step-15'}: {data.name} is {damage}" in proc.stdout
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    assert [r["loss"] for r in metrics(dest)[10:]] == [r["loss"] for r in metrics(straight)[10:]]


def test_load_step_naming_a_damaged_checkpoint_is_a_clear_error(tmp_path, fsdp4_runs):
    _, stopped = fsdp4_runs
    dest = resume_copy(stopped, tmp_path)
    next((dest / "run" / "step-10").glob("*.distcp")).unlink()  # a file deleted
    proc = run_train_sh([*TWENTY, "--checkpoint.load_step", "10"], dest, ngpu=1)
    assert proc.returncode != 0
    assert "checkpoint.load_step=10: cannot load" in proc.stdout + proc.stderr
    assert "is missing" in proc.stdout + proc.stderr


def test_keep_latest_k_leaves_the_two_newest(tmp_path):
    run("single", tmp_path, "--training.steps", "10", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2")
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step")) == ["step-10", "step-8"]


@pytest.mark.slow  # ~30 s; test_killed_during_async_saves_leaves_only_loadable_checkpoints resumes from async saves too
def test_async_save_resumes_exactly(tmp_path, fsdp4_runs):
    straight, _ = fsdp4_runs
    run("fsdp4", tmp_path, "--checkpoint.async_mode", "async", "--training.stop_after_step", "10")
    assert (tmp_path / "run" / "step-10").is_dir() and not list((tmp_path / "run").glob("*.tmp"))
    run("fsdp4", tmp_path, "--checkpoint.async_mode", "async")
    assert [r["loss"] for r in metrics(tmp_path)[10:]] == [r["loss"] for r in metrics(straight)[10:]]


# One process is the case that crashed on a GPU (no process group for DCP's process-based saver); FSDP x 4
# (slow) reuses fsdp4_runs' uninterrupted run.
@pytest.mark.slow  # both layouts: the default suite keeps under 15 minutes; CI runs them
@pytest.mark.parametrize("layout", ["single", "fsdp4"])
def test_process_saver_resumes_exactly_and_leaves_no_tmp(tmp_path, fsdp4_runs, straight_run, layout):
    """async_with_pinned_mem runs DCP's process-based saver on the CPU too (shared, not pinned, memory):
    saves every 5 steps, a stop at 10 and a resume to 20 give the uninterrupted run's losses bit for bit."""
    mode = ["--checkpoint.async_mode", "async_with_pinned_mem"]
    if layout == "fsdp4":
        straight, _ = fsdp4_runs
    else:
        straight = straight_run(layout)  # test_resume_is_bitwise_exact[single]'s reference too
    # Launched, not in the pool: DCP's saver process starts from the worker's entry point and logs to its stderr.
    first = launched(layout, tmp_path, *mode, "--training.stop_after_step", "10")
    assert (
        "copied to shared (pinned memory needs CUDA) host memory, then written by a background process" in first.stdout
    )
    assert "Checkpoint background process is running" in first.stdout + first.stderr  # DCP's process saver's own log
    assert "Traceback" not in first.stdout + first.stderr  # its writing process ended cleanly
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-10", "step-5"]
    second = launched(layout, tmp_path, *mode)
    assert "at step 10" in second.stdout
    assert [r["loss"] for r in metrics(tmp_path)[10:]] == [r["loss"] for r in metrics(straight)[10:]]
    assert [r["grad_norm"] for r in metrics(tmp_path)[10:]] == [r["grad_norm"] for r in metrics(straight)[10:]]
    assert not list((tmp_path / "run").glob("*.tmp"))


@pytest.mark.slow  # a launch killed at a moment; CI runs it (damaged checkpoints are skipped in the default suite)
def test_killed_during_async_saves_leaves_only_loadable_checkpoints(tmp_path):
    from titanlite.components.checkpoint_files import verify

    # Save asynchronously after every step and kill the whole job at an arbitrary moment.
    args = [
        *TINY,
        "--training.steps",
        "200",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.async_mode",
        "async",
        "--training.local_batch_size",
        "4",
    ]
    cmd = [
        sys.executable,
        "-m",
        "titanlite.commands.launch",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'logs'}",
        "-m",
        "titanlite.commands.train",
        *last_wins(["--job.dump_folder", str(tmp_path), "--job.name", "run", *args]),
    ]
    job = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.time() + 300  # a loaded machine (two pytest workers) starts the job slowly
    while time.time() < deadline and job.poll() is None and len(list((tmp_path / "run").glob("step-*"))) < 4:
        time.sleep(0.2)
    assert job.poll() is None, job.communicate()[0][-3000:]  # still running: the kill lands during its saves
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    complete = [p for p in (tmp_path / "run").glob("step-*") if not p.name.endswith(".tmp")]
    assert complete, "no checkpoint completed before the kill"
    assert all(verify(p) is None for p in complete)
    proc = train_in_pool(
        2,
        [
            *args,
            "--training.steps",
            "200",
            "--training.stop_after_step",
            str(max(int(p.name[5:]) for p in complete) + 1),
        ],
        tmp_path,
    )
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow  # about 20 s; CI runs it
def test_seed_checkpoint_gives_every_layout_the_same_start(tmp_path):
    # Write initial weights once (seed 7), in one process, into two run folders.
    for name in ("one", "two"):  # `titanlite seed-checkpoint` on the pool's one rank (tests/helpers.py cli_in_pool)
        args = [*TINY, "--job.dump_folder", str(tmp_path / name), "--job.name", "run", "--training.seed", "7"]
        seed = cli_in_pool(["seed-checkpoint", *args])
        assert seed.returncode == 0, seed.stderr
    common = [*TINY, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "100"]
    one = train_in_pool(1, [*common, "--training.local_batch_size", "8"], tmp_path / "one")
    two = train_in_pool(2, [*common, "--training.local_batch_size", "4"], tmp_path / "two")
    fresh = train_in_pool(1, [*TINY, "--training.steps", "3", "--training.local_batch_size", "8"], tmp_path / "fresh")
    assert "(model weights only)" in two.stdout
    assert_close(losses(two, tmp_path / "two"), losses(one, tmp_path / "one"), 1e-5)
    # the seed checkpoint replaced the run's own initialisation (seed 42), so the start differs from a fresh run
    assert losses(one, tmp_path / "one")[0] != losses(fresh, tmp_path / "fresh")[0]


def test_export_to_hugging_face_matches_titanlite_logits(tmp_path, fsdp4_runs):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
    )
    import torch

    from titanlite.components.checkpoint import load_model_only
    from titanlite.models.build import build_model

    straight, _ = fsdp4_runs
    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "titanlite.commands.cli",
            "convert",
            "to-hf",
            "--output",
            str(out),
            *TINY,
            "--job.dump_folder",
            str(straight),
            "--job.name",
            "run",
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ours = build_model("gpt2", "debug", 257, 32)  # TINY's byte tokenizer: 257 ids
    load_model_only(straight / "run" / "step-20", ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-5, rtol=1e-5)
    json.loads((out / "config.json").read_text())
