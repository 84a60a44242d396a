"""The shared decoder's tensor-parallel plans for its blocks (titanlite/parallel/tensor_parallel.py adds the
embedding, final norm and output ends and applies it): the dense blocks', and the mixture-of-experts blocks'; the
Q/K norms, per head (replicated) or over the whole projection (WholeProjectionNorm: a ShardedRMSNorm in the norm's
place, sharded with the heads, its sums of squares all-reduced).

Tensor parallelism does not split the experts (expert parallelism does, over the data-parallel ranks): the block
takes the full sequence (gathered from the sequence-parallel shards), routes it and runs its experts on every
tensor-parallel rank alike, then keeps its rank's slice of the sequence. Each rank's router, shared expert and
experts so see the same tokens and get the same gradients, so nothing needs summing over tensor parallelism; the
price is the block's compute repeated tp times. With parallelism.expert_tensor_parallel_degree = tp the parallel
layer replaces these MoE entries with its own plan, the experts split over TP as a dense MLP's
(titanlite/parallel/expert_tensor_parallel.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.mamba2 import CONVOLVED, CONVOLVED_BIASES


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_gradient(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`x` unchanged; its gradient summed over `group` (a tensor-parallel input that each rank uses on its shard)."""
    return _SumGradient.apply(x, group)


def block_plan(rotary: bool = True, gated: bool = True) -> dict:
    """One block: biases shard with their column-wise weights (and stay whole after the row-wise ones);
    post-norm blocks normalise the sequence-sharded outputs of the sublayers with the same norms. `rotary`: the
    attention takes the RoPE tables after x (GPT-2's takes x alone); `gated`: the MLP has a gate, w3 (SwiGLU)."""
    tables = (None, None) if rotary else ()  # the RoPE tables are plain replicated tensors
    gate = {"feed_forward.w3": ColwiseParallel()} if gated else {}
    return {
        "attention_norm": SequenceParallel(),
        # attention(x, cos, sin): gather x's sequence
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), *tables), desired_input_layouts=(Replicate(), *tables)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        **gate,
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


class MixerInput(PrepareModuleInput):
    """A mixer that reads no rotary tables (mixer(x)): its input's sequence gathered, as a plain tensor; `by_head`,
    the mixer's parameters whose rows are its heads' (a linear layer's convolution weights, A_log, dt_bias; a module's
    of it by a dotted name, Mamba-2's "norm.weight"), sharded by rows over the tensor-parallel ranks, as its
    column-wise projections are; one the layer goes without (None: a bias it has not) is passed over."""

    def __init__(self, by_head: tuple[str, ...] = ()) -> None:
        super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
        self.by_head = by_head

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.by_head:  # a parameter of the mixer's own, or of a module of it ("norm.weight")
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            param = getattr(owner, leaf)
            if param is not None:  # an optional one the layer goes without (a bias)
                owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))
        return super()._apply(module, device_mesh)


LINEAR_BY_HEAD = ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias")
"""A linear-attention mixer's own parameters whose rows are its heads' (Gated DeltaNet's and Kimi Delta Attention's)."""


