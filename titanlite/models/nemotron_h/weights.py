"""Nemotron-H's weights under Hugging Face's names (NemotronHForCausalLM), both ways, as the published folders hold
them (backbone.*, which transformers' save_pretrained writes back; a folder under transformers' module names,
model.*, reads the same).

Each layer's norm is backbone.layers.i.norm (our attention_norm or ffn_norm) and its sublayer backbone.layers.i.mixer.
Mamba-2: in_proj's rows are [z | x | B | C | dt] (our wz, wx, wb, wc, wdt), conv1d's [x | B | C] channels, weight
[C, 1, K] (our conv_x, conv_b, conv_c [C, K] and their biases); A_log, D, dt_bias, the gated norm and out_proj one to
one. Attention: q_proj, k_proj, v_proj, o_proj, with no rotations to reorder. MLP: up_proj and down_proj (w1, w2).
MoE: the router gate and its e_score_correction_bias (our routing bias, a buffer), one up_proj and down_proj per
expert (stacked into our experts.w1 and w2), shared_experts.up_proj and down_proj, and LatentMoE's fc1_latent_proj
and fc2_latent_proj (our latent_down and latent_up). The multi-token prediction depth (Nemotron 3 Super's) under
mtp.layers.0 (its fusion and attention) and mtp.layers.1 (its experts and final norm) where the run builds it,
carried unchanged into an export where it does not (hf_carried)."""

from __future__ import annotations

import torch

from titanlite.models.common.mamba2_weights import Fusing, from_fused, mamba_sources
from titanlite.models.nemotron_h.args import NemotronHArgs

PREFIX, MODULE_PREFIX = "backbone.", "model."  # the stored names' and transformers' modules'
ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
MLP = {"w1": "up_proj", "w2": "down_proj"}
BIAS = "router.expert_bias"  # our routing bias (a buffer); Hugging Face's gate.e_score_correction_bias
LATENT = {"latent_down": "fc1_latent_proj", "latent_up": "fc2_latent_proj"}


# The config.json fields of multi-token prediction an export keeps from the folder it started from.
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_layers_block_type", "mtp_hybrid_override_pattern")


# A depth's own tensors around its block: ours under mtp.{layer}. -> the published ones under mtp.layers.
MTP_OWN = {"enorm": "0.enorm", "hnorm": "0.hnorm", "eh_proj": "0.eh_proj", "norm": "1.final_layernorm"}


def hf_carried(args: NemotronHArgs, keys: list[str]) -> list[str]:
    """A folder's multi-token prediction layers (mtp.*) where the run builds none (model.mtp_layers = 0): carried
    unchanged into an export (titanlite/components/hf_weights.py)."""
    return [] if args.mtp_layers else [k for k in keys if k.startswith("mtp.")]


