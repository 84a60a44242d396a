"""A latent-attention family defined entirely under tests/ (tests/families/dense_mla: its arguments and spec; its
module, initialisation and tensor-parallel plan the shared latent decoder's, titanlite/models/common/latent/),
registered from the test: it builds, starts its weights and trains a step on the CPU, and its plan names only modules
it has, with no edit in titanlite/. (relu2, a family with mixers of its own: tests/distributed/test_custom_family.py)"""

import importlib

import pytest
import torch

from titanlite.components.loss import cross_entropy
from titanlite.models import registry
from titanlite.models.build import build_model
from titanlite.models.common.feed_forward import GatedMLP
from titanlite.models.common.init import init_weights
from titanlite.models.common.mixers import LatentAttention
from titanlite.models.registry import spec_of

VOCAB, SEQ = 96, 32


@pytest.fixture
def dense_mla(monkeypatch):
    """dense_mla's debug model, registered in a copy of the registry (later tests see the built-in families only),
    its weights started as a run starts them."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setitem(registry._SPECS, "dense_mla", importlib.import_module("tests.families.dense_mla").SPEC)
    model = build_model("dense_mla", "debug", VOCAB, SEQ)
    init_weights(model, seed=0)
    return model


def test_a_latent_family_needs_only_its_folder_to_build_and_train_a_step(dense_mla):
    model = dense_mla
    assert all(isinstance(block.attention, LatentAttention) for block in model.layers.values())
    assert all(isinstance(block.feed_forward, GatedMLP) for block in model.layers.values())
    assert model.output.weight is model.tok_embeddings.weight and list(model.rotary) == ["rope"]
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):  # a step, then the loss it leads to
        loss = cross_entropy(model(inputs), labels)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[1] < losses[0], losses


def test_a_latent_familys_plan_names_only_modules_it_has(dense_mla):
    spec = spec_of(dense_mla.args)
    plan = spec.load(spec.tp_plan)(dense_mla)
    assert "layers.0.attention.wq_b" in plan and "layers.0.feed_forward.w1" in plan
    for name in plan:
        dense_mla.get_submodule(name)  # raises for a module the model does not have
