"""gpt-oss's weights under Hugging Face's names (GptOssForCausalLM): the Llama decoder's for embeddings, norms and
attention (with its RoPE row order change), plus self_attn.sinks; at each layer mlp.router.{weight,bias} and the
stacked experts as transformers stores them: experts.gate_up_proj [E, dim, 2 * hidden], gate and up columns
interleaved (gate 0, up 0, gate 1, ...), with gate_up_proj_bias [E, 2 * hidden], and experts.down_proj
[E, hidden, dim] with down_proj_bias [E, dim], each expert's matrix the transpose of nn.Linear's."""

from __future__ import annotations

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.gpt_oss.args import GptOssArgs

# Ours (relative to a block's feed_forward) -> (HF name relative to the layer's mlp, which half of gate_up).
_EXPERTS = {
    "router.gate.weight": ("router.weight", None),
    "router.gate.bias": ("router.bias", None),
    "experts.w1": ("experts.gate_up_proj", 0),
    "experts.w3": ("experts.gate_up_proj", 1),
    "experts.w2": ("experts.down_proj", None),
    "experts.b1": ("experts.gate_up_proj_bias", 0),
    "experts.b3": ("experts.gate_up_proj_bias", 1),
    "experts.b2": ("experts.down_proj_bias", None),
}


def hf_names(args: GptOssArgs) -> dict[str, str]:
    """Our parameter name -> the HF tensor it is made from (w1 and w3, b1 and b3 from one fused tensor each)."""
    names = {ours: hf for ours, hf in llama.hf_names(args).items() if ".feed_forward." not in ours}
    for i in range(args.n_layers):
        names[f"layers.{i}.attention.sinks"] = f"model.layers.{i}.self_attn.sinks"
        for ours, (hf, _) in _EXPERTS.items():
            names[f"layers.{i}.feed_forward.{ours}"] = f"model.layers.{i}.mlp.{hf}"
    return names


def hf_keys(args: GptOssArgs, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def hf_sources(args: GptOssArgs) -> dict[str, str]:
    return hf_names(args)


def _half(name: str) -> int | None:
    """Which interleaved half of gate_up our parameter `name` is (0 gate, 1 up), None for any other tensor."""
    for ours, (_, half) in _EXPERTS.items():
        if name.endswith(".feed_forward." + ours):
            return half
    return None


def hf_rows_stored(args: GptOssArgs, name: str) -> bool:
    """The stacked experts' tensors (and their biases) are the HF tensors' experts, one for one: a rank holding some
    experts reads only theirs (titanlite/components/hf_weights.py)."""
    return ".feed_forward.experts." in name


def _is_matrix(name: str) -> bool:
    return name.endswith((".experts.w1", ".experts.w3", ".experts.w2"))


def from_hf_tensor(args: GptOssArgs, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its HF tensor: a half of the interleaved gate_up columns, the
    experts' matrices transposed to nn.Linear's [out, in]."""
    half = _half(name)
    if half is not None:
        hf = hf[..., half::2]
    if _is_matrix(name):
        hf = hf.transpose(-2, -1)
    return llama.from_hf_tensor(args, name, hf.contiguous())


def to_hf(args: GptOssArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    names = hf_names(args)
    plain = {ours: hf for ours, hf in names.items() if ".feed_forward." not in ours}
    out = llama.to_hf(args, sd, take, plain)
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.feed_forward.", f"model.layers.{i}.mlp."
        out[hf + "router.weight"] = take(ours + "router.gate.weight")
        out[hf + "router.bias"] = take(ours + "router.gate.bias")
        gate, up = take(ours + "experts.w1").transpose(-2, -1), take(ours + "experts.w3").transpose(-2, -1)
        out[hf + "experts.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)  # [E, dim, 2 * hidden]
        out[hf + "experts.gate_up_proj_bias"] = torch.stack(
            [take(ours + "experts.b1"), take(ours + "experts.b3")], -1
        ).flatten(-2)
        out[hf + "experts.down_proj"] = take(ours + "experts.w2").transpose(-2, -1)  # [E, hidden, dim]
        out[hf + "experts.down_proj_bias"] = take(ours + "experts.b2")
    return out