def hf_folder(args: NemotronHArgs, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export from a folder says of multi-token prediction what the folder said (its MTP layers carried or
    trained)."""
    return config | {k: source[k] for k in MTP_FIELDS if k in source}, tensors


def _mtp_sources(args: NemotronHArgs) -> dict[str, str | tuple[str, ...]]:
    """The multi-token prediction depth (layer n_layers, Nemotron 3 Super's): its block's attention sublayer under
    mtp.layers.0 (with the fusion's enorm, hnorm and eh_proj) and its mixture of experts under mtp.layers.1 (with the
    final_layernorm before the shared head)."""
    i = args.n_layers
    names: dict[str, str | tuple[str, ...]] = {f"layers.{i}.attention_norm.weight": "mtp.layers.0.norm.weight"}
    names |= {f"layers.{i}.attention.{o}.weight": f"mtp.layers.0.mixer.{h}.weight" for o, h in ATTENTION.items()}
    names[f"layers.{i}.ffn_norm.weight"] = "mtp.layers.1.norm.weight"
    names |= _moe_sources(args, f"layers.{i}.feed_forward.", "mtp.layers.1.mixer.")
    return names | {f"mtp.{i}.{o}.weight": f"mtp.layers.{h}.weight" for o, h in MTP_OWN.items()}


def _moe_sources(args: NemotronHArgs, ours: str, hf: str) -> dict[str, str | tuple[str, ...]]:
    moe = args.moe
    assert moe is not None
    names: dict[str, str | tuple[str, ...]] = {f"{ours}router.gate.weight": f"{hf}gate.weight"}
    if moe.balance == "bias":
        names[ours + BIAS] = f"{hf}gate.e_score_correction_bias"
    for w, proj in MLP.items():
        names[f"{ours}experts.{w}"] = tuple(f"{hf}experts.{e}.{proj}.weight" for e in range(moe.n_experts))
        names[f"{ours}shared_expert.{w}.weight"] = f"{hf}shared_experts.{proj}.weight"
    if moe.latent_dim:
        names |= {f"{ours}{o}.weight": f"{hf}{h}.weight" for o, h in LATENT.items()}
    return names


def hf_sources(args: NemotronHArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the Hugging Face tensor it is made from (output.weight included even when tied)."""
    names: dict[str, str | tuple[str, ...]] = {
        "tok_embeddings.weight": f"{PREFIX}embeddings.weight",
        "norm.weight": f"{PREFIX}norm_f.weight",
        "output.weight": "lm_head.weight",
    }
    for i, kind in enumerate(args.layer_types):
        ours, hf = f"layers.{i}.", f"{PREFIX}layers.{i}."
        norm = "ffn_norm" if kind in ("mlp", "moe") else "attention_norm"
        names[f"{ours}{norm}.weight"] = f"{hf}norm.weight"
        if kind == "moe":
            names |= _moe_sources(args, f"{ours}feed_forward.", f"{hf}mixer.")
        elif kind == "mamba":
            names |= mamba_sources(args, f"{ours}attention.", f"{hf}mixer.")
        elif kind == "full_attention":
            names |= {f"{ours}attention.{o}.weight": f"{hf}mixer.{h}.weight" for o, h in ATTENTION.items()}
        else:
            biases = (".weight", ".bias") if args.mlp_bias else (".weight",)
            names |= {f"{ours}feed_forward.{o}{b}": f"{hf}mixer.{h}{b}" for o, h in MLP.items() for b in biases}
    return names | (_mtp_sources(args) if args.mtp_layers else {})


def hf_keys(args: NemotronHArgs, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the stored ones: transformers' module names (model.*) read as backbone.*."""
    return {(PREFIX + k[len(MODULE_PREFIX) :] if k.startswith(MODULE_PREFIX) else k): k for k in keys}


def _mamba_leaf(args: NemotronHArgs, name: str) -> str | None:
    """The name under its mixer of a Mamba layer's parameter (None: not one)."""
    layer = int(name.split(".")[1]) if name.startswith("layers.") else args.n_layers
    if layer >= args.n_layers or args.layer_types[layer] != "mamba":
        return None
    return name.partition(".attention.")[2] or None


def from_hf_tensor(args: NemotronHArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor (hf_sources[name]); a stacked expert tensor from
    its experts' tensors, in expert order; the routing bias in float32."""
    if isinstance(hf, list):
        return torch.stack(hf).contiguous()
    if name.endswith(BIAS):
        return hf.float()
    leaf = _mamba_leaf(args, name)
    part = None if leaf is None else from_fused(args, leaf, hf)
    return hf.contiguous() if part is None else part


def to_hf(args: NemotronHArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    fusing = Fusing()
    out: dict[str, torch.Tensor] = {}
    for ours, hf in hf_sources(args).items():
        if isinstance(hf, tuple):  # a stacked expert tensor: one per expert
            out |= dict(zip(hf, take(ours).unbind(0)))
            continue
        leaf = _mamba_leaf(args, ours)
        if leaf is None or not fusing.add(args, leaf, hf, take(ours)):
            out[hf] = take(ours)
    return out | fusing.tensors()
