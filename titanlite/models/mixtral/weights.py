"""Mixtral's weights: model.layers.N.block_sparse_moe.gate and block_sparse_moe.experts.E.{w1,w3,w2} (gate, up,
down), stacked into our experts.w1, w3 and w2 (titanlite/models/moe_decoder/weights.py)."""

from titanlite.models.common.moe.weights import from_hf_tensor, hf_keys, naming

_MIXTRAL = naming("block_sparse_moe", "w1")
hf_sources, to_hf = _MIXTRAL.hf_sources, _MIXTRAL.to_hf

__all__ = ["from_hf_tensor", "hf_keys", "hf_sources", "to_hf"]
