"""Which layers float8 converts, and the refusals made before a run starts."""

import pytest
import torch
import torch.nn as nn

from titanlite.base.errors import ConfigError
from titanlite.config import Float8, parse_config
from titanlite.models.build import build_model
from titanlite.parallel.float8 import apply_float8, check_float8, float8_filter


def test_filter_skips_named_layers_and_dims_not_multiple_of_16():
    keep = float8_filter(["output"], tp=1)
    assert keep(nn.Linear(64, 128), "layers.0.feed_forward.w1")
    assert not keep(nn.Linear(64, 128), "output")
    assert not keep(nn.Linear(64, 100), "layers.0.attention.wq")
    assert not keep(nn.LayerNorm(64), "layers.0.attention_norm")
    # Under TP 4 a 64 x 96 layer is cut into 16 x 24 shards: 24 is not a multiple of 16.
    assert float8_filter([], tp=2)(nn.Linear(64, 96), "x")
    assert not float8_filter([], tp=4)(nn.Linear(64, 96), "x")


def test_an_moe_router_stays_in_high_precision_but_its_shared_expert_converts():
    keep = float8_filter([], tp=1)
    assert not keep(nn.Linear(64, 128), "layers.0.feed_forward.router.gate")
    assert keep(nn.Linear(64, 128), "layers.0.feed_forward.shared_expert.w1")


def test_conversion_keeps_parameter_names():
    # Checkpoints and the Hugging Face export see the same names with and without float8.
    with torch.device("meta"):
        plain = build_model("llama3", "debug", 256, 32, 0)
        converted = build_model("llama3", "debug", 256, 32, 0)
    apply_float8(converted, Float8(enable=True), fsdp=False, tp=1)
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in plain.named_parameters()]
    kinds = {name: type(m).__name__ for name, m in converted.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("output") == "OutputHead"  # the head stays in high precision
    assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 28


def test_old_gpu_needs_the_emulation_switch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TITANLITE_DEVICE")  # a GPU box, as titanlite.base.devices sees it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8.0.*set float8.emulate = true"):
        check_float8(Float8(enable=True))
    check_float8(Float8(enable=True, emulate=True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_float8(Float8(enable=True))


def test_recipe_is_checked():
    with pytest.raises(ConfigError, match="float8.recipe"):
        parse_config(["--float8.recipe", "blockwise"])
