"""GLM-4.5's weights under Hugging Face's names (Glm4MoeForCausalLM's checkpoint files): the Llama decoder's
(self_attn.{q,k,v}_proj weights and biases, o_proj, q_norm / k_norm, input_layernorm, post_attention_layernorm, the
dense layers' mlp.{gate,up,down}_proj), and at each sparse layer the router (mlp.gate.weight), its correction bias
(mlp.gate.e_score_correction_bias: our routing bias, a buffer), one tensor per expert (mlp.experts.E.*, stacked into
experts.w1, w3, w2 on import) and the shared experts (mlp.shared_experts.*).

Rotary rows: Hugging Face rotates the leading rotary_dim channels of each head as two halves (rotate_half), ours as
adjacent pairs; those rows of the query and key projections (weights and biases) and of the Q/K norms' weights are
reordered on import and back on export (the Llama decoder's: decoder_weights.rotary_rows), the other channels kept. The
multi-token prediction layers (num_nextn_predict_layers, stored as layers num_hidden_layers + k, as DeepSeek-V3 stores
them) are the model's layers of those numbers and their mtp.* norms and projection; each one's copies of the embedding
and head must equal the model's (hf_copies). With mtp_layers 0 a folder's such layers are carried unchanged into an
export (hf_carried)."""

from __future__ import annotations

import dataclasses

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.moe.weights import bias_routed_from_hf, bias_routed_sources, bias_routed_to_hf
from titanlite.models.glm4_moe.args import Glm4MoeArgs
from titanlite.models.glm4_moe.hf_config import mtp_layers


def _with_mtp_blocks(args: Glm4MoeArgs) -> Glm4MoeArgs:
    """`args` as a decoder whose layers include the multi-token prediction blocks (their names are those of further
    decoder layers, ours and Hugging Face's alike)."""
    if not args.mtp_layers:
        return args
    return dataclasses.replace(args, n_layers=args.n_layers + args.mtp_layers, mtp_layers=0)


def _names(args: Glm4MoeArgs) -> dict[str, str]:
    """Our tensor name -> its HF name (the Llama decoder's), except the sparse layers' blocks."""
    names = llama.hf_names(_with_mtp_blocks(args)) | llama.mtp_names(args)
    return {ours: hf for ours, hf in names.items() if not _sparse_block(args, ours)}


def hf_sources(args: Glm4MoeArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter (and routing-bias buffer) name -> the HF tensor it is made from; a stacked expert tensor -> its
    experts' tensors, in expert order (the sparse layers' blocks: moe/weights.py bias_routed_sources)."""
    return _names(args) | bias_routed_sources(args.moe, _with_mtp_blocks(args).n_layers)


hf_keys = llama.mtp_family_keys  # the folder's tensors the model reads (decoder_weights)


def hf_copies(args: Glm4MoeArgs) -> dict[str, str]:
    """The multi-token prediction layers' copies of the embedding and head (decoder_weights.mtp_copies)."""
    return llama.mtp_copies(args)


def hf_carried(args: Glm4MoeArgs, keys: list[str]) -> list[str]:
    """The multi-token prediction layers this model does not have (model.layers.N past its decoder's and its own
    prediction layers): not trained, carried unchanged into an export (titanlite/components/hf_weights.py)."""
    return llama.layers_past(args.n_layers + args.mtp_layers, keys)


def hf_carried_shapes(args: Glm4MoeArgs, carried: list[str], shapes: dict) -> dict[str, tuple[int, ...]]:
    """What the multi-token prediction layers' tensors must be to belong to this model (decoder_weights)."""
    return llama.next_token_layer_shapes(args, carried, shapes)


def hf_folder(args: Glm4MoeArgs, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export that carries the folder's multi-token prediction layers (a run without them) says how many there
    are, as it did."""
    if not args.mtp_layers and mtp_layers(source):
        config = {**config, "num_nextn_predict_layers": mtp_layers(source)}
    return config, tensors


def _sparse_block(args: Glm4MoeArgs, ours: str) -> bool:
    parts = ours.split(".")
    return parts[0] == "layers" and parts[2] == "feed_forward" and args.moe.is_sparse(int(parts[1]))


def to_hf(args: Glm4MoeArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd. A model
    without routing biases writes zeros for them (transformers' Glm4Moe always has one)."""
    blocks = _with_mtp_blocks(args)
    out = {hf: llama.to_hf_tensor(blocks, ours, take(ours)) for ours, hf in _names(args).items()}
    for copy, shared in hf_copies(args).items():
        out[copy] = out[shared].clone()  # a tensor of its own: safetensors refuses tensors that share memory
    return out | bias_routed_to_hf(args.moe, take, blocks.n_layers)


def from_hf_tensor(args: Glm4MoeArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    expert = bias_routed_from_hf(name, hf)
    if expert is not None:
        return expert
    assert isinstance(hf, torch.Tensor)
    return llama.from_hf_tensor(args, name, hf)
