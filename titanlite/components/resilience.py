"""Surviving the cluster: preemption signals, collective timeouts, and the fault hooks the tests use to
prove that a killed worker's job resumes exactly (the exceptions they end in are titanlite/base/errors.py's)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlite.base.logs import EVERY_RANK
from titanlite.components.torch_private import set_every_group_timeout

logger = logging.getLogger(__name__)


# The signals that stop a run after a step, with a checkpoint (torchrun forwards each of them to the workers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopOnSignal:
    """SIGTERM/SIGINT/SIGHUP ask the run to stop after a step (with a checkpoint); a second one leaves at once.
    SIGHUP is what a closed terminal or a dropped ssh session sends: a preemption like the others, not a crash.

    Ranks receive signals at different moments, so they agree on the step with a one-number all-reduce.
    It costs no step a wait: the flags live in host memory and go through a gloo group of their own,
    without blocking; the exchange started after step s is read after step s + 1 (long finished by
    then), so every rank learns the same verdict after the same step, one step after the signal."""

    def __init__(self, device: torch.device, saves: bool = True):
        self.signum, self.first_at = 0, 0.0
        self.saves = saves  # checkpoint.enable: whether the stop leaves a checkpoint
        self.group = None
        # (work, buffer) of the exchange started after the previous step
        self.pending: tuple[dist.Work, bytearray] | None = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")  # host tensors, off the NCCL stream
        self.before = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}

    def close(self) -> None:
        """Give the signals back the handlers they had, at the end of a run no signal stopped: a process that goes
        on (a library caller, a test) would otherwise keep a handler that only asks a finished run to stop. After a
        signal the handler stays, as the process is on its way out and must not die of the launcher's echo."""
        if not self.signum:
            for sig, handler in self.before.items():
                signal.signal(sig, handler)

    def handle(self, signum, frame) -> None:
        # Ctrl-C reaches the launcher and the workers, and the launcher then forwards a SIGTERM: a
        # signal within a few seconds of the first is that echo, not a second request.
        if self.signum and time.monotonic() - self.first_at < 3.0:
            return
        if self.signum:
            logger.error(f"titanlite: second {signal.Signals(signum).name}: leaving now", extra=EVERY_RANK)
            os._exit(128 + signum)
        self.signum, self.first_at = signum, time.monotonic()
        logger.warning(f"titanlite: {signal.Signals(signum).name}: {self.plan()}", extra=EVERY_RANK)

    def plan(self) -> str:
        """What happens next, as the signal's warning says it."""
        when = "this step" if self.group is None else "the next step (the ranks agree on it one step late)"
        then = "then saving a checkpoint of it" if self.saves else "without a checkpoint (checkpoint.enable is false)"
        return f"stopping after {when}, {then}"

    def requested(self) -> int:
        """Called after every step: the signal every rank agrees on (0: keep going)."""
        if self.group is None:
            return self.signum
        agreed = self.finish()
        if not agreed:
            buffer = bytearray(self.signum.to_bytes(4, "little"))
            work = dist.all_reduce(
                torch.frombuffer(buffer, dtype=torch.int32), op=dist.ReduceOp.MAX, group=self.group, async_op=True
            )
            self.pending = (work, buffer)
        return agreed

    def finish(self) -> int:
        """Wait for the exchange in flight, if any (also before the process group goes away); its verdict."""
        if self.pending is None:
            return 0
        work, buffer = self.pending
        self.pending = None
        work.wait()
        return int.from_bytes(buffer, "little")


def set_train_timeout(seconds: float) -> None:
    """After the first step (start-up and compilation are covered by the longer init timeout), a
    collective that waits longer than this fails, so a dead peer stops the job instead of hanging it."""
    if not dist.is_initialized():
        return
    set_every_group_timeout(timedelta(seconds=seconds))


FAULTS = ("kill", "nan", "spike", "drop", "error", "oom", "segv", "stop", "hang", "wait")  # TITANLITE_FAULT's names
SPIKE_SCALE = 1000.0  # what `spike@STEP` multiplies that step's gradients by


