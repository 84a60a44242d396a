"""OLMoE's weights: the MoE decoder's default names (model.layers.N.mlp.gate, mlp.experts.E.{gate,up,down}_proj)."""

from titanlite.models.common.moe.weights import from_hf_tensor, hf_keys, hf_sources, to_hf

__all__ = ["from_hf_tensor", "hf_keys", "hf_sources", "to_hf"]
