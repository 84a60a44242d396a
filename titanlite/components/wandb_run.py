"""Weights & Biases logging (metrics.enable_wandb): rank 0's metric records and the resolved config in one W&B
run per run folder, whose id the run folder keeps so that a resumed run continues it."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from titanlite.base.errors import ConfigError
from titanlite.config import Metrics

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"  # in the run folder: the W&B run a resume continues
LOCAL_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no login
INSTALL = "install it with `pip install -e .[wandb]` or set metrics.enable_wandb = false"


def check_wandb(metrics: Metrics) -> None:
    """Refuse, before launch, a W&B run that cannot start: no `wandb` package, or no login for an online run."""
    if not metrics.enable_wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.enable_wandb: the wandb package is not installed; {INSTALL}")
    try:  # installed is not enough: a wandb whose own dependencies are missing or too new fails to import
        import wandb  # the optional extra, imported only when metrics.enable_wandb is on (a second to import)
    except Exception as e:
        raise ConfigError(
            f"metrics.enable_wandb: the wandb package does not import ({first_line(e)}); {INSTALL}"
        ) from e
    mode = os.environ.get("WANDB_MODE", "")
    if mode in LOCAL_MODES:
        return
    if mode not in ("", "online", "run", "shared"):
        raise ConfigError(f"WANDB_MODE={mode!r} is not a W&B mode; use online, offline or disabled")

    try:
        logged_in = wandb.login(prompt=False, verify=False)
    except Exception as e:  # a bad WANDB_MODE or settings file: wandb raises its own error types, or pydantic's
        raise ConfigError(f"metrics.enable_wandb: wandb cannot start: {first_line(e)}") from e
    if not logged_in:
        raise ConfigError(
            "metrics.enable_wandb: not logged in to Weights & Biases; run `wandb login`, set WANDB_API_KEY, or set "
            "WANDB_MODE=offline to keep the run in the run folder (upload it later with `wandb sync`)"
        )


class WandbRun:
    """One W&B run for a run folder: a fresh run starts a new one, a resumed run (`resumed`) continues the one
    whose id the folder keeps. Records are logged against their own `step` (W&B's step_metric), so the steps a
    resume logs again after the interrupted attempt's are kept, not dropped as W&B drops a step it has passed."""

    def __init__(self, run_dir: Path, metrics: Metrics, name: str, config: dict[str, Any], resumed: bool):
        import wandb  # the optional extra, imported only when metrics.enable_wandb is on (a second to import)

        id_file = run_dir / RUN_ID_FILE
        run_id = None
        if resumed and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        try:
            self.run = wandb.init(
                project=metrics.wandb_project,
                name=metrics.wandb_run_name or name,
                tags=metrics.wandb_tags or None,
                config=config,
                dir=str(run_dir),
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(silent=True, console="off"),  # the run's own lines say what happens
            )
        except Exception as e:  # a login or settings failure: wandb raises its own error types, or pydantic's
            raise ConfigError(f"metrics.enable_wandb: wandb.init failed: {first_line(e)}") from e
        self.run.define_metric("*", step_metric="step")
        id_file.write_text(self.run.id + "\n")
        where = (
            f"offline in {Path(self.run.dir).parent} (upload it with `wandb sync`)"
            if self.run.offline
            else self.run.url
        )
        logger.info(f"  wandb: run {self.run.id} {'continued' if run_id else 'started'}, {where}")

    def log(self, record: dict[str, Any]) -> None:
        """The record's numbers, as TensorBoard gets them, with its step as the x axis."""
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.run.log(numbers)

    def finish(self) -> None:
        """End the run, and wait for wandb's service to have written it: run.finish() can return before an offline
        run's log is on disk, and a worker leaves with os._exit."""
        import wandb  # imported already by __init__ (the optional extra)

        self.run.finish()
        wandb.teardown()


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
