"""Tensor parallelism puts a ShardedRMSNorm in the place of each whole-projection Q/K norm (qk_norm "full": OLMo 2's)
as a module of its own, set on its parent, no class swapped at run time; checked in one process on a fake 2-rank
group (shapes, placements and names; the losses on TP x 2: tests/distributed/test_olmo3.py)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from tests.unit.test_tensor_parallel_plan import SEQ, VOCAB
from titanlite.models.build import build_model
from titanlite.models.common.parallelize import ShardedRMSNorm, WholeProjectionNorm
from titanlite.parallel.parallelize import materialize
from titanlite.parallel.tensor_parallel import apply_plan, apply_tp


def test_whole_projection_norms_become_sharded_rms_norms_under_the_same_names(tp_mesh):
    with torch.device("meta"):
        model = build_model("olmo2", "debug", VOCAB, SEQ)
    names = [name for name, _ in model.named_parameters()]
    norms = {name: module for name, module in model.named_modules() if name.endswith(("q_norm", "k_norm"))}
    assert norms and all(type(norm) is nn.RMSNorm for norm in norms.values())
    apply_tp(model, tp_mesh, loss_parallel=True, chunked_loss=False)
    assert [name for name, _ in model.named_parameters()] == names  # same names, same order: optimizers, checkpoints
    for name, norm in norms.items():
        sharded = model.get_submodule(name)
        assert type(sharded) is ShardedRMSNorm and sharded is not norm and sharded.mesh is tp_mesh
        assert (sharded.normalized_shape, sharded.eps, sharded.training) == (norm.normalized_shape, norm.eps, True)
        assert isinstance(sharded.weight, DTensor) and sharded.weight.placements == (Shard(0),)
        assert sharded.weight.to_local().shape == (norm.normalized_shape[0] // 2,)
    materialize(model, torch.device("cpu"), seed=0)
    assert model(torch.randint(0, VOCAB, (2, SEQ))).to_local().shape == (2, SEQ, VOCAB // 2)


def test_apply_plan_sets_a_returned_module_on_its_parent_and_keeps_the_order(tp_mesh):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.RMSNorm(8, eps=1e-5), nn.RMSNorm(8)))
    model[1][1].eval()
    apply_plan(model, tp_mesh, {"1.*": WholeProjectionNorm()})
    assert [type(m) for m in model[1]] == [ShardedRMSNorm, ShardedRMSNorm]
    assert (model[1][0].eps, model[1][0].training, model[1][1].training) == (1e-5, True, False)
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.0.weight", "1.1.weight"]
    with pytest.warns(UserWarning, match="'2.norm' names no submodule"):
        apply_plan(model, tp_mesh, {"2.norm": WholeProjectionNorm()})


def test_a_norm_without_weight_stays_without_one(tp_mesh):
    model = nn.Sequential(nn.RMSNorm(8, elementwise_affine=False))
    apply_plan(model, tp_mesh, {"0": WholeProjectionNorm()})
    assert type(model[0]) is ShardedRMSNorm and model[0].weight is None and not list(model.parameters())
