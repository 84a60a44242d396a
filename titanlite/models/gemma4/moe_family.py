"""The family gemma4_moe: Gemma 4 with a mixture of experts beside each layer's MLP (26B-A4B) under its own
model.name, so that it has a "debug" flavor of its own; gemma4's module, plan, weights and config.json, with the
mixture-of-experts sizes (args.MOE_FLAVORS) as its flavors. Registered beside gemma4 (titanlite/models/registry.py)."""

from __future__ import annotations

from titanlite.models.gemma4 import gemma4_spec
from titanlite.models.gemma4.args import MOE_FLAVORS

SPEC = gemma4_spec(
    "gemma4_moe",
    MOE_FLAVORS,
    "Gemma 4 with experts beside each MLP (26B-A4B): 128 experts, top 8, routed on the residual stream",
)
