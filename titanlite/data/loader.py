"""Per-rank micro-batches cut from one global sample stream, so batches do not depend on the layout.
Its whole resumable state is one number, the global sample index, so checkpoints move between layouts."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from titanlite.data.datasets import PackedWindows
from titanlite.errors import ConfigError


class GlobalBatchSampler(Sampler[int]):
    """This rank's window indices, forever, in the order its micro-batches consume them.

    Global sample k is window perm_e[k % W] of epoch e = k // W (or window k % W unshuffled). Step s
    takes samples [s*G, (s+1)*G) counted from `start_sample`; rank r of D reads the r-th contiguous
    D-th of them, which its loader cuts in order into micro-batches.
    """

    def __init__(
        self,
        num_windows: int,
        *,
        local_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool = True,
        start_sample: int = 0,
    ) -> None:
        _check_layout(local_batch_size, grad_accum_steps, dp_rank, dp_degree)
        if num_windows < 1:
            raise ValueError(f"num_windows={num_windows} must be at least 1")
        if start_sample < 0:
            raise ValueError(f"start_sample={start_sample} must not be negative")
        self.num_windows = num_windows
        self.rank_samples = local_batch_size * grad_accum_steps
        self.global_batch_size = self.rank_samples * dp_degree
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        self.start_sample = start_sample
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def __iter__(self) -> Iterator[int]:
        step_start = self.start_sample
        while True:
            first = step_start + self.dp_rank * self.rank_samples
            for sample in range(first, first + self.rank_samples):
                yield self.window(sample)
            step_start += self.global_batch_size

    def window(self, sample: int) -> int:
        """The window index that global sample `sample` reads."""
        epoch, pos = divmod(sample, self.num_windows)
        if not self.shuffle:
            return pos
        return int(self._permutation(epoch)[pos])

    def _permutation(self, epoch: int) -> torch.Tensor:
        # Samples arrive in increasing order, so caching one epoch's permutation suffices.
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=generator)
            self._epoch = epoch
        return self._perm


class TokenLoader:
    """Iterator of (inputs, labels) micro-batches, each [local_batch_size, seq_len] int64.

    grad_accum_steps consecutive micro-batches make this rank's share of one optimizer step.
    """

    def __init__(
        self,
        dataset: PackedWindows,
        *,
        local_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        shuffle: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        _check_layout(local_batch_size, grad_accum_steps, dp_rank, dp_degree)
        if num_workers < 0:
            raise ConfigError(f"num_workers={num_workers} must not be negative")
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.global_batch_size = local_batch_size * grad_accum_steps * dp_degree
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._start_sample = 0
        self._yielded = 0
        self._batches: Iterator[torch.Tensor] | None = None

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = iter(self._build_loader())
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
        self._batches = None

    def _build_loader(self) -> DataLoader:
        sampler = GlobalBatchSampler(
            len(self.dataset),
            local_batch_size=self.local_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            dp_rank=self.dp_rank,
            dp_degree=self.dp_degree,
            seed=self.seed,
            shuffle=self.shuffle,
            start_sample=self._start_sample,
        )
        # Prefetching by workers cannot skew the state: it counts only batches handed to the caller.
        return DataLoader(
            self.dataset,
            batch_size=self.local_batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )


def _check_layout(local_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_degree: int) -> None:
    if local_batch_size < 1:
        raise ConfigError(f"local_batch_size={local_batch_size} must be at least 1")
    if grad_accum_steps < 1:
        raise ConfigError(f"grad_accum_steps={grad_accum_steps} must be at least 1")
    if not 0 <= dp_rank < dp_degree:
        raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_degree={dp_degree})")
