"""What a run reports about itself across stops and resumes: the last line says how many steps this start ran
and where it stopped, elapsed_s goes on from the checkpoint's, and a checkpoint saved before elapsed_s was kept
still loads."""

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from titanlite.commands.train import done_line
from titanlite.components.checkpoint import dcp_load, saved_train_state
from titanlite.components.metrics import MetricsLogger
from titanlite.config import JobConfig

METRICS = Path("checkpoints/debug_model/metrics.jsonl")


def config(steps: int, checkpoints: bool) -> JobConfig:
    cfg = JobConfig()
    cfg.training.steps, cfg.checkpoint.enable = steps, checkpoints
    return cfg


def test_a_whole_run_says_how_many_steps_it_ran():
    assert done_line(0, 20, config(20, False), METRICS) == f"  done: 20 steps; metrics in {METRICS}"


@pytest.mark.parametrize("checkpoints", [True, False])
def test_a_run_stopped_early_says_where_it_stopped(checkpoints):
    line = done_line(0, 10, config(20, checkpoints), METRICS)
    assert line.startswith("  done: 10 steps, stopped at step 10 of 20 as training.stop_after_step asks")
    assert ("to resume" in line) == checkpoints  # nothing to resume from without a checkpoint


def test_a_resumed_run_counts_only_its_own_steps():
    line = done_line(10, 20, config(20, True), METRICS)
    assert line == f"  done: 10 steps (steps 11 to 20, resumed at step 10); metrics in {METRICS}"
    assert done_line(20, 20, config(20, True), METRICS).startswith(
        "  done: 0 steps (the run had reached training.steps=20 already)"
    )


def test_elapsed_time_goes_on_from_the_checkpointed_value(tmp_path):
    metrics = MetricsLogger(tmp_path, enable_tensorboard=False, active=True, elapsed_before=120.0)
    assert metrics.elapsed() >= 120.0
    metrics.log(
        {
            "step": 11,
            "loss": 1.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tps": None,
            "tflops": None,
            "mfu_pct": None,
            "mem_peak_gib": 1.0,
            "eta_s": None,
        }
    )
    metrics.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert 120.0 <= record["elapsed_s"] < 180.0


def load_train_state(path: Path) -> tuple[dict, list[str]]:
    """What a resume restores of a checkpoint's trainer state, over this run's defaults."""
    available = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    defaults = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0}
    state, missing = saved_train_state(defaults, available)
    loaded = {"train_state": state}
    dcp_load(loaded, path)
    return defaults | loaded["train_state"], missing


def test_the_trainer_state_keeps_its_elapsed_time(tmp_path):
    dcp.save(
        {"train_state": {"step": 10, "tokens_seen": 640, "elapsed_s": 23.5}}, checkpoint_id=str(tmp_path), no_dist=True
    )
    assert load_train_state(tmp_path) == ({"step": 10, "tokens_seen": 640, "elapsed_s": 23.5}, [])


def test_a_checkpoint_without_elapsed_time_still_loads(tmp_path):
    # As titanlite saved it before elapsed_s was part of the trainer state.
    dcp.save({"train_state": {"step": 10, "tokens_seen": 640}}, checkpoint_id=str(tmp_path), no_dist=True)
    assert load_train_state(tmp_path) == ({"step": 10, "tokens_seen": 640, "elapsed_s": 0.0}, ["elapsed_s"])
