"""The Qwen hybrid decoder's weights under Qwen3.5's Hugging Face names (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM; the
multimodal Qwen3_5ForConditionalGeneration stores the same under model.language_model.*), both ways.

Full-attention layers: q_proj holds each head's query rows and then its gate rows ([H, 2, head_dim, dim]), split into
our wq and wg; the query and key rows (and the Q/K norms' weights) that rotate, the leading rotary_dim of each head,
are reordered between Hugging Face's rotate-half layout and our adjacent pairs (decoder_weights.rotary_rows), the
rest kept. Linear layers: in_proj_qkv's rows [q | k | v] and conv1d.weight [C, 1, K]'s channels split into wq, wk,
wv and conv_q, conv_k, conv_v; in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias, norm and out_proj one to one. The
MoE blocks' router and per-expert tensors as Qwen3-MoE names them (mlp.gate, mlp.experts.E.{gate,up,down}_proj, and
mlp.shared_expert.*, mlp.shared_expert_gate).

Multi-token prediction (mtp_layers 1, models/common/multi_token.py): the depth's block, our layers.{n_layers}, is a
full-attention layer stored as mtp.layers.0 under a decoder layer's names; its norms and projection are
mtp.pre_fc_norm_embedding (our enorm), mtp.pre_fc_norm_hidden (hnorm), mtp.fc (eh_proj) and mtp.norm. The embedding
and head are the model's (Qwen's mtp_use_dedicated_embeddings false). With mtp_layers 0 a folder's mtp.* are carried
unchanged into an export."""

from __future__ import annotations

import dataclasses

import torch

from titanlite.models.common import decoder_weights as llama
from titanlite.models.common.moe.layer import moe_to_hf
from titanlite.models.common.moe.weights import naming
from titanlite.models.common.qwen_hybrid.args import QwenHybridArgs, QwenHybridMoEArgs
from titanlite.models.common.qwen_hybrid.hf_config import MULTIMODAL

TEXT_PREFIX = "model.language_model."  # where the multimodal folders keep the text model's "model."
# What a published folder holds beside the text model: the vision tower, the multi-token-prediction layers.
CARRIED_PREFIXES = ("model.visual.", "mtp.")

LINEAR = {  # ours (under attention.) -> Hugging Face's (under linear_attn.), one to one
    "wz.weight": "in_proj_z.weight",
    "wb.weight": "in_proj_b.weight",
    "wa.weight": "in_proj_a.weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "norm.weight": "norm.weight",
    "wo.weight": "out_proj.weight",
}
SPLIT = {  # ours (under attention.) -> the Hugging Face tensor it is a slice of, and which slice (0, 1, 2: q, k, v)
    "wq.weight": ("in_proj_qkv.weight", 0),
    "wk.weight": ("in_proj_qkv.weight", 1),
    "wv.weight": ("in_proj_qkv.weight", 2),
    "conv_q": ("conv1d.weight", 0),
    "conv_k": ("conv1d.weight", 1),
    "conv_v": ("conv1d.weight", 2),
}


MTP_OWN = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}


def with_mtp_blocks(args: QwenHybridArgs) -> QwenHybridArgs:
    """`args` as a decoder whose layers include the multi-token prediction block (a further full-attention layer),
    for the names and layouts of its tensors (mtp_names renames them)."""
    if not args.mtp_layers:
        return args
    kinds = (*args.layer_types, *("full_attention",) * args.mtp_layers)
    return dataclasses.replace(args, n_layers=args.n_layers + args.mtp_layers, layer_types=kinds, mtp_layers=0)


def mtp_name(args: QwenHybridArgs, hf: str) -> str:
    """A tensor's Hugging Face name; the multi-token prediction block's (model.layers.{n_layers + J}) mtp.layers.J."""
    for j in range(args.mtp_layers):
        layer = f"model.layers.{args.n_layers + j}."
        if hf.startswith(layer):
            return f"mtp.layers.{j}." + hf[len(layer) :]
    return hf


def _renamed(args: QwenHybridArgs, sources: dict) -> dict:
    out = {}
    for ours, hf in sources.items():
        out[ours] = mtp_name(args, hf) if isinstance(hf, str) else tuple(mtp_name(args, one) for one in hf)
    for i in range(args.n_layers, args.n_layers + args.mtp_layers):
        out |= {f"mtp.{i}.{o}.weight": f"mtp.{h}.weight" for o, h in MTP_OWN.items()}
    return out


