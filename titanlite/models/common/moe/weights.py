"""The MoE decoder's weights under Hugging Face's names: the Llama decoder's (titanlite/models/llama3/weights.py),
and at each sparse layer the router (model.layers.N.mlp.gate.weight) and one tensor per expert
(model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight), stacked into our experts.w1, w3 and w2 on import.
`naming(block, names)` gives the same functions for another family's names (Mixtral: block_sparse_moe, w1/w3/w2).
A DeepSeek-style block's (moe/args.py bias_routed) routing bias and shared experts beside them: `bias_routed_sources`
and `bias_routed_to_hf`, the names DeepSeek-V3, GLM-4.5 and Kimi Linear share."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.decoder_args import MoEDecoderArgs
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.layer import EXPERT_NAMES, moe_to_hf


def naming(block: str = "mlp", names: str = "gate_proj") -> SimpleNamespace:
    """hf_sources, hf_keys, to_hf and from_hf_tensor for a family whose MoE block is model.layers.N.{block} and
    whose experts' projections are named as EXPERT_NAMES[names] (gate, up, down)."""
    stacked = dict(zip(("w1", "w3", "w2"), EXPERT_NAMES[names]))  # ours -> HF per-expert projection

    def hf_sources(args: MoEDecoderArgs) -> dict[str, str | tuple[str, ...]]:
        """Our parameter name -> the HF tensor it is made from; a stacked expert tensor -> its experts' tensors."""
        sources: dict[str, str | tuple[str, ...]] = {}
        for ours, hf in llama.hf_names(args).items():
            layer = ours.split(".")[1] if ours.startswith("layers.") else ""
            if not (layer and ".feed_forward." in ours and args.moe.is_sparse(int(layer))):
                sources[ours] = hf
        for i in range(args.n_layers):
            if args.moe.is_sparse(i):
                ours, hf = f"layers.{i}.feed_forward.", f"model.layers.{i}.{block}."
                sources[ours + "router.gate.weight"] = hf + "gate.weight"
                for w, proj in stacked.items():
                    sources[ours + f"experts.{w}"] = tuple(
                        f"{hf}experts.{e}.{proj}.weight" for e in range(args.moe.n_experts)
                    )
        return sources

    def to_hf(args: MoEDecoderArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
        """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd."""
        out = {}
        for ours, hf in hf_sources(args).items():
            if isinstance(hf, str):
                out[hf] = llama.to_hf_tensor(args, ours, take(ours))
        for i in range(args.n_layers):
            if args.moe.is_sparse(i):
                ours = f"layers.{i}.feed_forward."
                tensors = ("router.gate.weight", "experts.w1", "experts.w3", "experts.w2")
                moe = moe_to_hf({name: take(ours + name) for name in tensors}, names=names)
                out |= {f"model.layers.{i}.{block}.{name}": t for name, t in moe.items()}
        return out

    return SimpleNamespace(hf_sources=hf_sources, hf_keys=hf_keys, to_hf=to_hf, from_hf_tensor=from_hf_tensor)


def hf_keys(args: MoEDecoderArgs, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def from_hf_tensor(args: MoEDecoderArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its HF tensor, or from its experts' tensors (hf_sources[name])."""
    if isinstance(hf, list):  # one stacked expert tensor, from its experts' tensors in expert order
        # (the loader reads one parameter's tensors at a time; moe_from_hf maps a whole block's at once)
        return torch.stack(hf).contiguous()
    return llama.from_hf_tensor(args, name, hf)


_MLP = naming()
hf_sources, to_hf = _MLP.hf_sources, _MLP.to_hf  # model.layers.N.mlp, experts.E.{gate,up,down}_proj


BIAS = "router.expert_bias"  # our routing bias (a buffer); Hugging Face's gate.e_score_correction_bias
_SHARED = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # ours -> the shared experts' projection


def bias_routed_sources(
    moe: MoEArgs, n_layers: int, block: str = "mlp", names: str = "gate_proj"
) -> dict[str, str | tuple[str, ...]]:
    """Each sparse layer's DeepSeek-style block (model.layers.N.{block}) of `n_layers`: our router, routing bias
    (where it balances by one) and shared expert -> their Hugging Face tensors (gate, gate.e_score_correction_bias,
    shared_experts.*); each stacked expert tensor -> its experts' tensors (EXPERT_NAMES[names]), in expert order."""
    sources: dict[str, str | tuple[str, ...]] = {}
    for i in range(n_layers):
        if not moe.is_sparse(i):
            continue
        ours, hf = f"layers.{i}.feed_forward.", f"model.layers.{i}.{block}."
        sources[ours + "router.gate.weight"] = hf + "gate.weight"
        if moe.balance == "bias":
            sources[ours + BIAS] = hf + "gate.e_score_correction_bias"
        if moe.shared_hidden:
            for w, proj in _SHARED:
                sources[f"{ours}shared_expert.{w}.weight"] = f"{hf}shared_experts.{proj}.weight"
        for w, proj in zip(("w1", "w3", "w2"), EXPERT_NAMES[names]):
            sources[f"{ours}experts.{w}"] = tuple(f"{hf}experts.{e}.{proj}.weight" for e in range(moe.n_experts))
    return sources


def bias_routed_to_hf(
    moe: MoEArgs, take, n_layers: int, block: str = "mlp", names: str = "gate_proj"
) -> dict[str, torch.Tensor]:
    """The tensors of bias_routed_sources under their Hugging Face names, one per expert; `take(name)` reads ours. A
    block balanced otherwise writes a routing bias of zeros (transformers' DeepSeek-style blocks always have one)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        if not moe.is_sparse(i):
            continue
        ours = f"layers.{i}.feed_forward."
        tensors = ["router.gate.weight", "experts.w1", "experts.w3", "experts.w2"]
        tensors += [f"shared_expert.{w}.weight" for w, _ in _SHARED] if moe.shared_hidden else []
        hf = moe_to_hf({name: take(ours + name) for name in tensors}, names=names, shared="shared_experts")
        hf["gate.e_score_correction_bias"] = (
            take(ours + BIAS).float() if moe.balance == "bias" else torch.zeros(moe.n_experts)
        )
        out |= {f"model.layers.{i}.{block}.{name}": t for name, t in hf.items()}
    return out


def bias_routed_from_hf(name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor | None:
    """Our stacked expert tensor from its experts' tensors (a list), our routing bias (float32) from its tensor; None
    for any other tensor, which the family reads itself."""
    if isinstance(hf, list):
        return torch.stack(hf).contiguous()
    return hf.float() if name.endswith(BIAS) else None
