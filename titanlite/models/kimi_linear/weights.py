"""Kimi Linear's weights under Hugging Face's names (the published checkpoint's, which transformers' save_pretrained
writes too): KDA's projections (self_attn.{q,k,v}_proj, {q,k,v}_conv1d [C, 1, K], f_a_proj, f_b_proj, A_log
[1, 1, H, 1], dt_bias, b_proj, g_a_proj, g_b_proj, o_norm, o_proj), latent attention's (DeepSeek-V3's names), the
dense MLP (mlp.{gate,up,down}_proj; transformers writes it under block_sparse_moe., which is read too) and each
sparse layer's router (block_sparse_moe.gate.weight), correction bias (gate.e_score_correction_bias: our routing
bias, a buffer), experts (block_sparse_moe.experts.E.w1/w3/w2, stacked on import) and shared experts."""

from __future__ import annotations

import re

import torch

from titanlite.models.common.moe.layer import EXPERT_NAMES, moe_to_hf
from titanlite.models.kimi_linear.args import KimiLinearArgs

_BIAS = "router.expert_bias"
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
_MLP = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]


def _latent(args: KimiLinearArgs) -> list[tuple[str, str]]:
    names = [("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj")]
    if args.q_lora_rank:
        return names + [("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj")]
    return names + [("wq", "q_proj")]


def hf_names(args: KimiLinearArgs) -> dict[str, str]:
    """Our tensor name -> its HF name, except the stacked experts (hf_sources)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for i, kind in enumerate(args.layer_types):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = hf + "input_layernorm.weight"
        names[ours + "ffn_norm.weight"] = hf + "post_attention_layernorm.weight"
        mixer = _KDA if kind == "linear_attention" else _latent(args)
        for w, proj in mixer:
            names[f"{ours}attention.{w}.weight"] = f"{hf}self_attn.{proj}.weight"
        if kind == "linear_attention":
            for w, theirs in _KDA_PARAMS.items():
                names[f"{ours}attention.{w}"] = f"{hf}self_attn.{theirs}"
        if not args.moe.is_sparse(i):
            for w, proj in _MLP:
                names[f"{ours}feed_forward.{w}.weight"] = f"{hf}mlp.{proj}.weight"
            continue
        names[ours + "feed_forward.router.gate.weight"] = f"{hf}{_MOE}.gate.weight"
        if args.moe.balance == "bias":
            names[ours + "feed_forward." + _BIAS] = f"{hf}{_MOE}.gate.e_score_correction_bias"
        if args.moe.shared_hidden:
            for w, proj in _MLP:
                names[f"{ours}feed_forward.shared_expert.{w}.weight"] = f"{hf}{_MOE}.shared_experts.{proj}.weight"
    return names


def hf_sources(args: KimiLinearArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter (and routing-bias buffer) name -> the HF tensor it is made from; a stacked expert tensor ->
    its experts' tensors, in expert order."""
    sources: dict[str, str | tuple[str, ...]] = dict(hf_names(args))
    for i in range(args.n_layers):
        if args.moe.is_sparse(i):
            for w, theirs in zip(("w1", "w3", "w2"), EXPERT_NAMES["w1"]):
                sources[f"layers.{i}.feed_forward.experts.{w}"] = tuple(
                    f"model.layers.{i}.{_MOE}.experts.{e}.{theirs}.weight" for e in range(args.moe.n_experts)
                )
    return sources


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
        if ours.endswith(_BIAS):
            continue
        t, layout = take(ours), _layout(args, ours)
        out[hf] = t.unsqueeze(1) if layout == "conv" else t.view(1, 1, -1, 1) if layout == "A_log" else t
    for i in range(args.n_layers):
        if args.moe.is_sparse(i):
            ours = f"layers.{i}.feed_forward."
            tensors = ("router.gate.weight", "experts.w1", "experts.w3", "experts.w2")
            block = moe_to_hf({name: take(ours + name) for name in tensors}, names="w1")
            out |= {f"model.layers.{i}.{_MOE}.{name}": t for name, t in block.items()}
            bias = take(ours + _BIAS).float() if args.moe.balance == "bias" else torch.zeros(args.moe.n_experts)
            out[f"model.layers.{i}.{_MOE}.gate.e_score_correction_bias"] = bias
    return out


def from_hf_tensor(args: KimiLinearArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    if isinstance(hf, list):
        return torch.stack(hf).contiguous()
    if name.endswith(_BIAS):
        return hf.float()
    layout = _layout(args, name)
    if layout == "conv":
        return hf.squeeze(1).contiguous()
    return hf.reshape(-1).contiguous() if layout == "A_log" else hf
