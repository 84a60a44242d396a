"""Kimi Linear's weights under Hugging Face's names (the published checkpoint's, which transformers' save_pretrained
writes too): KDA's projections (self_attn.{q,k,v}_proj, {q,k,v}_conv1d [C, 1, K], f_a_proj, f_b_proj, A_log
[1, 1, H, 1], dt_bias, b_proj, g_a_proj, g_b_proj, o_norm, o_proj), latent attention's (DeepSeek-V3's names), the
dense MLP (mlp.{gate,up,down}_proj; transformers writes it under block_sparse_moe., which is read too) and each
sparse layer's router (block_sparse_moe.gate.weight), correction bias (gate.e_score_correction_bias: our routing
bias, a buffer), experts (block_sparse_moe.experts.E.w1/w3/w2, stacked on import) and shared experts."""

from __future__ import annotations

import re

import torch

from titanlite.models.common.latent.weights import ENDS, block_names, latent_names
from titanlite.models.common.moe.weights import bias_routed_from_hf, bias_routed_sources, bias_routed_to_hf
from titanlite.models.kimi_linear.args import KimiLinearArgs

_MOE = "block_sparse_moe"
_KDA = [
    ("wq", "q_proj"),
    ("wk", "k_proj"),
    ("wv", "v_proj"),
    ("wf_a", "f_a_proj"),
    ("wf_b", "f_b_proj"),
    ("wb", "b_proj"),
    ("wg_a", "g_a_proj"),
    ("wg_b", "g_b_proj"),
    ("norm", "o_norm"),
    ("wo", "o_proj"),
]
# KDA's parameters that are not a module's weight: ours -> theirs
_KDA_PARAMS = {
    "conv_q": "q_conv1d.weight",
    "conv_k": "k_conv1d.weight",
    "conv_v": "v_conv1d.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
}


def hf_names(args: KimiLinearArgs) -> dict[str, str]:
    """Our tensor name -> its HF name, except the sparse layers' blocks (hf_sources)."""
    names = dict(ENDS)
    for i, kind in enumerate(args.layer_types):
        linear = kind == "linear_attention"
        names |= block_names(i, _KDA if linear else latent_names(args), dense=not args.moe.is_sparse(i))
        if linear:
            names |= {
                f"layers.{i}.attention.{w}": f"model.layers.{i}.self_attn.{theirs}" for w, theirs in _KDA_PARAMS.items()
            }
    return names


def hf_sources(args: KimiLinearArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter (and routing-bias buffer) name -> the HF tensor it is made from; a stacked expert tensor ->
    its experts' tensors, in expert order (the sparse layers' blocks: moe/weights.py bias_routed_sources)."""
    return hf_names(args) | bias_routed_sources(args.moe, args.n_layers, _MOE, names="w1")


def hf_keys(args: KimiLinearArgs, keys: list[str]) -> dict[str, str]:
    """The folder's tensors the model reads, under the names hf_sources uses: a dense layer's MLP stored under
    block_sparse_moe. (as transformers writes it) read as mlp.; no layer past num_hidden_layers, nor a correction
    bias when this model balances otherwise."""

    def view(key: str) -> str | None:
        if args.moe.balance != "bias" and key.endswith(".e_score_correction_bias"):
            return None
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        if layer is None:
            return key
        i = int(layer.group(1))
        if i >= args.n_layers:
            return None
        dense = f"model.layers.{i}.{_MOE}."
        return key.replace(dense, f"model.layers.{i}.mlp.") if not args.moe.is_sparse(i) else key

    return {seen: k for k in keys if (seen := view(k)) is not None}


def _layout(args: KimiLinearArgs, name: str) -> str | None:
    """Which of our KDA tensors HF stores in another shape: "conv" ([C, K] as [C, 1, K]), "A_log" ([H] as
    [1, 1, H, 1]); None for the rest."""
    leaf = name.rpartition(".")[2]
    if leaf in ("conv_q", "conv_k", "conv_v"):
        return "conv"
    return "A_log" if leaf == "A_log" else None


def to_hf(args: KimiLinearArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd. A model
    without routing biases writes zeros for them (transformers' KimiLinear always has one)."""
    out = {}
    for ours, hf in hf_names(args).items():
        t, layout = take(ours), _layout(args, ours)
        out[hf] = t.unsqueeze(1) if layout == "conv" else t.view(1, 1, -1, 1) if layout == "A_log" else t
    return out | bias_routed_to_hf(args.moe, take, args.n_layers, _MOE, names="w1")


def from_hf_tensor(args: KimiLinearArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    expert = bias_routed_from_hf(name, hf)
    if expert is not None:
        return expert
    assert isinstance(hf, torch.Tensor)
    layout = _layout(args, name)
    if layout == "conv":
        return hf.squeeze(1).contiguous()
    return hf.reshape(-1).contiguous() if layout == "A_log" else hf
