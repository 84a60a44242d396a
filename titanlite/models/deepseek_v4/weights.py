"""DeepSeek-V4's weights under the names its folders use (transformers 5 writes DeepSeek's own below each layer: attn,
ffn, wq_a, attn_sink, compressor.ape, hc_attn_fn, ...; the published checkpoints name the top level without
transformers' "model." prefix, which hf_keys reads too): ours -> theirs one for one, but the routed experts, stacked
here (experts.w1/w3/w2 [E, ...]) and one tensor per expert there (ffn.experts.E.w1.weight). The hash-routed layers'
token tables (ffn.gate.tid2eid) and the other layers' routing biases (ffn.gate.bias) are buffers the folder holds.
The multi-token prediction layers are mtp.K. in both (the published folders'; transformers builds none and leaves
them out of its saves): the block's tensors named as a layer's, and the depth's own enorm, hnorm, e_proj, h_proj,
norm and hyper-head (hc_head_fn, hc_head_base, hc_head_scale)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from titanlite.models.common.moe.layer import check_hash_table
from titanlite.models.deepseek_v4.args import CSA, SLIDING, DeepseekV4Args

_ATTENTION = {  # ours (under layers.N.attention.) -> theirs (under model.layers.N.attn.)
    "wq_a.weight": "wq_a.weight",
    "q_norm.weight": "q_norm.weight",
    "wq_b.weight": "wq_b.weight",
    "wkv.weight": "wkv.weight",
    "kv_norm.weight": "norm.weight",
    "wo_a.weight": "wo_a.weight",
    "wo_b.weight": "wo_b.weight",
    "sinks": "attn_sink",
}
_COMPRESSOR = {"wkv.weight": "wkv.weight", "wgate.weight": "wgate.weight", "norm.weight": "norm.weight",
               "position_bias": "ape"}  # fmt: skip
_EXPERTS = ("w1", "w3", "w2")


def blocks(args: DeepseekV4Args) -> list[tuple[int, str]]:
    """Each block's layer number and the folder's prefix of its tensors: the decoder's (model.layers.N.), then the
    multi-token prediction depths' (mtp.K., layer n_layers + K)."""
    decoder = [(i, f"model.layers.{i}.") for i in range(args.n_layers)]
    return decoder + [(args.n_layers + k, f"mtp.{k}.") for k in range(args.mtp_layers)]


def hf_names(args: DeepseekV4Args) -> dict[str, str]:
    """Our parameter or buffer name -> the folder's tensor, for every tensor but the stacked experts."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "output.weight": "head.weight",
        "norm.weight": "model.norm.weight",
        **{f"streams.{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")},
    }
    for i, hf in blocks(args):
        names |= _block_names(args, i, hf)
    for k in range(args.mtp_layers):
        ours, hf = f"mtp.{args.n_layers + k}.", f"mtp.{k}."
        names |= {f"{ours}{n}.weight": f"{hf}{n}.weight" for n in ("enorm", "hnorm", "e_proj", "h_proj", "norm")}
        names |= {f"{ours}streams.{p}": f"{hf}hc_head_{p}" for p in ("fn", "base", "scale")}
    return names


def _block_names(args: DeepseekV4Args, i: int, hf: str) -> dict[str, str]:
    """Block `i`'s tensors (the folder's under `hf`), but its stacked experts."""
    ours = f"layers.{i}."
    names = {ours + "attention_norm.weight": hf + "attn_norm.weight", ours + "ffn_norm.weight": hf + "ffn_norm.weight"}
    for p in ("fn", "base", "scale"):
        names[f"{ours}attention_hc.{p}"] = f"{hf}hc_attn_{p}"
        names[f"{ours}ffn_hc.{p}"] = f"{hf}hc_ffn_{p}"
    names |= {f"{ours}attention.{a}": f"{hf}attn.{b}" for a, b in _ATTENTION.items()}
    kind = args.kind(i)
    if kind != SLIDING:
        names |= {f"{ours}attention.compressor.{a}": f"{hf}attn.compressor.{b}" for a, b in _COMPRESSOR.items()}
    if kind == CSA:
        for a in ("wq_b.weight", "weights_proj.weight"):
            names[f"{ours}attention.indexer.{a}"] = f"{hf}attn.indexer.{a}"
        names |= {
            f"{ours}attention.indexer.compressor.{a}": f"{hf}attn.indexer.compressor.{b}"
            for a, b in _COMPRESSOR.items()
        }
    ffn, theirs = ours + "feed_forward.", hf + "ffn."
    names[ffn + "router.gate.weight"] = theirs + "gate.weight"
    if i in args.moe.hash_layers:
        names[ffn + "router.tid2eid"] = theirs + "gate.tid2eid"
    else:  # the model holds it where it balances by it ([moe] balance "bias"); a folder always does
        names[ffn + "router.expert_bias"] = theirs + "gate.bias"
    for w in _EXPERTS:
        names[f"{ffn}shared_expert.{w}.weight"] = f"{theirs}shared_experts.{w}.weight"
    return names


def hf_tables(args: DeepseekV4Args) -> dict[str, Callable[[torch.Tensor], str | None]]:
    """The hash-routed layers' token tables (ffn.gate.tid2eid), integer tensors each checked to name top_k experts
    of the block's for every token id (moe/layer.py check_hash_table)."""
    moe = args.moe

    def check(table: torch.Tensor) -> str | None:
        if table.is_floating_point() and bool((table == table.round()).all()):
            table = table.long()  # whole numbers stored as floats (a checkpoint's own choice) read exactly
        problem = check_hash_table(table, moe.n_experts, moe.top_k)
        if problem is None and table.shape[0] != args.vocab_size:
            problem = f"tid2eid has {table.shape[0]} rows; the model's vocab_size is {args.vocab_size}"
        return problem

    return {f"model.layers.{i}.ffn.gate.tid2eid": check for i in moe.hash_layers}


