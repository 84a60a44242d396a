"""A training worker, what torchrun runs on every rank (`python -m titanlite.commands.launch ... -m
titanlite.commands.train`, through ./run_train.sh): build every piece (titanlite/builder/), then train.

`titanlite check` runs the same checks in one process before torchrun starts any worker.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from titanlite.builder.plan import plan_run
from titanlite.builder.run import build_trainer
from titanlite.builder.runtime import start_rank
from titanlite.commands.measure_memory import measure_peak
from titanlite.commands.worker import die_with_launcher, exit_from, run_worker
from titanlite.config import JobConfig, help_text

logger = logging.getLogger(__spec__.name)  # not __name__: under `python -m` this module is __main__


def train(cfg: JobConfig) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    plan = plan_run(cfg, world_size)
    device = start_rank(cfg, plan, world_size)
    trainer = build_trainer(cfg, plan, device, rank, world_size)
    measure_to = os.environ.get("TITANLITE_MEASURE_MEMORY", "")
    try:
        try:
            if measure_to:  # `titanlite plan --measure`: tensor-level peak memory of this rank, by category
                out = Path(measure_to) / f"rank{rank}.json"
                measure_peak(trainer, plan.dims.fsdp_enabled, device, out, cfg.training.steps)
            else:
                first = trainer.step
                trainer.train(cfg.training.steps, cfg.training.stop_after_step)
                metrics_path = Path(cfg.job.dump_folder) / cfg.job.name / "metrics.jsonl"
                logger.info(done_line(first, trainer.step, cfg, metrics_path))
        finally:  # the thread building batches ahead would otherwise poll its full queue while the process lives
            trainer.loader.close()
        trainer.checkpointer.close()
        trainer.logger.close()
    finally:  # the stop signals' own handlers back, once the last checkpoint is written
        if trainer.resilience.stop is not None:
            trainer.resilience.stop.close()


def done_line(first: int, last: int, cfg: JobConfig, metrics_path: Path) -> str:
    """The run's last line: how many steps this start ran (not training.steps), from which step it resumed, and
    where an early stop (training.stop_after_step) left the run."""
    total = cfg.training.steps
    ran = f"{last - first} steps" + (f" (steps {first + 1} to {last}, resumed at step {first})" if first else "")
    if first >= total:
        ran = f"0 steps (the run had reached training.steps={total} already)"
    elif last < total:
        ran += f", stopped at step {last} of {total} as training.stop_after_step asks"
        if cfg.checkpoint.enable:
            ran += "; run again without it (or with a later step) to resume"
    return f"  done: {ran}; metrics in {metrics_path}"


def main(argv: list[str] | None = None) -> int:
    """One worker's run; its exit status says how it ended (titanlite/base/failures.py), and a failure is
    one line on stderr with the traceback in the run folder."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    die_with_launcher()
    return run_worker(train, argv)


if __name__ == "__main__":
    exit_from(main)
