"""GPT-2's weights under Hugging Face's names (GPT2LMHeadModel): Conv1D weights stored [in, out], and q, k, v
fused into one c_attn. titanlite/components/hf_weights.py reads and writes the files."""

from __future__ import annotations

import torch

from titanlite.models.gpt2.args import GPT2Args

# Conv1D weights in HF's GPT-2 are stored [in, out], the transpose of nn.Linear's [out, in].
_TRANSPOSED = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_names(args: GPT2Args) -> dict[str, str]:
    """Our parameter name -> HF GPT2LMHeadModel name, for every parameter but the fused q/k/v."""
    names = {
        "tok_embeddings.weight": "transformer.wte.weight",
        "pos_embeddings.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "output.weight": "lm_head.weight",
    }
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"transformer.h.{i}."
        for leaf in ("weight", "bias"):
            names[f"{ours}attention_norm.{leaf}"] = f"{hf}ln_1.{leaf}"
            names[f"{ours}ffn_norm.{leaf}"] = f"{hf}ln_2.{leaf}"
            names[f"{ours}attention.wo.{leaf}"] = f"{hf}attn.c_proj.{leaf}"
            names[f"{ours}feed_forward.w1.{leaf}"] = f"{hf}mlp.c_fc.{leaf}"
            names[f"{ours}feed_forward.w2.{leaf}"] = f"{hf}mlp.c_proj.{leaf}"
    return names


def hf_keys(args: GPT2Args, keys: list[str]) -> dict[str, str]:
    """Bare GPT2Model checkpoints (e.g. openai-community/gpt2, saved without the "transformer." prefix) given
    it; maps our view of each name to the stored one."""
    if "transformer.wte.weight" not in keys and "wte.weight" in keys:
        return {(k if k == "lm_head.weight" else "transformer." + k): k for k in keys}
    return {k: k for k in keys}


def hf_sources(args: GPT2Args) -> dict[str, str]:
    """Our parameter name -> the HF tensor it is made from (q, k and v all come from c_attn)."""
    names = hf_names(args)
    for i in range(args.n_layers):
        for w in ("wq", "wk", "wv"):
            for leaf in ("weight", "bias"):
                names[f"layers.{i}.attention.{w}.{leaf}"] = f"transformer.h.{i}.attn.c_attn.{leaf}"
    return names


def to_hf(args: GPT2Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd."""
    out = {}
    for ours, hf in hf_names(args).items():
        t = take(ours)
        out[hf] = t.t() if hf.endswith(_TRANSPOSED) else t
    for i in range(args.n_layers):
        # HF fuses q, k, v into one Conv1D: weight [dim, 3*dim] (q | k | v along the output dim), bias [3*dim].
        for leaf in ("weight", "bias"):
            fused = torch.cat([take(f"layers.{i}.attention.{w}.{leaf}") for w in ("wq", "wk", "wv")], dim=0)
            out[f"transformer.h.{i}.attn.c_attn.{leaf}"] = fused.t() if leaf == "weight" else fused
    return out


def from_hf_tensor(args: GPT2Args, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its HF tensor (hf_sources[name])."""
    if ".attention.w" in name and name.rsplit(".", 2)[-2] in ("wq", "wk", "wv"):
        fused = hf.t() if name.endswith("weight") else hf
        return fused.chunk(3, dim=0)["qkv".index(name.rsplit(".", 2)[-2][1])].contiguous()
    if name.endswith(("attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight")):
        return hf.t().contiguous()  # HF's Conv1D stores these [in, out]
    return hf
