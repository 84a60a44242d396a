"""Gemma 4's weights under Hugging Face's names (Gemma4ForCausalLM; the published Gemma4ForConditionalGeneration
folders keep the same under model.language_model.*, beside their vision and audio towers, which are carried), both
ways. No row is reordered (the model rotates halves of each head, as Hugging Face's do). The experts are stored
stacked as transformers 5 holds them: experts.gate_up_proj [E, 2 * hidden, dim] (gate rows first) split into our w1
and w3, experts.down_proj our w2. Each block's layer_scalar is a buffer of ours too."""

from __future__ import annotations

import torch

from titanlite.models.gemma4.args import Gemma4Args

TEXT_PREFIX = "model.language_model."  # where the multimodal folders keep the text model's "model."
MULTIMODAL = "gemma4"
CARRIED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

ATTENTION = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
BLOCK = {  # ours -> Hugging Face's, under the layer
    "attention_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "layer_scalar": "layer_scalar",
}
EXPERTS = {
    "post_mlp_norm.weight": "post_feedforward_layernorm_1.weight",
    "moe.input_norm.weight": "pre_feedforward_layernorm_2.weight",
    "moe.output_norm.weight": "post_feedforward_layernorm_2.weight",
    "moe.router.gate.weight": "router.proj.weight",
    "moe.router.scale": "router.scale",
    "moe.router.per_expert_scale": "router.per_expert_scale",
    "moe.experts.w1": "experts.gate_up_proj",
    "moe.experts.w3": "experts.gate_up_proj",
    "moe.experts.w2": "experts.down_proj",
}
PER_LAYER = {
    "per_layer_gate.weight": "per_layer_input_gate.weight",
    "per_layer_proj.weight": "per_layer_projection.weight",
    "per_layer_norm.weight": "post_per_layer_input_norm.weight",
}


def hf_sources(args: Gemma4Args) -> dict[str, str]:
    """Our parameter (and layer_scalar buffer) name -> the Hugging Face tensor it is made from."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if args.per_layer_dim:
        names["per_layer_inputs.embedding.weight"] = "model.embed_tokens_per_layer.weight"
        names["per_layer_inputs.projection.weight"] = "model.per_layer_model_projection.weight"
        names["per_layer_inputs.norm.weight"] = "model.per_layer_projection_norm.weight"
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        attention = ["wq", "wo", "q_norm"]
        if args.kv_mode(i) != "reuse":
            attention += ["wk", "k_norm"]
            if not (args.k_eq_v and args.kinds()[i] == "full_attention"):
                attention.append("wv")
        for w in attention:
            bias = w.startswith("w") and (args.out_bias if w == "wo" else args.qkv_bias)
            for leaf in ("weight", "bias") if bias else ("weight",):
                names[f"{ours}attention.{w}.{leaf}"] = f"{hf}self_attn.{ATTENTION[w]}.{leaf}"
        block = BLOCK | (EXPERTS if args.moe is not None else {}) | (PER_LAYER if args.per_layer_dim else {})
        names |= {ours + o: hf + h for o, h in block.items()}
    return names


def hf_keys(args: Gemma4Args, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the text model's: the multimodal folders' model.language_model.* as model.*."""
    return {("model." + k[len(TEXT_PREFIX) :] if k.startswith(TEXT_PREFIX) else k): k for k in keys}


def hf_carried(args: Gemma4Args, keys: list[str]) -> list[str]:
    """A multimodal folder's tensors beside the text model (model.vision_tower.*, model.audio_tower.*,
    model.embed_vision.*, model.embed_audio.*): carried unchanged into an export (components/hf_weights.py)."""
    return [k for k in keys if k.startswith(CARRIED_PREFIXES)]


def hf_folder(args: Gemma4Args, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export in the layout of the folder it started from: a multimodal one (model_type gemma4) gets its own
    config.json back with the trained text model's fields in text_config, and the text tensors under
    model.language_model.*; a text model's folder, the export as it is."""
    if source.get("model_type") != MULTIMODAL:
        return config, tensors
    text = {k: v for k, v in (source.get("text_config") or {}).items() if k != "per_layer_config"}
    skip = ("architectures", "model_type", "dtype", "torch_dtype")
    ids = ("pad_token_id", "bos_token_id", "eos_token_id")  # the folder's, where the export names none
    text |= {k: v for k, v in config.items() if k not in skip and not (k in ids and v is None)}
    out = {**source, "text_config": text}
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        out[key] = config[key]
    renamed = {(TEXT_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()}
    return out, renamed


def from_hf_tensor(args: Gemma4Args, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our tensor `name`'s full value from its Hugging Face tensor (hf_sources[name])."""
    if name.endswith(("moe.experts.w1", "moe.experts.w3")):
        gate, up = hf.chunk(2, dim=1)
        return (gate if name.endswith("w1") else up).contiguous()
    return hf.contiguous()


def to_hf(args: Gemma4Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> the text model's Hugging Face names (lm_head.weight always present)."""
    out: dict[str, torch.Tensor] = {}
    for ours, hf in hf_sources(args).items():
        if ours.endswith("moe.experts.w3"):
            continue
        if ours.endswith("moe.experts.w1"):
            out[hf] = torch.cat([take(ours), take(ours[: -len("w1")] + "w3")], dim=1)
        else:
            out[hf] = take(ours)
    return out
