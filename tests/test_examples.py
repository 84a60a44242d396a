"""Example commands of the docs (docs/running.md, shipped configs) do what they say (slow: full default run, GPT-2 "
"Large on a CPU)."""

import os

import pytest

from tests.helpers import TINY, losses, metrics, run_train_sh, torchrun
from tests.pool import close_pools


@pytest.mark.slow
def test_default_run_learns_by_a_third(tmp_path):
    # With validation on the held-out tail of the corpus (the README's example). `titanlite eval` of a final
    # checkpoint printing the run's last evaluation is test_validation.py's, and the README's block runs it on this
    # config.
    args = ["--metrics.log_freq", "1", "--validation.enable", "true", "--validation.freq", "25"]
    proc = run_train_sh(args, tmp_path, timeout=600)
    values = losses(proc, tmp_path)
    assert len(values) == 100
    assert values[-1] < values[0] * 2 / 3, (values[0], values[-1])
    evaluated = [r for r in metrics(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [25, 50, 75, 100]
    val = [r["val_loss"] for r in evaluated]
    assert all(later < earlier for earlier, later in zip(val, val[1:])), val  # the validation loss falls


@pytest.mark.slow
@pytest.mark.alone  # about 15 GiB of RAM: nothing beside it
def test_gpt2_large_runs_on_cpu_with_774m_parameters(tmp_path):
    args = [
        "--config",
        "train_configs/gpt2_large_zero2.toml",
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "1",
        "--training.seq_len",
        "64",
        "--metrics.log_freq",
        "1",
    ]
    close_pools()  # about 15 GiB of RAM: the pool's idle ranks (tests/pool.py) give theirs back first
    cores = str(len(os.sched_getaffinity(0)))  # alone: every core is this run's (env() gives a launched rank one)
    proc = run_train_sh(args, tmp_path, timeout=900, OMP_NUM_THREADS=cores)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "774,090,240 parameters (774.1 M)" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


@pytest.mark.slow  # bitwise repeats are also what every resume test checks
def test_deterministic_runs_repeat_bitwise(tmp_path):
    runs = []
    for i in range(2):
        run_dir = tmp_path / str(i)
        proc = torchrun(
            1, [*TINY, "--training.steps", "3", "--training.local_batch_size", "2", "--training.deterministic"], run_dir
        )
        runs.append(losses(proc, run_dir))
    assert runs[0] == runs[1]
