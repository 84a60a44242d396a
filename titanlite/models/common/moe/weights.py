"""The MoE decoder's weights under Hugging Face's names: the Llama decoder's (titanlite/models/llama3/weights.py),
and at each sparse layer the router (model.layers.N.mlp.gate.weight) and one tensor per expert
(model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight), stacked into our experts.w1, w3 and w2 on import.
`naming(block, names)` gives the same functions for another family's names (Mixtral: block_sparse_moe, w1/w3/w2)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.decoder_args import MoEDecoderArgs
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
