"""Per-rank micro-batches cut from one global sample stream, so batches do not depend on the layout.
Its whole resumable state is one number, the global sample index, so checkpoints move between layouts;
the next micro-batches are built (and pinned, for CUDA) in a background thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from titanlite.base.errors import ConfigError
from titanlite.data.order import EpochOrder, MixtureOrder


class GlobalBatchSampler(Sampler[int]):
    """This rank's window indices, forever, in the order its micro-batches consume them.

    Global sample k reads window order.windows(k). Step s takes samples [s*G, (s+1)*G) counted from
    `start_sample`; rank r of D reads the r-th contiguous D-th of them, which its loader cuts in order
    into micro-batches.
    """

    def __init__(
        self,
        order: EpochOrder | MixtureOrder,
        *,
        local_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_degree: int,
        start_sample: int = 0,
    ) -> None:
        _check_layout(local_batch_size, grad_accum_steps, dp_rank, dp_degree)
        if start_sample < 0:
            raise ValueError(f"start_sample={start_sample} must not be negative")
        self.order = order
        self.rank_samples = local_batch_size * grad_accum_steps
        self.global_batch_size = self.rank_samples * dp_degree
        self.dp_rank = dp_rank
        self.start_sample = start_sample

    def __iter__(self) -> Iterator[int]:
        step_start = self.start_sample
        while True:
            first = step_start + self.dp_rank * self.rank_samples
            yield from self.order.windows(np.arange(first, first + self.rank_samples)).tolist()
            step_start += self.global_batch_size


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BackgroundBatches:
    """Builds batches `depth` ahead in a daemon thread, pinned for asynchronous copies to the GPU when
    `pin_device` is a CUDA device, so the training step does not wait on the host."""

    def __init__(self, source: Iterator[torch.Tensor], depth: int, pin_device: torch.device | None = None) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(source, pin_device), daemon=True, name="titanlite-batches"
        )
        self._thread.start()

    def _fill(self, source: Iterator[torch.Tensor], pin_device: torch.device | None) -> None:
        if pin_device is not None:
            torch.cuda.set_device(pin_device)  # pin in this rank's CUDA context, not device 0's
        try:
            for batch in source:
                self._put(batch.pin_memory() if pin_device is not None else batch)
                if self._stop.is_set():
                    return
            self._put(_Raised(StopIteration()))
        except BaseException as e:  # handed to the consumer, who raises it
            self._put(_Raised(e))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> BackgroundBatches:
        return self

    def __next__(self) -> torch.Tensor:
        item = self._queue.get()
        if isinstance(item, _Raised):
            raise item.error
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class TokenLoader:
    """Iterator of (inputs, labels) micro-batches, each [local_batch_size, seq_len] int64.

    grad_accum_steps consecutive micro-batches make this rank's share of one optimizer step.
    """

    def __init__(
        self,
        dataset: Dataset,
        order: EpochOrder | MixtureOrder,
        *,
        local_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_degree: int,
        num_workers: int = 0,
        prefetch: int = 2,
        pin_device: torch.device | None = None,
    ) -> None:
        _check_layout(local_batch_size, grad_accum_steps, dp_rank, dp_degree)
        if num_workers < 0 or prefetch < 0:
            raise ConfigError(f"num_workers={num_workers} and prefetch={prefetch} must not be negative")
        self.dataset, self.order = dataset, order
        self.local_batch_size = local_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.global_batch_size = local_batch_size * grad_accum_steps * dp_degree
        self.num_workers, self.prefetch = num_workers, prefetch
        self.pin_device = pin_device if pin_device is not None and pin_device.type == "cuda" else None
        self._start_sample = 0
        self._yielded = 0
        self._batches: Iterator[torch.Tensor] | None = None

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = self._start_batches()
        windows = next(self._batches)
        self._yielded += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        """{"sample_index": global sample index of the next step}; only valid between steps."""
        if self._yielded % self.grad_accum_steps:
            raise RuntimeError(
                f"data loader state requested mid-step ({self._yielded % self.grad_accum_steps} of "
                f"{self.grad_accum_steps} micro-batches consumed); save state only between optimizer steps"
            )
        steps = self._yielded // self.grad_accum_steps
        return {"sample_index": self._start_sample + steps * self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from state["sample_index"], whatever layout saved it; drops any prefetched batches."""
        sample_index = int(state["sample_index"])
        if sample_index < 0:
            raise ValueError(f"sample_index={sample_index} in the data loader state must not be negative")
        self._start_sample = sample_index
        self._yielded = 0
        self.close()

    def close(self) -> None:
        """Stop building batches ahead (the next batch asked for starts again from the current state)."""
        if isinstance(self._batches, BackgroundBatches):
            self._batches.close()
        self._batches = None

    def _start_batches(self) -> Iterator[torch.Tensor]:
        sampler = GlobalBatchSampler(
            self.order,
            local_batch_size=self.local_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            dp_rank=self.dp_rank,
            dp_degree=self.dp_degree,
            start_sample=self._start_sample,
        )
        # Batches built ahead cannot skew the state: it counts only batches handed to the caller.
        pin_here = self.pin_device is not None and not self.prefetch  # else the background thread pins
        batches = iter(
            DataLoader(
                self.dataset,
                batch_size=self.local_batch_size,
                sampler=sampler,
                num_workers=self.num_workers,
                pin_memory=pin_here,
            )
        )
        return BackgroundBatches(batches, self.prefetch, self.pin_device) if self.prefetch else batches


def _check_layout(local_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_degree: int) -> None:
    if local_batch_size < 1:
        raise ConfigError(f"local_batch_size={local_batch_size} must be at least 1")
    if grad_accum_steps < 1:
        raise ConfigError(f"grad_accum_steps={grad_accum_steps} must be at least 1")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_degree={dp_degree})")