class Faults:
    """Test hooks, set by TITANLITE_FAULT (comma-separated): `kill@STEP:RANK` SIGKILLs that rank after STEP on the
    first attempt only (so the restarted job can finish); `nan@STEP` makes that step's loss NaN; `spike@STEP`
    multiplies that step's gradients by 1000 after the backward pass, on every layout alike (a gradient spike;
    several items make a run of them); `drop@STEP` discards the batch that step would train on, which the next batch
    replaces (a run without it); `error@STEP:RANK` and `oom@STEP:RANK` raise a RuntimeError / torch.OutOfMemoryError
    on that rank after STEP; `segv@STEP:RANK` crashes that rank in native code (a null read) after STEP;
    `stop@STEP:RANK` stops that rank with SIGSTOP after STEP and `hang@STEP:RANK` makes it sleep for good there,
    both on the first attempt (a rank that stops answering; its peers' collectives time out); `wait@STEP:RANK` makes
    that rank wait after STEP until the file TITANLITE_FAULT_RELEASE names exists (a job held busy until a test lets
    it go) (RANK defaults to 0). An item of another form is a ValueError, not a fault that never happens."""

    def __init__(self, spec: str, rank: int):
        self.kill_step = self.nan_step = self.error_step = self.oom_step = self.segv_step = 0
        self.stop_step = self.hang_step = self.wait_step = 0
        self.spike_steps: set[int] = set()
        self.drop_steps: set[int] = set()
        self.release = os.environ.get("TITANLITE_FAULT_RELEASE", "")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        for item in filter(None, (s.strip() for s in spec.split(","))):
            what, _, where = item.partition("@")
            step, _, fault_rank = where.partition(":")
            if what not in FAULTS or not step.isdigit() or not (fault_rank or "0").isdigit():
                raise ValueError(
                    f"TITANLITE_FAULT item {item!r} is not NAME@STEP or NAME@STEP:RANK, NAME one of {', '.join(FAULTS)}"
                )
            here = int(fault_rank or 0) == rank
            if what == "kill" and here and first_attempt:
                self.kill_step = int(step)
            elif what == "nan":
                self.nan_step = int(step)
            elif what == "spike":
                self.spike_steps.add(int(step))
            elif what == "drop":
                self.drop_steps.add(int(step))
            elif what == "error" and here:
                self.error_step = int(step)
            elif what == "oom" and here:
                self.oom_step = int(step)
            elif what == "segv" and here:
                self.segv_step = int(step)
            elif what == "stop" and here and first_attempt:
                self.stop_step = int(step)
            elif what == "hang" and here and first_attempt:
                self.hang_step = int(step)
            elif what == "wait" and here:
                if not self.release:
                    raise ValueError(
                        "TITANLITE_FAULT=wait@STEP needs TITANLITE_FAULT_RELEASE (the file that releases it)"
                    )
                self.wait_step = int(step)

    def after_step(self, step: int) -> None:
        if step == self.kill_step:
            logger.warning(f"titanlite: fault injection: killing this rank after step {step}", extra=EVERY_RANK)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.error_step:
            raise RuntimeError(f"fault injection: an error after step {step}")
        if step == self.oom_step:
            raise torch.OutOfMemoryError(f"fault injection: out of memory after step {step} (simulated)")
        if step == self.segv_step:
            logger.warning(
                f"titanlite: fault injection: a null read in native code after step {step}", extra=EVERY_RANK
            )
            ctypes.string_at(0)
        if step == self.stop_step:
            logger.warning(f"titanlite: fault injection: SIGSTOP to this rank after step {step}", extra=EVERY_RANK)
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == self.hang_step:
            logger.warning(f"titanlite: fault injection: this rank hangs after step {step}", extra=EVERY_RANK)
            while True:
                time.sleep(60)
        if step == self.wait_step:
            logger.warning(
                f"titanlite: fault injection: waiting after step {step} for {self.release}", extra=EVERY_RANK
            )
            while not os.path.exists(self.release):
                time.sleep(0.1)

    def loss_scale(self, step: int) -> float:
        return math.nan if step == self.nan_step else 1.0

    def grad_scale(self, step: int) -> float:
        return SPIKE_SCALE if step in self.spike_steps else 1.0

    def drops(self, step: int) -> bool:
        """Whether the batch of `step` is discarded before the step (drop@STEP)."""
        if step in self.drop_steps:
            logger.warning(f"titanlite: fault injection: step {step}'s batch is left out", extra=EVERY_RANK)
            return True
        return False


class SpikeGuard:
    """Decides on the device whether a step's update is skipped: its loss, gradient norm or auxiliary terms are
    not finite, or (factor > 1) its gradient norm is over factor x the median of the last `window` kept steps'
    norms. Every input is a global value, identical on every rank, so every rank decides the same. The window is
    a device tensor (NaN where empty); the host reads it only to checkpoint it (state / load)."""

    def __init__(self, factor: float, window: int, device: torch.device):
        self.factor = factor
        self.norms = torch.full((window if factor > 0 else 0,), math.nan, device=device)

    def decide(self, row: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(skip: a bool device scalar, the window's median before this step: NaN until the window is full)."""
        bad = ~torch.isfinite(row).all()
        if self.factor <= 0:
            return bad, torch.full((), math.nan, device=row.device)
        norm = grad_norm.detach().float().to(self.norms.device)
        full = ~torch.isnan(self.norms).any()
        median = torch.where(full, self.norms.nanmedian(), torch.full_like(norm, math.nan))
        bad = bad | (full & (norm > self.factor * median))
        self.norms = torch.where(bad, self.norms, torch.cat([self.norms[1:], norm.reshape(1)]))
        return bad, median

    def state(self) -> list[float]:
        """The kept norms, oldest first (a host read: only for a checkpoint)."""
        return [v for v in self.norms.tolist() if not math.isnan(v)]

    def load(self, norms: list[float]) -> None:
        """Restore the kept norms a checkpoint saved (the newest, as many as the window holds)."""
        kept = norms[-len(self.norms) :] if len(self.norms) else []
        values = [math.nan] * (len(self.norms) - len(kept)) + list(kept)
        self.norms = torch.tensor(values, dtype=torch.float32, device=self.norms.device)