def _shared(args: QwenHybridArgs, names: dict) -> dict:
    """The decoder's names, the attention and MLP/MoE ones of the full layers; the linear layers' replaced."""
    out = {}
    for ours, hf in names.items():
        if ours.startswith("layers."):
            layer = int(ours.split(".")[1])
            if args.layer_types[layer] == "linear_attention" and ".attention." in ours:
                continue
        out[ours] = hf
    for i, kind in enumerate(args.layer_types):
        ours, hf = f"layers.{i}.attention.", f"model.layers.{i}."
        if kind == "full_attention":
            out[ours + "wg.weight"] = hf + "self_attn.q_proj.weight"
        else:
            out |= {ours + o: hf + "linear_attn." + h for o, h in LINEAR.items()}
            out |= {ours + o: hf + "linear_attn." + h for o, (h, _) in SPLIT.items()}
    return out


def hf_sources(args: QwenHybridArgs) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the Hugging Face tensor(s) it is made from (the multi-token prediction block's as
    mtp.layers.J: _renamed)."""
    return _renamed(args, _decoder_sources(with_mtp_blocks(args)))


def _decoder_sources(args: QwenHybridArgs) -> dict[str, str | tuple[str, ...]]:
    if not isinstance(args, QwenHybridMoEArgs):
        return _shared(args, llama.hf_names(args))
    sources = _shared(args, naming().hf_sources(args))
    for i in range(args.n_layers):
        if args.moe.is_sparse(i):
            ours, hf = f"layers.{i}.feed_forward.", f"model.layers.{i}.mlp."
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                sources[f"{ours}shared_expert.{w}.weight"] = f"{hf}shared_expert.{proj}.weight"
            sources[ours + "shared_gate.weight"] = hf + "shared_expert_gate.weight"
    return sources


def hf_keys(args: QwenHybridArgs, keys: list[str]) -> dict[str, str]:
    """A folder's tensor names as the text model's: the multimodal folders' model.language_model.* as model.*."""
    return {("model." + k[len(TEXT_PREFIX) :] if k.startswith(TEXT_PREFIX) else k): k for k in keys}


def hf_carried(args: QwenHybridArgs, keys: list[str]) -> list[str]:
    """The folder's vision tower (model.visual.*) and, where the model has none (mtp_layers 0), its multi-token-
    prediction layers (mtp.*): not the text model's, carried unchanged into an export
    (titanlite/components/hf_weights.py)."""
    carried = CARRIED_PREFIXES if not args.mtp_layers else tuple(p for p in CARRIED_PREFIXES if p != "mtp.")
    return [k for k in keys if k.startswith(carried)]


