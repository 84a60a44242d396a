"""Expert parallelism: each mixture-of-experts block's routed experts split over the "ep" ranks, tokens sent to
their experts' ranks and back with all-to-all.

The experts' stacked weights [E, ...] become DTensors sharded on dim 0 over the ep mesh: rank r of ep holds
experts r * E/ep .. (r+1) * E/ep - 1. The block routes its own tokens (every rank has the router) and hands the
experts module its tokens sorted by expert with the per-expert counts [E]; this style's input hook sends each
token to the rank that holds its expert (all_to_all_single, gradients flowing back the same way), the local
experts run on what arrived, and the output hook sends the results home in the order they left. Nothing is
dropped: the split sizes are the routed counts, exchanged first (one small all-to-all and one host read per
block, the price of variable splits).

Gradients: an expert's owner receives the gradient of every ep rank's tokens routed to it, summed by the
all-to-all's backward; FSDP then shards the experts over the remaining data-parallel ranks (dims.efsdp) and must
divide by the whole data-parallel size, not its own mesh's (apply_fsdp's expert_divide_factor)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titanlite.base.errors import ConfigError
from titanlite.models.common.moe.layer import GroupedExperts
from titanlite.models.common.parallelize import sum_gradient
from titanlite.models.registry import spec_of
from titanlite.parallel.expert_tensor_parallel import HIDDEN_DIM


class ExpertParallel(ParallelStyle):
    """Shard a GroupedExperts module's stacked weights on dim 0 over a 1-D mesh and route its tokens there; on a
    2-D (ep, tp) mesh (expert tensor parallelism beside EP), also each expert's intermediate width over tp, the
    tokens dispatched over ep and their gradient summed over tp (titanlite/parallel/expert_tensor_parallel.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.route: tuple[torch.Tensor, list[int], list[int]] | None = None  # the last dispatch, for its combine

    @staticmethod
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            # beside ETP (refused for a family with expert biases, gpt-oss) also their width; by expert alone else
            placements = [Shard(0)] + ([Shard(HIDDEN_DIM[key])] if mesh.ndim == 2 else [])
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, placements)))

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        """(tokens sorted by global expert, counts [E]) -> (the tokens of this rank's experts, sorted by local
        expert, and their counts [E / ep])."""
        x, counts = inputs
        if mesh.ndim == 2:  # each tp rank's rows are the same, its slice of the experts' width its own
            x = sum_gradient(x, mesh.get_group(1))
        group, ep = mesh.get_group(0), mesh.size(0)
        local = counts.shape[0] // ep
        with torch.no_grad():
            received = torch.empty_like(counts)  # [source rank, local expert] counts
            dist.all_to_all_single(received, counts, group=group)
            received = received.view(ep, local)
            send, recv = torch.stack([counts.view(ep, local).sum(1), received.sum(1)]).tolist()  # the host read
            # Arrived rows are ordered by source rank, then local expert: sort them by local expert, then source.
            segment = torch.arange(local, device=counts.device).repeat(ep) * ep
            segment += torch.arange(ep, device=counts.device).repeat_interleave(local)
            order = torch.argsort(torch.repeat_interleave(segment, received.reshape(-1)), stable=True)
        arrived = all_to_all_single_autograd(x, recv, send, group)
        self.route = (order, send, recv)
        return arrived[order], received.sum(0)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """The experts' output rows back to the ranks (and the order) their tokens came from."""
        assert self.route is not None, "combine without a dispatch"
        order, send, recv = self.route
        self.route = None
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(unsorted, send, recv, mesh.get_group(0))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self.partition,
            input_fn=self.dispatch,  # type: ignore[arg-type]  # torch's hint says None; a returned value replaces
            output_fn=self.combine,  # type: ignore[arg-type]
        )


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    """Every MoE block's routed experts, in module order."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE block's routed experts over ep_mesh (refused before launch unless each block's
    n_experts divides by the degree: titanlite/builder/plan.py)."""
    for experts in expert_modules(model):
        parallelize_module(experts, ep_mesh, ExpertParallel())


def check_ep_degree(ep: int, args, family: str) -> None:
    """The experts split evenly over `ep` ranks: refused in one line before launch otherwise."""
    if ep == 1:
        return
    moe = spec_of(args).moe(args)  # the family's MoEArgs, or None
    if moe is None:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} splits mixture-of-experts blocks, but model {family} has none; "
            "set it to 1"
        )
    check_experts_split(ep, moe.n_experts, family)


def check_experts_split(ep: int, n_experts: int, family: str) -> None:
    """`n_experts` routed experts per block split evenly over `ep` ranks (the planner asks too, of each degree it
    weighs: titanlite/builder/layouts.py)."""
    if n_experts % ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree={ep} does not divide the {n_experts} experts of each "
            f"{family} block; use a degree that divides {n_experts}"
        )
