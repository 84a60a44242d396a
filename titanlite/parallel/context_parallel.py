"""Context parallelism (apply_cp): the ranks of the cp mesh dimension split every sequence, and attention
gathers the keys and values of the other ranks' tokens (Llama 3's method: cheap with grouped-query attention,
any mask composes with it, and it runs on gloo as on NCCL; docs/parallelism.md says why not ring attention).
It wraps each block's attention core, whichever it is (titanlite/models/common/attention.py ATTENTION_CORES).

Load balance: a sequence is cut into 2 x cp chunks and rank r holds chunks r and 2cp-1-r, so under a causal
mask every rank attends over the same number of keys. Each token keeps its true position (for RoPE and the
mask) through `Sequence` (titanlite/models/common/attention.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.base.errors import ConfigError
from titanlite.models.common.attention import CoreAttention, Sequence, attend, document_ids

# torch 2.13 renamed the autograd all-gather; either gathers on gloo and NCCL, and compiles.
_all_gather_autograd = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
# torch 2.13 renamed the c10d ones too (the old names warn there); same arguments.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_cp_degree(cp: int, seq_len: int, what: str = "training.seq_len") -> None:
    """A CP degree must cut the sequence into 2 x cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        fits = [d for d in range(1, 17) if seq_len % (2 * d) == 0]
        raise ConfigError(
            f"parallelism.context_parallel_degree={cp} does not cut {what}={seq_len} into {2 * cp} equal chunks "
            f"(two per rank, for balance); use a degree in {fits} or a {what} divisible by {2 * cp}"
        )


def balanced_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank `rank` holds of a sequence of `seq_len` tokens: chunks rank and 2cp-1-rank."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


def gathered_positions(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The positions of the keys after the gather: rank 0's tokens, then rank 1's, ..."""
    return torch.cat([balanced_positions(seq_len, cp, r, device) for r in range(cp)])


class SequenceSplit:
    """What a rank does to each batch before the forward pass: with cp > 1, keep its balanced share of the
    sequence (inputs and labels); with block-causal attention, the tokens' documents. Returns the inputs,
    labels and the `Sequence` the model takes (None: whole sequences, plain causal, the fused kernel)."""

    def __init__(self, cp: int = 1, rank: int = 0, eot_id: int | None = None):
        self.cp, self.rank, self.eot_id = cp, rank, eot_id

    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Sequence | None]:
        documents = document_ids(inputs, self.eot_id) if self.eot_id is not None else None
        if self.cp == 1:
            return inputs, labels, None if documents is None else Sequence(documents=documents)
        positions = balanced_positions(inputs.shape[1], self.cp, self.rank, inputs.device)
        keys = gathered_positions(inputs.shape[1], self.cp, inputs.device)
        sequence = Sequence(
            positions=positions,
            documents=None if documents is None else documents[:, positions],
            key_positions=keys,
            key_documents=None if documents is None else documents[:, keys],
        )
        return inputs[:, positions], labels[:, positions], sequence


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 over `group` with plain blocking c10d calls; backward reduce-scatters the
    gradient (sums every rank's gradient of each part into its owner). The eager path: the same two
    collectives FSDP issues, with no asynchronous tensor wrapper in the autograd graph."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather `x` along `dim` over the cp group (rank 0's part first). Its backward sums every rank's
    gradient of each part into the rank that owns it (a reduce-scatter). Under torch.compile a functional
    collective, which it traces (with activation checkpointing too); in eager mode blocking c10d calls.
    Gathered along the first dimension, the one every torch from 2.11 supports."""
    moved = x.movedim(dim, 0).contiguous()
    if moved.is_meta:  # a pipeline stage inferring its shapes on the meta device: no data to gather
        return moved.new_empty((moved.shape[0] * dist.get_world_size(group), *moved.shape[1:])).movedim(0, dim)
    if torch.compiler.is_compiling():
        return _all_gather_autograd(moved, 0, group).movedim(0, dim)
    return _GatherFirstDim.apply(moved, group).movedim(0, dim)


class ContextParallelCore(CoreAttention):
    """Wraps a block's attention core (`inner`, any registered one): gathers the keys and values of the whole
    sequence from the cp group, then lets the inner core attend over them. The `Sequence` passes through as it
    is: SequenceSplit already gave it the queries' positions and the gathered keys' (key_positions), so the
    inner core builds the mask of this rank's queries against every key. Only CoreAttention's contract is
    inherited; the attention itself is the inner core's."""

    def __init__(self, inner: CoreAttention, group: dist.ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequence: Sequence | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = gather_sequence(torch.stack([k, v]), self.group, 3)  # one collective for both: [2, B, Hkv, S, hd]
        return attend(self.inner, q, kv[0], kv[1], sequence, sinks)  # sinks see no key: nothing to gather


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Wrap every block's attention core (its `core`) in one that gathers keys and values over `cp_mesh`."""
    group = cp_mesh.get_group()
    cores = [
        (module, module.core) for module in model.modules() if isinstance(getattr(module, "core", None), CoreAttention)
    ]
    for block, core in cores:
        assert isinstance(core, CoreAttention)  # for the type checker: found as one above
        block.core = ContextParallelCore(core, group)
