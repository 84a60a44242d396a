"""DeepSeek-V3's weights under Hugging Face's names (DeepseekV3ForCausalLM's checkpoint files): the latent attention's
projections (self_attn.q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj), the dense MLP (mlp.{gate,up,down}_proj), and each sparse layer's router (mlp.gate.weight), correction bias
(mlp.gate.e_score_correction_bias: our routing bias, a buffer), experts (mlp.experts.E.*, stacked on import) and
shared experts (mlp.shared_experts.*). With rope_interleave false the rotary rows are stored as halves and reordered
here (ours rotate adjacent pairs). The multi-token prediction layers (num_nextn_predict_layers, stored as layers
num_hidden_layers + k) are the model's layers of those numbers and their mtp.* norms and projection (enorm, hnorm,
eh_proj, shared_head.norm); each one's copies of the embedding and head (embed_tokens, shared_head.head) must equal the
model's, which it shares (hf_copies). With mtp_layers 0 a folder's such layers are carried unchanged into an export
(hf_carried)."""

from __future__ import annotations

import torch

from titanlite.models.common.decoder_weights import (
    layers_past,
    mtp_copies,
    mtp_family_keys,
    mtp_names,
    next_token_layer_shapes,
    rope_from_hf,
    rope_to_hf,
)
from titanlite.models.common.latent.weights import ENDS, block_names, latent_names
from titanlite.models.common.moe.weights import bias_routed_from_hf, bias_routed_sources, bias_routed_to_hf
from titanlite.models.deepseek_v3.args import DeepseekV3Args


def hf_names(args: DeepseekV3Args) -> dict[str, str]:
    """Our tensor name -> its HF name, except the sparse layers' blocks (hf_sources)."""
    names = ENDS | mtp_names(args)
    for i in range(args.n_layers + args.mtp_layers):
        names |= block_names(i, latent_names(args), dense=not args.moe.is_sparse(i))
    return names


def hf_sources(args: DeepseekV3Args) -> dict[str, str | tuple[str, ...]]:
    """Our parameter (and routing-bias buffer) name -> the HF tensor it is made from; a stacked expert tensor ->
    its experts' tensors, in expert order (the sparse layers' blocks: moe/weights.py bias_routed_sources)."""
    return hf_names(args) | bias_routed_sources(args.moe, args.n_layers + args.mtp_layers)


def hf_copies(args: DeepseekV3Args) -> dict[str, str]:
    """Each multi-token prediction layer's copies of the embedding and the head (HF name -> the shared tensor's HF
    name): not read into the model, which shares its own, but checked equal to them on import and written on export
    (titanlite/components/hf_weights.py)."""
    return mtp_copies(args)


def hf_carried(args: DeepseekV3Args, keys: list[str]) -> list[str]:
    """The multi-token prediction layers this model does not have (model.layers.N past its decoder's and its own
    prediction layers: all of a folder's with model.mtp_layers = 0): not trained, carried unchanged into an export
    (titanlite/components/hf_weights.py)."""
    return layers_past(args.n_layers + args.mtp_layers, keys)


def hf_carried_shapes(args: DeepseekV3Args, carried: list[str], shapes: dict) -> dict[str, tuple[int, ...]]:
    """What the multi-token prediction layers' tensors must be to belong to this model (decoder_weights)."""
    return next_token_layer_shapes(args, carried, shapes)


def hf_folder(args: DeepseekV3Args, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export that carries the folder's multi-token prediction layers (a run without them) says how many there
    are, as it did."""
    if not args.mtp_layers and source.get("num_nextn_predict_layers"):
        config = {**config, "num_nextn_predict_layers": source["num_nextn_predict_layers"]}
    return config, tensors


hf_keys = mtp_family_keys  # the folder's tensors the model reads (decoder_weights)


def _rope_rows(args: DeepseekV3Args, name: str) -> str | None:
    """Which of a tensor's rows carry rotary channels when their HF layout differs from ours (rope_interleave
    false): "q" (each head's last qk_rope_head_dim rows), "kv" (wkv_a's last qk_rope_head_dim rows), or None."""
    if args.rope_interleave:
        return None
    kind = name.rsplit(".", 2)[-2]
    return {"wq": "q", "wq_b": "q", "wkv_a": "kv"}.get(kind)


def _reorder(args: DeepseekV3Args, w: torch.Tensor, rows: str, reorder) -> torch.Tensor:
    rope = args.qk_rope_head_dim
    if rows == "kv":
        return torch.cat([w[:-rope], reorder(w[-rope:], 1)])
    heads = w.view(args.n_heads, args.qk_head_dim, -1)
    rot = reorder(heads[:, -rope:].reshape(args.n_heads * rope, -1), args.n_heads).view(args.n_heads, rope, -1)
    return torch.cat([heads[:, :-rope], rot], dim=1).reshape(w.shape)


def to_hf(args: DeepseekV3Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd. A model
    without routing biases writes zeros for them (transformers' DeepseekV3 always has one)."""
    out = {}
    for ours, hf in hf_names(args).items():
        rows = _rope_rows(args, ours)
        out[hf] = take(ours) if rows is None else _reorder(args, take(ours), rows, rope_to_hf)
    for copy, shared in hf_copies(args).items():
        out[copy] = out[shared].clone()  # a tensor of its own: safetensors refuses tensors that share memory
    return out | bias_routed_to_hf(args.moe, take, args.n_layers + args.mtp_layers)


def from_hf_tensor(args: DeepseekV3Args, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    expert = bias_routed_from_hf(name, hf)
    if expert is not None:
        return expert
    assert isinstance(hf, torch.Tensor)
    rows = _rope_rows(args, name)
    return hf if rows is None else _reorder(args, hf, rows, rope_from_hf).contiguous()
