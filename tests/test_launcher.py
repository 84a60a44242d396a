"""The user's commands: ./run_train.sh refuses bad configs before any worker starts; a run leaves its records."""

import json
import math
import os

import pytest

from tests.helpers import REPO, TINY, VALIDATED, VALIDATION_WINDOWS, metrics, run_train_sh, train_in_pool
from titanlite.commands.cli import main
from titanlite.config.loading import tomllib  # tomli on Python 3.10
from titanlite.parallel.pipeline import V_SHAPED_RUN

BAD_CONFIGS = [
    (
        1,
        ["--training.stepz", "3"],
        "unknown config key 'training.stepz' (command line); did you mean 'training.steps'?",
    ),
    (
        4,
        ["--parallelism.data_parallel_replicate_degree", "3"],
        "data_parallel_replicate_degree=3 does not divide the world size 4",
    ),
    (
        2,
        ["--parallelism.data_parallel_shard_degree", "4"],
        "multiply to 4 (pp 1 x replicate 1 x shard 4 x cp 1 x tp 1) but the world size is 2",
    ),
    (
        2,
        ["--training.local_batch_size", "2", "--training.global_batch_size", "6"],
        "global_batch_size=6 is not a multiple of local_batch_size x dp = 2 x 2 = 4",
    ),
    (
        1,
        ["--model.flavor", "2B"],
        "model.flavor='2B' is not a gpt2 flavor; use one of: debug, 124M, 355M, 774M, 1.5B",
    ),
    (1, ["--config", "train_configs/nope.toml"], "no such file"),
    (3, ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree=3 does not divide n_heads=4"),
    (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"],
        "needs CUDA and torch.compile",
    ),
    (
        2,
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
        "pipeline_parallel_microbatch_size=3 does not divide",
    ),
    (
        4,
        ["--parallelism.pipeline_parallel_degree", "3"],
        "pipeline_parallel_degree=3 does not divide the world size 4",
    ),
    (
        2,
        ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--activation_checkpoint.mode", "full"],
        "fails inside torch 2.13",
    ),
    (1, ["--compile.components", "model,optimizer"], "compile.components names ['optimizer']"),
    (2, ["--training.enable_cpu_offload"], "no CUDA device here"),
    (1, ["--training.seq_len", "10000000"], "too few for training.seq_len=10000000"),
    (
        1,
        ["--training.dataset", "local", "--training.dataset_path", "/nonexistent"],
        "dataset_path='/nonexistent' does not exist",
    ),
    (  # run_train.sh runs from the checkout: a relative path says so
        1,
        ["--training.dataset", "local", "--training.dataset_path", "nosuch.jsonl"],
        f"dataset_path='nosuch.jsonl' (resolved against {REPO}) does not exist",
    ),
    (
        1,
        ["--validation.enable", "--validation.split_fraction", "0.000001"],
        "too few for one window of validation.seq_len=128",
    ),
    (
        2,
        [
            "--validation.enable",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "DualPipeV",
        ],
        # torch 2.11 cannot run V-shaped schedules at all: that refusal comes first there
        "validation under pipeline_parallel_schedule=DualPipeV fails inside torch"
        if V_SHAPED_RUN
        else "pipeline_parallel_schedule=DualPipeV needs torch 2.12 or later",
    ),
]


@pytest.mark.parametrize("ngpu, args, fragment", BAD_CONFIGS)
def test_bad_config_exits_2_with_one_line_before_launch(tmp_path, ngpu, args, fragment, capsys, monkeypatch):
    """Each refusal of what run_train.sh runs before torchrun: `titanlite check` at NGPU's world size, from the
    checkout, here in this process (a process per case was 18 start-ups of torch for one launcher behaviour). That
    run_train.sh stops there, before any worker, with the same line and status: the test below."""
    monkeypatch.chdir(REPO)
    world = ["--world-size", str(ngpu), "--nproc-per-node", str(ngpu)]
    code = main(["check", *world, "--job.dump_folder", str(tmp_path), "--job.name", "run", *args])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("titanlite: error: ")
    assert fragment in lines[0]
    assert not (tmp_path / "run").exists()  # nothing written


# One refusal that the config alone gives (a misspelt key) and one that needs the model's shape and the world size.
@pytest.mark.parametrize("ngpu, args, fragment", [BAD_CONFIGS[0], BAD_CONFIGS[6]], ids=["key", "layout"])
def test_run_train_sh_stops_before_any_worker_with_checks_line_and_status(tmp_path, ngpu, args, fragment):
    proc = run_train_sh(args, tmp_path, ngpu=ngpu)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("titanlite: error: ")
    assert fragment in lines[0]
    assert "torch.distributed" not in proc.stdout + proc.stderr  # no worker was started
    assert not (tmp_path / "run").exists()


def test_help_lists_config_keys(tmp_path):
    proc = run_train_sh(["--help"], tmp_path)
    assert proc.returncode == 0
    assert "--parallelism.fsdp_reshard_after_forward" in proc.stdout
    assert "ZeRO-3" in proc.stdout


def test_run_folder_has_resolved_config_metrics_and_tensorboard(tmp_path):
    proc = train_in_pool(1, [*VALIDATED, "--training.local_batch_size", "2", "--metrics.enable_tensorboard"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    cfg = tomllib.loads((run / "config.toml").read_text())
    assert cfg["training"]["seq_len"] == 32 and cfg["metrics"]["enable_tensorboard"] is True
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for field in (
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tps",
        "tflops",
        "mfu_pct",
        "mem_peak_gib",
        "elapsed_s",
        "data_wait_pct",
    ):
        assert all(field in r for r in records), field
    assert records[0]["tps"] is None and records[2]["tps"] > 0  # warm-up steps are not counted
    assert records[2]["mfu_pct"] is None  # no known peak for a CPU: not guessed
    assert records[-1]["mem_peak_gib"] > 0
    assert all(0 <= r["data_wait_pct"] < 100 for r in records)
    # validation (VALIDATED evaluates at steps 2, 4 and 5): in the records, the console line and TensorBoard
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4, 5]
    assert all(
        r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) and r["val_tokens"] == VALIDATION_WINDOWS * 32
        for r in evaluated
    )
    assert f"val_loss {evaluated[-1]['val_loss']:.4f}  val_ppl {evaluated[-1]['val_perplexity']:.2f}" in proc.stdout
    events = list((run / "tb").glob("events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(events[0])).Reload().Tags()["scalars"]
    assert {"loss", "val_loss", "val_perplexity", "val_tokens"} <= set(scalars)
    # every console line of a logged step carries the same figures
    assert "step      5  loss" in proc.stdout and "tps" in proc.stdout and "mfu n/a" in proc.stdout
    json.dumps(records)


def test_fresh_run_replaces_old_metrics(tmp_path):
    for _ in range(2):
        proc = train_in_pool(1, [*TINY, "--training.steps", "2", "--training.local_batch_size", "2"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]


@pytest.mark.slow  # two runs, about 25 s on 2 shared cores; CI runs it (tests/unit/test_run_figures.py: the parts)
def test_a_stopped_run_says_where_it_stopped_and_its_resume_goes_on_counting_time(tmp_path):
    args = [*TINY, "--training.steps", "4", "--training.local_batch_size", "2", "--checkpoint.enable"]
    stopped = train_in_pool(1, [*args, "--training.stop_after_step", "2"], tmp_path)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "  done: 2 steps, stopped at step 2 of 4 as training.stop_after_step asks" in stopped.stdout
    resumed = train_in_pool(1, args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "  done: 2 steps (steps 3 to 4, resumed at step 2)" in resumed.stdout
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    elapsed = [r["elapsed_s"] for r in records]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:])), elapsed  # no restart at 0 after the resume


@pytest.mark.parametrize(
    "ngpu, fault, status, rank, reason",
    [
        (
            2,
            "error@2:1",
            1,
            1,
            "RuntimeError: fault injection: an error after step 2 (titanlite/components/resilience.py:",
        ),
        pytest.param(  # slow (CI runs it): the default suite keeps the 2-rank error and its status 1
            1,
            "oom@2",
            4,
            0,
            "out of device memory (fault injection: out of memory after step 2 (simulated)) at "
            "titanlite/components/resilience.py:",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_failed_worker_says_why_last_and_sets_the_exit_status(tmp_path, ngpu, fault, status, rank, reason):
    # A worker exception on rank 1 of 2 (rank 0 then loses its peer: the launcher names the first failure)
    # and a simulated out-of-memory error; the non-finite loss (status 3) is in test_resilience.py.
    proc = run_train_sh(TINY, tmp_path, ngpu=ngpu, TITANLITE_FAULT=fault)
    assert proc.returncode == status, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    log = tmp_path / "run" / "logs" / f"error-rank{rank}.log"
    assert last.startswith(f"titanlite: error: rank {rank}: {reason}") and last.endswith(f"; traceback in {log}"), last
    assert "Traceback (most recent call last)" in log.read_text()
    # Rank 0, whose collective then loses rank 1, says its failure follows from rank 1's (when it records one
    # before the launcher stops it): never a lost connection of its own as the cause.
    peers = [line for line in proc.stderr.splitlines() if line.startswith("titanlite: error: rank 0:") and rank != 0]
    assert all(
        line.startswith(f"titanlite: error: rank 0: lost its peers after rank 1 failed (rank 1's error: {reason}")
        for line in peers
    ), peers


def test_run_train_sh_refuses_a_thread_count_libgomp_cannot_take(tmp_path):
    # libgomp warns and trains on with its own count; refused in the shell, before any interpreter starts (a few
    # milliseconds each, so not a slow test though it runs run_train.sh).
    for value in ("0", "abc", "-1", "2.5"):
        proc = run_train_sh([], tmp_path, ngpu=1, OMP_NUM_THREADS=value)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.splitlines() == [
            f"titanlite: error: OMP_NUM_THREADS='{value}' is not a number of threads; set it to 1 or more (e.g. "
            "OMP_NUM_THREADS=4), or leave it unset for the cores per process"
        ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # run_train.sh's NGPU default; tests/unit/test_devices.py checks the NGPU rules in-process
def test_ngpu_default_in_a_simulated_gpu_environment(tmp_path):
    # nvidia-smi lists 3 GPUs (a fake on PATH); torch still sees none, so every rank computes on the CPU.
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(3))
    )
    fake.chmod(0o755)
    path = f"{fake.parent}:{os.environ['PATH']}"
    args = [*TINY, "--training.steps", "1", "--training.local_batch_size", "2"]
    # The test suite's TITANLITE_DEVICE=cpu: one process, whatever GPUs the machine lists.
    cpu = run_train_sh(args, tmp_path / "cpu", ngpu=None, PATH=path)
    assert cpu.returncode == 0 and "on 1 cpu process(es)" in cpu.stdout, cpu.stderr[-3000:]
    # The default device: one process per GPU left visible by CUDA_VISIBLE_DEVICES (2 of the 3).
    gpus = run_train_sh(args, tmp_path / "gpus", ngpu=None, PATH=path, TITANLITE_DEVICE="", CUDA_VISIBLE_DEVICES="0,1")
    assert gpus.returncode == 0 and "config ok for 2 process(es)" in gpus.stdout, gpus.stderr[-3000:]
