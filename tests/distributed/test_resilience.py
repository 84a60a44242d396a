"""A run survives the cluster: a killed worker is restarted and resumes exactly, two launchers act as
two nodes, a SIGTERM leaves a checkpoint to resume from, a NaN stops the run before its step is saved
(the last good checkpoint resumes it exactly), and with training.skip_nonfinite_steps a NaN step changes
no weight or optimizer state, on every layout. Real torchrun jobs on CPU; TITANLITE_FAULT injects the faults."""

import os
import signal
import socket
import subprocess

import pytest
import torch

from tests.helpers import (
    REPO,
    TINY,
    VALIDATED,
    assert_matches,
    checkpoint_tensors,
    env,
    last_wins,
    metrics,
    train_in_pool,
    wait_for_steps,
)

pytestmark = pytest.mark.distributed

TWELVE = [
    *TINY,
    "--training.steps",
    "12",
    "--training.local_batch_size",
    "4",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
]


def launch(args, run_dir, ngpu, timeout=300, **extra_env):
    cmd = [str(REPO / "run_train.sh"), *last_wins(["--job.dump_folder", str(run_dir), "--job.name", "run", *args])]
    return subprocess.run(
        cmd, cwd=REPO, env=env(NGPU=str(ngpu), **extra_env), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train_in_pool(2, TWELVE, run_dir)  # the restarted launches below must end with its losses
    return metrics(run_dir)


@pytest.mark.parametrize("kill_step, resume_step", [(7, 5), pytest.param(11, 10, marks=pytest.mark.slow)])
def test_killed_worker_is_restarted_and_the_run_finishes_exactly(tmp_path, uninterrupted, kill_step, resume_step):
    # Two starts of two ranks (FSDP x 2), rank 1 killed: torchrun restarts both, which resume from the last checkpoint.
    proc = launch(TWELVE, tmp_path, ngpu=2, timeout=600, MAX_RESTARTS="2", TITANLITE_FAULT=f"kill@{kill_step}:1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"killing this rank after step {kill_step}" in out
    assert f"resumed from {tmp_path / 'run' / f'step-{resume_step}'} at step {resume_step}" in out
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["loss"] for r in records[kill_step:]] == [r["loss"] for r in uninterrupted[kill_step:]]  # bitwise


@pytest.mark.slow  # about 13 s; CI runs it
def test_two_launchers_as_two_nodes_match_one_node(tmp_path, reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*VALIDATED, "--training.local_batch_size", "2"]
    nodes = [
        subprocess.Popen(
            [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--job.name", "run", *args],
            cwd=REPO,
            env=env(NGPU="2", NNODES="2", NODE_RANK=str(rank), RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="two-nodes"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    assert "layout: dp_shard 4 on 4 cpu" in "".join(outputs)
    assert_matches(metrics(tmp_path), reference("gpt2"))


# To every process slow (CI runs it): the default suite sends it to the launcher, and resumes.
@pytest.mark.parametrize("to", ["launcher", pytest.param("every process", marks=pytest.mark.slow)])
def test_sigterm_leaves_a_checkpoint_at_the_current_step_and_a_restart_continues(tmp_path, to):
    """SIGTERM to the launcher (`kill PID`), which forwards it to the workers, or to every process of the job at once
    (Slurm at its time limit, `scancel`, `kill -TERM -PGID`), the launcher's forkserver among them: it ignores the
    signal (before, it died of it and took the workers with it, before they saved)."""
    args = [
        *TINY,
        "--training.steps",
        "500",
        "--training.local_batch_size",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
    ]
    cmd = [str(REPO / "run_train.sh"), *last_wins(["--job.dump_folder", str(tmp_path), "--job.name", "run", *args])]
    job = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(NGPU="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a process group of its own: the job's processes and no other
    )
    wait_for_steps(job, tmp_path, 3)
    if to == "launcher":
        job.send_signal(signal.SIGTERM)  # to torchrun (run_train.sh execs it), which forwards it to the workers
    else:
        os.killpg(job.pid, signal.SIGTERM)
    out = job.communicate(timeout=120)[0]
    assert job.returncode != 0, out[-3000:]
    saved = [p for p in (tmp_path / "run").glob("step-*") if not p.name.endswith(".tmp")]
    assert len(saved) == 1, out[-3000:]
    step = int(saved[0].name.removeprefix("step-"))
    assert f"stopped by SIGTERM after step {step}" in out
    assert step >= 3 and metrics(tmp_path)[-1]["step"] == step
    if to != "launcher":
        return  # the restart is the same
    # The restart: the workers' resume (the launcher's part, the signal, is above), on the pool's two ranks.
    proc = train_in_pool(2, [*args, "--training.stop_after_step", str(step + 2)], tmp_path)
    assert f"at step {step}" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, step + 3))


# Checkpoints every step but logs every other one, so that at the NaN step 3 only the checkpoint makes the
# host read the loss: the read that must stop the run before that checkpoint is written.
SIX = [
    *TINY,
    "--training.steps",
    "6",
    "--training.local_batch_size",
    "4",
    "--metrics.log_freq",
    "2",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1",
]


@pytest.fixture(scope="module")
def clean_six(tmp_path_factory):
    """The run folder of SIX on FSDP x 2, with no fault."""
    run_dir = tmp_path_factory.mktemp("clean_six")
    train_in_pool(2, SIX, run_dir)
    return run_dir


@pytest.mark.slow  # about 22 s; CI runs it (test_run_folder_trust.py's non-finite resume is its twin)
def test_nan_loss_stops_before_saving_it_and_a_resume_reproduces_the_clean_run(tmp_path, clean_six):
    from titanlite.components.checkpoint_files import verify

    proc = launch(SIX, tmp_path, ngpu=2, TITANLITE_FAULT="nan@3")
    assert proc.returncode == 3, proc.stderr[-3000:]  # the workers' status, through the launcher
    last = proc.stderr.strip().splitlines()[-1]  # the launcher's last word is a worker's own line
    assert last.startswith("titanlite: error: rank ") and "at step 3 is not finite" in last, last
    # A checkpoint is due every step, but none of the NaN step is written, not even a .tmp folder.
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-1", "step-2"], proc.stdout[-3000:]
    assert verify(run / "step-2") is None
    assert [r["step"] for r in metrics(tmp_path)] == [2]
    # The same run, no fault, on the pool's two ranks (the resume is the workers'): from the newest checkpoint.
    resumed = train_in_pool(2, SIX, tmp_path)
    assert f"resumed from {run / 'step-2'} at step 2" in resumed.stdout, resumed.stdout[-3000:]
    records, clean = metrics(tmp_path), metrics(clean_six)
    assert [r["step"] for r in records] == [r["step"] for r in clean] == [2, 4, 6]
    assert [r["loss"] for r in records] == [r["loss"] for r in clean]  # bitwise
    # Every step from 3 on, not only the logged ones: its weights and optimizer state are the clean run's, bitwise.
    scratch = tmp_path / "converted"
    scratch.mkdir()
    for step in range(3, 7):
        ours = checkpoint_tensors(run / f"step-{step}", scratch / "resumed")
        theirs = checkpoint_tensors(clean_six / "run" / f"step-{step}", scratch / "clean")
        assert ours.keys() == theirs.keys()
        differ = [k for k in ours if not torch_equal(ours[k], theirs[k])]
        assert not differ, (
            f"step {step}: {len(differ)} of {len(ours)} tensors differ from the clean run's: {differ[:10]}"
        )


SKIP_LAYOUTS = [
    pytest.param(1, [], id="single"),
    pytest.param(2, [], id="fsdp2"),
    pytest.param(2, ["--parallelism.tensor_parallel_degree", "2"], id="tp2", marks=pytest.mark.slow),
    pytest.param(
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"],
        id="pp2_1f1b",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("ngpu, layout", SKIP_LAYOUTS)
def test_skip_nonfinite_steps_leaves_the_model_and_optimizer_untouched(tmp_path, ngpu, layout):
    args = [
        *TINY,
        "--training.local_batch_size",
        "4",
        "--training.skip_nonfinite_steps",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        *layout,
    ]
    proc = train_in_pool(ngpu, args, tmp_path, TITANLITE_FAULT="nan@3")  # the trainer's skip, not a launch's
    assert "step 3: loss nan" in proc.stdout and "its update was skipped" in proc.stdout, proc.stdout[-3000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in records if "skipped_steps" in r] == [[3]]
    run, scratch = tmp_path / "run", tmp_path / "converted"
    scratch.mkdir()
    step2, step3, step4 = (checkpoint_tensors(run / f"step-{s}", scratch) for s in (2, 3, 4))
    assert any(k.startswith("model.") for k in step2) and any(k.startswith("optimizer.state.") for k in step2), sorted(
        step2
    )
    assert step3.keys() == step2.keys() == step4.keys()
    # The bad step changed nothing but the LR schedule: weights, Adam moments and step counts as at step 2.
    changed = [k for k in step2 if not torch_equal(step3[k], step2[k])]
    assert not changed, f"the skipped step 3 changed {len(changed)} of {len(step2)} tensors: {changed[:10]}"
    # The next step updates again.
    unchanged = [k for k in step3 if torch_equal(step4[k], step3[k])]
    assert not unchanged, f"step 4 left {len(unchanged)} of {len(step3)} tensors as at step 3: {unchanged[:10]}"


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