def linear_attention_plan() -> dict:
    """A Gated DeltaNet layer's mixer (titanlite/models/common/gated_delta_net.py; the Qwen hybrids', OLMo Hybrid's):
    every projection split column-wise by heads (each rank holds whole key heads and the value heads that read them),
    the convolutions' weights, A_log and dt_bias sharded with them, the per-head output norm replicated (its gradient
    summed over TP), and the output projection row-wise."""
    return {
        "attention": MixerInput(LINEAR_BY_HEAD),
        **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv", "wz", "wa", "wb")},
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


MAMBA_BY_HEAD = (*CONVOLVED, *CONVOLVED_BIASES, "A_log", "D", "dt_bias", "norm.weight")
"""A Mamba-2 mixer's own parameters whose rows are its heads' or groups' (titanlite/models/common/mamba2.py)."""


def mamba2_plan() -> dict:
    """A Mamba-2 layer's mixer (titanlite/models/common/mamba2.py; Nemotron-H's, Granite 4.0 H's), under `attention`:
    the input projections column-wise, by heads (z, x, dt) and by groups (B, C), so each rank holds whole groups and
    the heads that read them; the convolution's weights and biases, A_log, D, dt_bias and the gated norm's weight
    sharded with them by rows (the norm's slices whole on a rank: the degree divides mamba_norm_groups); the output
    projection row-wise."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": MixerInput(MAMBA_BY_HEAD),
        **{f"attention.{w}": ColwiseParallel() for w in ("wz", "wx", "wb", "wc", "wdt")},
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def per_head_norms() -> dict:
    """Per-head Q/K norms see this rank's heads: their weight is replicated and its gradient, a partial sum per
    rank, is summed over TP (SequenceParallel over the heads' dimension)."""
    return {
        f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True) for norm in ("q_norm", "k_norm")
    }


class ShardedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm over a width whose features are split over the tensor-parallel ranks (WholeProjectionNorm builds one
    in place of a norm): each rank holds its slice of the input [..., width / tp] and of the weight (a DTensor,
    Shard(0)); the sum of squares is all-reduced over the ranks (a differentiable all-reduce: its backward sums the
    gradients the ranks' outputs send back), so each rank normalises its slice by the whole width's RMS."""

    def __init__(
        self, normalized_shape: tuple[int, ...], eps: float | None, weight: nn.Parameter | None, mesh: DeviceMesh
    ) -> None:
        # The placeholder weight nn.RMSNorm makes is on the meta device (no memory); `weight` takes its place.
        super().__init__(normalized_shape, eps, elementwise_affine=weight is not None, device="meta")
        self.register_parameter("weight", weight)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = self.normalized_shape[-1]  # the whole width (the module's own, not the slice's)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        squares = funcol.all_reduce(x.float().square().sum(-1, keepdim=True), "sum", self.mesh)
        out = x.float() * torch.rsqrt(squares / width + eps)
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return out.type_as(x) * weight if weight is not None else out.type_as(x)


class WholeProjectionNorm(ParallelStyle):
    """Tensor parallelism for a norm over a whole column-wise projection's output (qk_norm "full": OLMo 2's Q/K
    norms): its weight sharded as the projection's output features are (Shard(0)), and a ShardedRMSNorm holding that
    weight returned to take the norm's place (titanlite/parallel/tensor_parallel.py apply_plan sets it on the
    parent): each rank normalises its heads by the RMS of every head's features, one small all-reduce (a number per
    token) per norm. The norm's input is the projection's local output, its output local too."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.RMSNorm:
            raise TypeError(f"WholeProjectionNorm shards an nn.RMSNorm, not a {type(module).__name__}")
        weight = None
        if module.weight is not None:
            weight = nn.Parameter(
                distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            )
        sharded = ShardedRMSNorm(module.normalized_shape, module.eps, weight, device_mesh)
        return sharded.train(module.training)


def whole_projection_norms() -> dict:
    """Whole-projection Q/K norms (qk_norm "full") on the column-wise projections' local outputs."""
    return {f"attention.{norm}": WholeProjectionNorm() for norm in ("q_norm", "k_norm")}


def qk_norms(args) -> dict:
    """The plan of the attention's Q/K norms, as args.qk_norm has them: per head, whole projection, or none."""
    qk_norm = getattr(args, "qk_norm", "none")
    return per_head_norms() if qk_norm == "head" else whole_projection_norms() if qk_norm == "full" else {}


def post_norms() -> dict:
    """Post-norm blocks (norm_position "post": OLMo 2's) normalise the sublayers' sequence-sharded outputs, which the
    residual adds to the block's input, a plain local tensor: their norms hand back plain local tensors too."""
    return {name: SequenceParallel(use_local_output=True) for name in ("attention_norm", "ffn_norm")}


def tp_plan(model: DecoderModule) -> dict:
    post = post_norms() if getattr(model.args, "norm_position", "pre") == "post" else {}
    block = qk_norms(model.args) | block_plan() | post
    return {f"layers.{i}.{name}": style for i in model.layers for name, style in block.items()}


def moe_block_plan() -> PrepareModuleInputOutput:
    """The MoE block: the sequence gathered in, this rank's slice of the sequence out (plain tensors, as the
    attention's and dense feed-forward's outputs are in the Llama plan)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,
    )


def moe_tp_plan(model: DecoderModule) -> dict:
    """The MoE decoder's plan: the shared blocks' for attention (its Q/K norms as args.qk_norm has them: qk_norms)
    and the dense layers' feed-forward; a mixture-of-experts block whole on every tensor-parallel rank
    (moe_block_plan)."""
    moe = model.args.moe
    assert moe is not None, "moe_tp_plan is the plan of a model with experts (args.moe)"
    plan = {}
    for i in model.layers:
        dense = not moe.is_sparse(int(i))
        for name, style in (qk_norms(model.args) | block_plan()).items():
            if dense or not name.startswith("feed_forward"):
                plan[f"layers.{i}.{name}"] = style
        if not dense:
            plan[f"layers.{i}.feed_forward"] = moe_block_plan()
    return plan
