"""Auxiliary loss terms (titanlite/models/common/auxiliary.py): a term a block adds joins the training loss in
backward, with the micro-batch's scale, only inside a training step, and is kept by name for the log."""

import importlib

import pytest
import torch

from titanlite.components.loss import cross_entropy
from titanlite.models import registry
from titanlite.models.build import build_model
from titanlite.models.common.auxiliary import AuxiliaryLosses, add_auxiliary_loss, collecting


@pytest.fixture
def relu2_aux(monkeypatch):
    """relu2 (tests/families/) at its flavor with an auxiliary term, registered in a copy of the registry."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setitem(registry._SPECS, "relu2", importlib.import_module("tests.families.relu2").SPEC)
    torch.manual_seed(0)
    model = build_model("relu2", "debug_aux", 96, 16)
    for p in model.parameters():  # the build leaves values uninitialised: any fixed values do
        torch.nn.init.normal_(p, std=0.05)
    return model


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_term_joins_the_loss_with_its_micro_batch_scale(relu2_aux):
    model = relu2_aux
    tokens = torch.randint(0, 96, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    terms = AuxiliaryLosses(("act_l2",))
    terms.watch(model)
    terms.grad_scale, terms.value_weight = 0.5, 0.5  # one of two micro-batches
    with collecting(terms):
        model(inputs)  # a forward pass that `take` leaves out, as a pipeline stage's shape inference
        (cross_entropy(model(inputs), labels) * 0.5).backward()
    joined, logged = grads(model), terms.take(torch.device("cpu"), passes=1)

    # The same loss written out: the cross-entropy plus every block's act_l2 * mean(h^2), halved.
    model.zero_grad()
    outs = []
    for layer in model.layers.values():
        layer.register_forward_hook(lambda mod, inp, out: outs.append(out))
    loss = cross_entropy(model(inputs), labels)  # outside a step: no term is added
    explicit = 0.05 * sum(o.float().pow(2).mean() for o in outs)
    ((loss + explicit) * 0.5).backward()
    assert torch.allclose(joined, grads(model), rtol=1e-5, atol=1e-7)
    assert logged.shape == (1,) and torch.allclose(logged[0], explicit.detach() * 0.5)


def test_outside_a_step_terms_are_left_out_and_unknown_names_refused():
    h = torch.ones(3, requires_grad=True)
    assert add_auxiliary_loss(h, "x", h.sum()) is h  # evaluation and generation: nothing collects
    with collecting(AuxiliaryLosses(("load_balance",))), pytest.raises(ValueError, match="not among"):
        add_auxiliary_loss(h, "z_loss", h.sum())
