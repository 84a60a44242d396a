"""OLMoE's weights: Qwen3-MoE's names (model.layers.N.mlp.gate, mlp.experts.E.{gate,up,down}_proj)."""

from titanlite.models.qwen3_moe.weights import from_hf_tensor, hf_keys, hf_sources, to_hf

__all__ = ["from_hf_tensor", "hf_keys", "hf_sources", "to_hf"]