def hf_carried(args: DeepseekV4Args, keys: list[str]) -> list[str]:
    """A folder's multi-token prediction layers past this model's (mtp.K. with K >= mtp_layers: all of them with
    model.mtp_layers = 0): not trained, carried unchanged into an export (titanlite/components/hf_weights.py says so
    when it loads)."""
    depths = [(k, re.match(r"mtp\.(\d+)\.", k)) for k in keys]
    return [k for k, depth in depths if depth is not None and int(depth.group(1)) >= args.mtp_layers]


def hf_folder(args: DeepseekV4Args, config: dict, tensors: dict, source: dict) -> tuple[dict, dict]:
    """An export that carries the folder's multi-token prediction layers says it has them, as the folder did."""
    if source.get("num_nextn_predict_layers", 0) > args.mtp_layers:
        config = {**config, "num_nextn_predict_layers": source["num_nextn_predict_layers"]}
    return config, tensors


# The published checkpoints' top-level names (DeepSeek's, no "model." prefix) -> those transformers writes.
_PUBLISHED = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    **{f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")},
}


def hf_keys(args: DeepseekV4Args, keys: list[str]) -> dict[str, str]:
    """Our view of a folder's tensor names (transformers' save: model.layers.N..., model.embed_tokens.weight,
    head.weight) -> the stored ones, which may be the published checkpoints' own (layers.N..., embed.weight,
    hc_head_fn, norm.weight); below each layer the names are the same in both."""
    view = {}
    for key in keys:
        if key in _PUBLISHED:
            view[_PUBLISHED[key]] = key
        elif key.startswith("layers."):
            view["model." + key] = key
        elif key.startswith("model.mtp."):  # the multi-token prediction layers as mtp.K. in every view
            view[key.removeprefix("model.")] = key
        else:
            view[key] = key
    return view


def hf_sources(args: DeepseekV4Args) -> dict[str, str | tuple[str, ...]]:
    """hf_names, and each stacked expert tensor -> its experts' tensors in expert order."""
    sources: dict[str, str | tuple[str, ...]] = dict(hf_names(args))
    for i, hf in blocks(args):
        for w in _EXPERTS:
            sources[f"layers.{i}.feed_forward.experts.{w}"] = tuple(
                f"{hf}ffn.experts.{e}.{w}.weight" for e in range(args.moe.n_experts)
            )
    return sources


def from_hf_tensor(args: DeepseekV4Args, name: str, hf: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Our tensor `name` from its folder tensor, or a stacked expert tensor from its experts' (in order); the routing
    bias in float32, a token table in int64."""
    if isinstance(hf, list):
        return torch.stack(hf).contiguous()
    if name.endswith("router.tid2eid"):
        return hf.long()
    return hf.float() if name.endswith("router.expert_bias") else hf


def to_hf(args: DeepseekV4Args, sd: dict[str, torch.Tensor], take) -> dict[str, torch.Tensor]:
    """Our state dict -> the folder's names (head.weight always present); `take(name)` reads sd. A block balanced
    otherwise ([moe] balance) writes a routing bias of zeros, as transformers' blocks always hold one."""
    out = {}
    for ours, hf in hf_names(args).items():
        if ours.endswith("router.expert_bias") and ours not in sd:
            out[hf] = torch.zeros(args.moe.n_experts)
        else:
            out[hf] = take(ours)
    for i, hf in blocks(args):
        for w in _EXPERTS:
            for e, t in enumerate(take(f"layers.{i}.feed_forward.experts.{w}").unbind(0)):
                out[f"{hf}ffn.experts.{e}.{w}.weight"] = t
    return out
