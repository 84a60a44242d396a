"""The MoE families' pooled load-balancing term under pipeline parallelism: the stage parts split_model cuts, chained
as a schedule chains them (each hands (h, carry) to the next), add the whole model's one term and give every
router the whole model's gradient. tests/distributed/test_moe_pipeline.py runs it through the schedules."""

import dataclasses

import pytest
import torch

from titanlite.components.loss import cross_entropy
from titanlite.models.build import model_from_args
from titanlite.models.common.auxiliary import AuxiliaryLosses, collecting
from titanlite.models.registry import model_args, spec_named
from titanlite.parallel.pipeline import PipelinePlan, carry_as_keyword, split_model

VOCAB, SEQ = 96, 16


def qwen3_moe(dense_layers: tuple[int, ...] | None = None):
    """The debug Qwen3-MoE (4 layers, layer 1 dense), with fixed random weights."""
    args = model_args("qwen3_moe", "debug", VOCAB, SEQ)
    if dense_layers is not None:
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, dense_layers=dense_layers))
    torch.manual_seed(0)
    model = model_from_args(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.05)
    model.init_buffers()
    return model


def stage_parts(model, layer_ranges):
    """One part per stage, as each pp rank of a one-stage-per-rank schedule holds them."""
    plan = PipelinePlan(pp=len(layer_ranges), schedule="1F1B", layer_ranges=layer_ranges, n_microbatches=1)
    parts = [split_model(model, plan, rank)[0] for rank in range(plan.pp)]
    for part in parts:
        part.register_forward_pre_hook(carry_as_keyword, with_kwargs=True)
    return parts


def chained(parts, inputs):
    out = inputs
    for part in parts:
        out = part(*out) if isinstance(out, tuple) else part(out)
    return out


def train_step(parts, inputs, labels):
    """The logged load-balancing term and the gradients by parameter name of one training forward and backward."""
    terms = AuxiliaryLosses(spec_named("qwen3_moe").auxiliary_losses(parts[0].args))
    for part in parts:
        terms.watch(part)
    with collecting(terms):
        cross_entropy(chained(parts, inputs), labels).backward()
    logged = dict(zip(terms.names, terms.take(torch.device("cpu"), passes=1).tolist()))
    grads = {name: p.grad for part in parts for name, p in part.named_parameters() if p.grad is not None}
    return logged["load_balance"], grads


@pytest.mark.parametrize(
    "layer_ranges, dense_layers",
    [
        (((0, 2), (2, 4)), None),
        (((0, 1), (1, 2), (2, 3), (3, 4)), None),  # stage 1 holds only the dense layer: it passes the carry on
        (((0, 1), (1, 4)), (0, 1)),  # stage 0 routes nothing: its zeros still take the gradient sent back
    ],
    ids=["2-stages", "4-stages", "first-stage-dense"],
)
def test_stage_parts_add_the_whole_models_one_term_and_router_gradients(layer_ranges, dense_layers):
    model = qwen3_moe(dense_layers)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    parts = stage_parts(model, layer_ranges)
    whole_term, whole_grads = train_step([model], inputs, labels)
    term, grads = train_step(parts, inputs, labels)
    assert term == pytest.approx(whole_term, rel=1e-6)
    assert grads.keys() == whole_grads.keys()
    assert any("router" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_outside_training_every_part_hands_on_the_same_tensors():
    """Evaluation runs the training step's schedule, whose stages expect the tensors of its first step."""
    model = qwen3_moe()
    parts = stage_parts(model, ((0, 2), (2, 4)))
    inputs = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h, carry = parts[0](inputs)
        assert carry.shape == (3, model.args.moe.n_experts) and not carry.any()
        torch.testing.assert_close(parts[1](h, carry), model(inputs))
