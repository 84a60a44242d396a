"""Expert tensor parallelism (parallelism.expert_tensor_parallel_degree = tensor_parallel_degree): each mixture-of-
experts block's experts split over the tensor-parallel ranks as a dense MLP's are, TorchTitan's layout for
DeepSeek-V3 671B (FSDP x TP 8, EP 1). apply_tp puts moe_etp_plan on every MoE block in place of the family's.

The block gathers its tokens from the sequence shards, so every tensor-parallel rank routes the same tokens alike.
Each rank holds a slice of every expert's intermediate width: w1 and w3 [E, hidden, dim] sharded on dim 1, w2
[E, dim, hidden] on dim 2 (DTensors; the experts compute on their local slices), so each rank's expert outputs
are partial sums; the shared expert goes as a dense MLP (column-wise w1/w3, row-wise w2 with a partial output).
The combine weights the partial rows as it would the whole ones, and the block's partial output is
reduce-scattered back to this rank's slice of the sequence. Backward: what reaches the block's input from the
experts and from the router must be whole on every rank (the gather's backward keeps the rank's slice), so the
gradients that come out partial are summed over TP where they arise: the experts' input rows [N*k, dim] (as
TorchTitan's) and the routing weights [N, k] and the shared gate's output [N, 1] (each of which multiplies a
partial sum). The router's gate then gets the same whole gradient on every rank, as a replicated weight should.

Beside expert parallelism (EP x ETP) titanlite/parallel/expert_parallel.py shards the experts on the 2-D
(ep, tp) mesh and dispatches over its ep dimension; the summing of the experts' input gradient is the same."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titanlite.base.errors import ConfigError
from titanlite.models.common.moe.layer import MoE, Routing
from titanlite.models.common.parallelize import sum_gradient
from titanlite.models.registry import spec_of

# Each stacked expert weight's intermediate (hidden) dimension: what ETP shards.
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


class MoEBlockInputOutput(ParallelStyle):
    """On the MoE block: the sequence gathered in (plain tensors), the block's partial output reduce-scattered back
    to this rank's slice of the sequence."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module: nn.Module, inputs: tuple) -> tuple:
            x = inputs[0]  # the sequence-parallel norm's output: a DTensor, or a local slice of the sequence
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            return (x.redistribute(device_mesh, [Replicate()]).to_local(), *inputs[1:])

        def reduce_scatter(module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
            partial = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(device_mesh, [Shard(1)]).to_local()

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(reduce_scatter)
        return module


class SumOutputGradient(ParallelStyle):
    """On a module whose output multiplies a partial sum (the router's combine weights, the shared gate): its
    output's gradient summed over the tensor-parallel ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def hook(module: nn.Module, inputs: tuple, out):
            if isinstance(out, Routing):
                return out._replace(weights=sum_gradient(out.weights, group))
            return sum_gradient(out, group)

        module.register_forward_hook(hook)
        return module


class ExpertTensorParallel(ParallelStyle):
    """On GroupedExperts: each expert's matrices sharded on their intermediate dimension over a 1-D tensor-parallel
    mesh; the input rows' gradient (partial: each rank's slice of the width) summed over it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(HIDDEN_DIM[key])
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            x, counts = args
            return sum_gradient(x, group), counts

        return distribute_module(module, device_mesh, partition_fn=partition, input_fn=inputs)  # type: ignore[arg-type]


def moe_etp_plan(module: MoE, ep: bool) -> dict:
    """One MoE block's plan (names relative to it): its experts split over TP (beside expert parallelism,
    apply_ep shards and dispatches them instead), its shared expert as a dense MLP's."""
    plan: dict = {"": MoEBlockInputOutput(), "router": SumOutputGradient()}
    if not ep:
        plan["experts"] = ExpertTensorParallel()
    if module.shared_expert is not None:
        plan |= {
            "shared_expert.w1": ColwiseParallel(),
            "shared_expert.w3": ColwiseParallel(),
            "shared_expert.w2": RowwiseParallel(output_layouts=Partial()),
        }
    if module.shared_gate is not None:
        plan["shared_gate"] = SumOutputGradient()
    return plan


def moe_blocks(model: nn.Module) -> dict[str, MoE]:
    """Every mixture-of-experts block by its module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def with_experts_split(plan: dict, model: nn.Module, ep: bool) -> dict:
    """A family's tensor-parallel plan with every MoE block's own entries replaced by moe_etp_plan's."""
    blocks = moe_blocks(model)

    def inside(name: str) -> bool:
        return any(name == path or name.startswith(path + ".") for path in blocks)

    out = {name: style for name, style in plan.items() if not inside(name)}
    for path, block in blocks.items():
        out |= {f"{path}.{name}" if name else path: style for name, style in moe_etp_plan(block, ep).items()}
    return out


def etp_split_sizes(moe) -> dict[str, int]:
    """The widths an expert tensor-parallel degree must divide, by the name its refusal gives them."""
    widths = {"expert_dim": moe.expert_dim}
    if moe.shared_hidden:
        widths["the shared experts' width"] = moe.shared_hidden
    return widths


def check_etp_degree(etp: int, args, family: str) -> None:
    """The experts' (and shared experts') intermediate widths split evenly over `etp` ranks, and the family's
    spec does not refuse the split (etp_refusal: gpt-oss's row-wise expert biases would be added once per rank,
    Gemma 4's MoE output norm would normalise a partial sum); refused in one line otherwise."""
    if etp == 1:
        return
    moe = spec_of(args).moe(args)
    if moe is None:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp} splits mixture-of-experts blocks, but model {family} "
            "has none; set it to 1"
        )
    why = spec_of(args).etp_refusal(args)
    if why:
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp} cannot split the {family} {why}; set it to 1"
        )
    bad = {name: width for name, width in etp_split_sizes(moe).items() if width % etp}
    if bad:
        what = " and ".join(f"{name}={width}" for name, width in bad.items())
        raise ConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp} does not divide the {family} experts' {what}; "
            "use 1 or a tensor_parallel_degree that divides it"
        )