def hf_carried_shapes(args: QwenHybridArgs, carried: list[str], shapes: dict) -> dict[str, tuple[int, ...]]:
    """What the multi-token-prediction tensors (mtp.*) must be to belong to this model: each mtp.layers.J's block as
    the last full-attention layer's, the norms of the hidden state and the next token's embedding and the final one
    ([dim]), their projection (mtp.fc: [dim, 2 dim]). The vision tower is carried unchecked (its own vision_config
    describes it)."""
    dim = args.dim
    own: dict[str, tuple[int, ...]] = {
        f"mtp.{n}.weight": (dim,) for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden")
    }
    own["mtp.fc.weight"] = (dim, 2 * dim)
    full = [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"]

    def within_layer(name: str) -> str | None:
        parts = name.split(".", 3)
        return parts[3] if name.startswith("mtp.layers.") and len(parts) == 4 else None

    like = f"model.layers.{full[-1]}." if full else "model.layers.-1."
    return llama.carried_layer_shapes(carried, shapes, within_layer, like, own)


def hf_folder(args: QwenHybridArgs, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export in the layout of the folder it started from: a multimodal one (model_type qwen3_5 / qwen3_5_moe)
    gets its own config.json back with the trained text model's fields in text_config, and the text tensors under
    model.language_model.* (lm_head.weight where it was); a text model's folder, the export as it is."""
    if source.get("model_type") not in MULTIMODAL:
        return config, tensors
    text = dict(source.get("text_config") or {})
    skip = ("architectures", "model_type", "dtype", "torch_dtype")
    text |= {k: v for k, v in config.items() if k not in skip}
    out = {**source, "text_config": text}
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        out[key] = config[key]
    renamed = {(TEXT_PREFIX + k[len("model.") :] if k.startswith("model.") else k): v for k, v in tensors.items()}
    return out, renamed


def _rotary_rows(args: QwenHybridArgs, w: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """The rotating rows (the leading rotary_dim of each head) of a q/k tensor [heads * head_dim, ...] or a per-head
    norm weight [head_dim] (heads 1) reordered between our adjacent pairs and Hugging Face's halves."""
    return llama.rotary_rows(w, heads, args.rotary_dim, to_hf).contiguous()


def _rope_heads(args: QwenHybridArgs, ours: str) -> int | None:
    kind = ours.rsplit(".", 2)[-2]
    if kind in ("wq", "wk") and ".attention." in ours:
        layer = int(ours.split(".")[1])
        if args.layer_types[layer] == "full_attention":
            return args.n_heads if kind == "wq" else args.n_kv_heads
    if kind in ("q_norm", "k_norm"):
        return 1
    return None


def _widths(args: QwenHybridArgs) -> list[int]:
    key = args.linear_key_heads * args.linear_key_dim
    return [key, key, args.linear_value_heads * args.linear_value_dim]


def from_hf_tensor(args: QwenHybridArgs, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our parameter `name`'s full value from its Hugging Face tensor(s) (hf_sources[name])."""
    args = with_mtp_blocks(args)
    if isinstance(hf, list):  # a stacked expert tensor
        return torch.stack(hf).contiguous()
    leaf = name.split(".attention.")[-1]
    layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
    if layer >= 0 and args.layer_types[layer] == "linear_attention" and leaf in SPLIT:
        part = hf.split(_widths(args), dim=0)[SPLIT[leaf][1]]
        return (part.squeeze(1) if leaf.startswith("conv_") else part).contiguous()
    if leaf in ("wq.weight", "wg.weight") and layer >= 0 and args.layer_types[layer] == "full_attention":
        query, gate = hf.view(args.n_heads, 2, args.head_dim, -1).unbind(1)
        if leaf == "wg.weight":
            return gate.reshape(args.n_heads * args.head_dim, -1).contiguous()
        return _rotary_rows(args, query.reshape(args.n_heads * args.head_dim, -1), args.n_heads, to_hf=False)
    heads = _rope_heads(args, name)
    return hf.contiguous() if heads is None else _rotary_rows(args, hf, heads, to_hf=False)


def to_hf(args: QwenHybridArgs, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> the text model's Hugging Face names and layouts (lm_head.weight always present); the multi-
    token prediction block's under mtp.layers.J, its norms and projection under mtp.*."""
    out = {mtp_name(args, hf): t for hf, t in _decoder_to_hf(with_mtp_blocks(args), take).items()}
    for i in range(args.n_layers, args.n_layers + args.mtp_layers):
        out |= {f"mtp.{h}.weight": take(f"mtp.{i}.{o}.weight") for o, h in MTP_OWN.items()}
    return out


def _decoder_to_hf(args: QwenHybridArgs, take) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for ours, hf in _decoder_sources(args).items():
        if not isinstance(hf, str) or hf in out:
            continue
        leaf = ours.split(".attention.")[-1]
        layer = int(ours.split(".")[1]) if ours.startswith("layers.") else -1
        prefix = ours[: -len(leaf)]
        if layer >= 0 and args.layer_types[layer] == "linear_attention" and leaf in SPLIT:
            names = [o for o, (h, _) in SPLIT.items() if h == SPLIT[leaf][0]]
            parts = [take(prefix + o) for o in names]
            out[hf] = torch.cat([p.unsqueeze(1) if o.startswith("conv_") else p for o, p in zip(names, parts)])
        elif leaf in ("wq.weight", "wg.weight") and layer >= 0 and args.layer_types[layer] == "full_attention":
            query = _rotary_rows(args, take(prefix + "wq.weight"), args.n_heads, to_hf=True)
            gate = take(prefix + "wg.weight")
            shape = (args.n_heads, args.head_dim, -1)
            out[hf] = torch.stack([query.view(shape), gate.view(shape)], dim=1).reshape(-1, query.shape[-1])
        else:
            heads = _rope_heads(args, ours)
            out[hf] = take(ours) if heads is None else _rotary_rows(args, take(ours), heads, to_hf=True)
    if isinstance(args, QwenHybridMoEArgs):  # the experts, stacked in ours, one tensor per expert in Hugging Face's
        for i in range(args.n_layers):
            if args.moe.is_sparse(i):
                ours = f"layers.{i}.feed_forward."
                tensors = ("router.gate.weight", "experts.w1", "experts.w3", "experts.w2")
                moe = moe_to_hf({name: take(ours + name) for name in tensors})
                out |= {f"model.layers.{i}.mlp.{name}": t for name, t in moe.items()}
    return out
