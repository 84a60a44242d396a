"""TP plans checked in one process on a fake 2-rank group (FSDP x TP on a fake 4-rank one): shapes, placements and
warnings, not numbers."""

import dataclasses
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.base.errors import ConfigError
from titanlite.components.optim import clip_grad_norm_
from titanlite.models.build import build_model
from titanlite.models.registry import spec_named
from titanlite.parallel.data_parallel import apply_fsdp
from titanlite.parallel.dims import ParallelDims
from titanlite.parallel.parallelize import materialize
from titanlite.parallel.tensor_parallel import apply_tp, check_tp_degree

VOCAB, SEQ = 256, 16


def tp_model(name, mesh, loss_parallel):
    with torch.device("meta"):
        model = build_model(name, "debug", VOCAB, SEQ)
    apply_tp(model, mesh, loss_parallel=loss_parallel, chunked_loss=False)
    materialize(model, torch.device("cpu"), seed=0)
    return model


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_loss_parallel_never_materialises_full_logits(tp_mesh, name):
    model = tp_model(name, tp_mesh, loss_parallel=True)
    logits = model(torch.randint(0, VOCAB, (2, SEQ)))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.to_local().shape == (2, SEQ, VOCAB // 2)  # each rank holds vocab / tp columns


def test_without_loss_parallel_logits_are_gathered(tp_mesh):
    logits = tp_model("gpt2", tp_mesh, loss_parallel=False)(torch.randint(0, VOCAB, (2, SEQ)))
    assert not isinstance(logits, DTensor) and logits.shape == (2, SEQ, VOCAB)


def test_tied_embedding_is_one_sharded_tensor_after_tp(tp_mesh):
    model = tp_model("gpt2", tp_mesh, loss_parallel=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.placements == (Shard(0),)
    assert model.output.weight.to_local().shape == (VOCAB // 2, model.args.dim)


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_every_parameter_is_a_dtensor_with_the_megatron_placements(tp_mesh, name):
    model = tp_model(name, tp_mesh, loss_parallel=True)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())  # so clipping sees one consistent model
    block = "layers.0."
    assert params[block + "attention.wq.weight"].placements == (Shard(0),)  # column-wise
    assert params[block + "attention.wo.weight"].placements == (Shard(1),)  # row-wise
    assert params[block + "feed_forward.w2.weight"].placements == (Shard(1),)
    assert params[block + "attention_norm.weight"].placements == (Replicate(),)  # sequence-parallel norm


def test_tp_degree_that_does_not_divide_the_heads_names_the_valid_degrees():
    args = dataclasses.replace(spec_named("gpt2").flavors["debug"], vocab_size=50304)  # 4 heads
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree=3 does not divide n_heads=4.*; use one of 1, 2, 4$"):
        check_tp_degree(3, args, seq_len=128)
    llama = dataclasses.replace(spec_named("llama3").flavors["debug"], vocab_size=50304)  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"does not divide n_kv_heads=2.*use one of 1, 2$"):
        check_tp_degree(4, llama, seq_len=128)
    check_tp_degree(2, llama, seq_len=128)


@pytest.mark.parametrize("name", ["gpt2", "llama3"])  # a tied embedding (in the root unit) and an untied one
@pytest.mark.parametrize("loss", ["chunked", "loss_parallel", "gathered_logits"])
def test_fsdp_x_tp_warns_of_no_view_output_and_no_per_dimension_norm_reduction(caplog, name, loss):
    """FSDP 2 x TP 2 on a fake 4-rank group, a step's forward, backward and gradient norm: FSDP2 warns of no unit
    returning a view (the vocabulary-parallel embedding's to_local() output, and the gathered logits', are copied:
    data_parallel.own_output), and DTensor reduces the norm over (dp_shard_cp, tp) in one all-reduce, on the mesh's
    flattened dp_shard_cp_tp view, without its 'suboptimal' warning of one all-reduce a dimension."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = ParallelDims.of(dp_shard=2, tp=2).build_mesh("cpu")
        with torch.device("meta"):
            model = build_model(name, "debug", VOCAB, SEQ)
        apply_tp(model, mesh["tp"], loss_parallel=loss == "loss_parallel", chunked_loss=loss == "chunked")
        fp32 = torch.float32
        apply_fsdp(
            model,
            mesh["dp_shard_cp"],
            param_dtype=fp32,
            reduce_dtype=fp32,
            reshard_after_forward=True,
            loss_reads_head=loss == "chunked",
        )
        materialize(model, torch.device("cpu"), seed=0)
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="torch.distributed.tensor"):
            warnings.filterwarnings("error", message=r"FSDP2-wrapped module .* returned a view tensor")
            model(torch.randint(0, VOCAB, (2, SEQ)), logits=loss != "chunked").sum().backward()
            clip_grad_norm_(list(model.parameters()), 1.0)
        assert "suboptimal" not in caplog.text, caplog.text
    finally:
        dist.destroy_process_group()
