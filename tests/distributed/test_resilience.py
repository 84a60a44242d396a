"""A run survives the cluster: a killed worker is restarted and resumes exactly, two launchers act as
two nodes, a SIGTERM leaves a checkpoint to resume from, and a NaN stops the run with the last good
checkpoint intact. Real torchrun jobs on CPU; TITANLITE_FAULT injects the faults."""

import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import REPO, TINY, VALIDATED, assert_matches, env, metrics, run_train_sh

pytestmark = pytest.mark.distributed

TWELVE = [*TINY, "--training.steps", "12", "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "5"]


def launch(args, run_dir, ngpu, timeout=300, **extra_env):
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(run_dir), "--job.name", "run", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(NGPU=str(ngpu), **extra_env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(TWELVE, run_dir, ngpu=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics(run_dir)


@pytest.mark.parametrize("kill_step, resume_step", [(7, 5), pytest.param(11, 10, marks=pytest.mark.slow)])
def test_killed_worker_is_restarted_and_the_run_finishes_exactly(tmp_path, uninterrupted, kill_step, resume_step):
    proc = launch(TWELVE, tmp_path, ngpu=4, MAX_RESTARTS="2", TITANLITE_FAULT=f"kill@{kill_step}:1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"killing this rank after step {kill_step}" in out
    assert f"resumed from {tmp_path / 'run' / f'step-{resume_step}'} at step {resume_step}" in out
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["loss"] for r in records[kill_step:]] == [r["loss"] for r in uninterrupted[kill_step:]]  # bitwise


def test_two_launchers_as_two_nodes_match_one_node(tmp_path, reference):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [*VALIDATED, "--training.local_batch_size", "2"]
    nodes = [
        subprocess.Popen(
            [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--job.name", "run", *args],
            cwd=REPO, env=env(NGPU="2", NNODES="2", NODE_RANK=str(rank), RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="two-nodes"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    assert "layout: dp_shard 4 on 4 cpu" in "".join(outputs)
    assert_matches(metrics(tmp_path), reference("gpt2"))


def test_sigterm_leaves_a_checkpoint_at_the_current_step_and_a_restart_continues(tmp_path):
    args = [*TINY, "--training.steps", "500", "--training.local_batch_size", "2", "--checkpoint.enable",
            "--checkpoint.interval", "1000"]
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), "--job.name", "run", *args]
    job = subprocess.Popen(cmd, cwd=REPO, env=env(NGPU="2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and len(metrics(tmp_path)) < 3:
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)  # to torchrun (run_train.sh execs it), which forwards it to the workers
    out = job.communicate(timeout=120)[0]
    assert job.returncode != 0, out[-3000:]
    saved = [p for p in (tmp_path / "run").glob("step-*") if not p.name.endswith(".tmp")]
    assert len(saved) == 1, out[-3000:]
    step = int(saved[0].name.removeprefix("step-"))
    assert f"stopped by SIGTERM after step {step}" in out
    assert step >= 3 and metrics(tmp_path)[-1]["step"] == step
    proc = run_train_sh([*args, "--training.stop_after_step", str(step + 2)], tmp_path, ngpu=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {step}" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, step + 3))


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    from titanlite.checkpoint import verify

    args = [*TINY, "--training.steps", "10", "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    proc = launch(args, tmp_path, ngpu=2, TITANLITE_FAULT="nan@5")
    assert proc.returncode == 3, proc.stderr[-3000:]  # the workers' status, through the launcher
    last = proc.stderr.strip().splitlines()[-1]  # the launcher's last word is a worker's own line
    assert last.startswith("titanlite: error: rank ") and "at step 5 is not finite" in last, last
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-2", "step-4"]
    assert verify(tmp_path / "run" / "step-4") is None
    assert metrics(tmp_path)[-1]["step"] == 4


def test_skip_nonfinite_steps_goes_on(tmp_path):
    args = [*TINY, "--training.steps", "6", "--training.local_batch_size", "4", "--training.skip_nonfinite_steps"]
    proc = launch(args, tmp_path, ngpu=2, TITANLITE_FAULT="nan@3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 3: loss nan" in proc.stdout and "skipping its update" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
