"""Tensor and sequence parallelism (Megatron pattern) with PyTorch's `parallelize_module` plans.

Within a block, Q/K/V and the first MLP projections are split column-wise and the attention output and
last MLP projection row-wise: two reductions per layer. Between blocks the activations are sharded
along the sequence (sequence parallelism), so norms run on a slice of the tokens and the row-wise
reductions become reduce-scatters. The vocabulary is split across ranks at both ends of the model.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import distribute_module

from titanlite.base.errors import ConfigError
from titanlite.models.common.interface import DecoderModule
from titanlite.models.registry import spec_of
from titanlite.parallel.expert_tensor_parallel import with_experts_split


def apply_tp(
    model: DecoderModule,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    chunked_loss: bool,
    experts_split: bool = False,
    ep: bool = False,
) -> None:
    """Shard `model` (still on the meta device) over `tp_mesh` with its family's plan for the blocks (its spec's
    tp_plan) and the shared plan for the ends. `chunked_loss`: the loss takes the hidden states and the head.
    `experts_split` (expert tensor parallelism): every MoE block's plan is moe_etp_plan's, its experts split over
    `tp_mesh` too (with `ep`, expert parallelism shards them on the (ep, tp) mesh instead: apply_ep)."""
    spec = spec_of(model.args)
    plan = ends_plan(model, loss_parallel, chunked_loss) | spec.load(spec.tp_plan)(model)
    if experts_split:
        plan = with_experts_split(plan, model, ep)
    apply_plan(model, tp_mesh, plan)
    # A tied embedding: the vocabulary-parallel embedding and the column-wise output projection both
    # shard the [vocab, dim] matrix by rows (Shard(0)), so one sharded tensor serves both. Each style
    # distributed its own copy above; point the output back at the embedding's so they stay one.
    model.tie_weights()


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """parallelize_module(model, mesh, plan), keeping the module each style returns: a style may build a module to
    take the place of the one it is given (WholeProjectionNorm: a ShardedRMSNorm for an nn.RMSNorm), which is set on
    the parent under the same name (parallelize_module drops what a style returns for a nested path). Keys are matched
    as parallelize_module matches them: each dotted part an fnmatch pattern of a child's name."""
    for path, style in plan.items():
        targets = plan_targets(model, path)
        if not targets:
            warnings.warn(f"tensor-parallel plan key {path!r} names no submodule; skipped", stacklevel=2)
        for parent, name in targets:
            child = parent.get_submodule(name)
            new = parallelize_module(child, mesh, style)
            if new is not child:
                parent.register_module(name, new)


def plan_targets(model: nn.Module, path: str) -> list[tuple[nn.Module, str]]:
    """(parent, name) of each submodule of `model` that the plan key `path` matches."""
    *parents, leaf = path.split(".")
    found = [model]
    for token in parents:
        found = [child for module in found for name, child in module.named_children() if fnmatch(name, token)]
    return [(module, name) for module in found for name, _ in module.named_children() if fnmatch(name, leaf)]


def ends_plan(model: DecoderModule, loss_parallel: bool, chunked_loss: bool) -> dict:
    """The embedding (vocabulary-parallel, output sharded by sequence), final norm and output projection.

    Under loss parallelism the logits stay sharded by vocabulary ([B, T, vocab/tp] per rank) and the
    cross-entropy is computed on the shards, so the full-vocabulary logits never exist on one rank.
    """
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if chunked_loss:  # the model returns hidden states; the chunked loss splits the vocabulary itself
        plan["output"] = VocabParallelHead()
    for key, ahead in (getattr(model, "mtp", None) or {}).items():
        # Multi-token prediction's norms run on the sequence shards, as the final norm does; its projections of the
        # hidden states and embeddings, small, whole on each rank (ReplicatedProjection); its block has the family's
        # plan, as has anything else around it (DeepSeek-V4's hyper-head).
        plan |= {f"mtp.{key}.{norm}": SequenceParallel() for norm in ("enorm", "hnorm", "norm")}
        for name, child in ahead.named_children():
            if isinstance(child, nn.Linear):
                plan[f"mtp.{key}.{name}"] = ReplicatedProjection()
    if getattr(model, "pos_embeddings", None) is not None:
        # Positions are looked up for the whole sequence ([T] -> [T, dim]) and come out sharded on the
        # sequence (Shard(0) of [T, dim]), matching the token embedding's [B, T/tp, dim] slice.
        plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    return plan


class VocabParallelHead(ParallelStyle):
    """Tensor parallelism for the head of a model trained with the chunked loss: the weight split by vocabulary
    rows (Shard(0), as ColwiseParallel splits a linear's output features); the hidden states pass through
    untouched (the model returns them, logits=False) and the loss computes each rank's share of the vocabulary."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_weight(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None))
                )

        return distribute_module(module, device_mesh, shard_weight)


class ReplicatedProjection(ParallelStyle):
    """A linear layer whole on every tensor-parallel rank, applied to its slice of the sequence (a Shard(1) DTensor in,
    a plain local tensor out, as a block takes it): multi-token prediction's eh_proj [2 dim -> dim] (DeepSeek-V4's
    e_proj and h_proj). Its weight is a
    replicated DTensor, so its gradient, each rank's tokens' share, is summed over the ranks in backward. Column-wise
    it would need the sequence gathered and its output's features scattered again (two collectives a step for a
    matrix of 2 dim^2 that costs 1/n_layers-th of a block)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, output_fn=lambda mod, out, mesh: out.to_local())


def tp_split_sizes(args) -> dict[str, int]:
    """The model sizes a tensor-parallel degree must divide (with training.seq_len, for sequence parallelism)."""
    return spec_of(args).tp_split_sizes(args)


def tp_refusal(args) -> str | None:
    """Why the family cannot be split by tensor parallelism at all (its spec's tp_refusal); None: it can."""
    return spec_of(args).tp_refusal(args)


def check_tp_degree(tp: int, args, seq_len: int) -> None:
    """Refuse a degree the model cannot be split by, listing the degrees that would work.

    Column/row splits need tp to divide the head counts and the FFN width; the vocabulary-parallel
    ends need it to divide the (padded) vocabulary; sequence parallelism needs it to divide seq_len.
    """
    if tp == 1:
        return
    why = tp_refusal(args)
    if why:
        raise ConfigError(f"parallelism.tensor_parallel_degree={tp} cannot split the {why}; use 1")
    sizes = {**tp_split_sizes(args), "training.seq_len": seq_len}
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        valid = [d for d in range(1, min(sizes.values()) + 1) if all(size % d == 0 for size in sizes.values())]
        what = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ConfigError(
            f"parallelism.tensor_parallel_degree={tp} does not divide {what}; use one of {', '.join(map(str, valid))}"
        )
