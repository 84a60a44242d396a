"""The Llama decoder's weights under Hugging Face's names (every decoder family names its tensors as Llama
does), and the RoPE row order: ours rotates adjacent pairs, Hugging Face's halves of each head's rotating channels
(all of them, or the leading rotary_dim with partial rotary: rotary_rows)."""

from __future__ import annotations

import re

import torch

from titanlite.models.common.decoder_args import DecoderArgs, rotary_dim_of


def hf_names(args: DecoderArgs) -> dict[str, str]:
    """Our parameter name -> the HF name in the family's ForCausalLM (output.weight included even when tied).
    Post-norm blocks store their norms as post_attention_layernorm and post_feedforward_layernorm (where a
    pre-norm block's post_attention_layernorm is the pre-FFN norm)."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if args.norm_position == "pre":
        norms = ("input_layernorm", "post_attention_layernorm")
    else:
        norms = ("post_attention_layernorm", "post_feedforward_layernorm")
    projections = [
        ("wq", "q_proj", args.qkv_bias),
        ("wk", "k_proj", args.qkv_bias),
        ("wv", "v_proj", args.qkv_bias),
        ("wo", "o_proj", args.out_bias),
    ]
    mlp = [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")]
    for i in range(args.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = f"{hf}{norms[0]}.weight"
        names[ours + "ffn_norm.weight"] = f"{hf}{norms[1]}.weight"
        for w, proj, bias in projections:
            for leaf in ("weight", "bias") if bias else ("weight",):
                names[f"{ours}attention.{w}.{leaf}"] = f"{hf}self_attn.{proj}.{leaf}"
        if args.qk_norm != "none":
            for norm in ("q_norm", "k_norm"):
                names[f"{ours}attention.{norm}.weight"] = f"{hf}self_attn.{norm}.weight"
        for w, proj in mlp:
            for leaf in ("weight", "bias") if args.mlp_bias else ("weight",):
                names[f"{ours}feed_forward.{w}.{leaf}"] = f"{hf}mlp.{proj}.{leaf}"
    return names


def hf_keys(args: DecoderArgs, keys: list[str]) -> dict[str, str]:
    return {k: k for k in keys}


def hf_sources(args: DecoderArgs) -> dict[str, str]:
    return hf_names(args)


def rope_heads(args: DecoderArgs, name: str) -> int | None:
    """How many heads a q/k tensor's rows hold, for the RoPE reordering between our layout and HF's (None: not
    a tensor RoPE reads): the projections' weights and biases, and the Q/K norms' weights, per head or whole."""
    kind = name.rsplit(".", 2)[-2]
    if kind in ("wq", "wk"):
        return args.n_heads if kind == "wq" else args.n_kv_heads
    if kind in ("q_norm", "k_norm"):
        return 1 if args.qk_norm == "head" else (args.n_heads if kind == "q_norm" else args.n_kv_heads)
    return None


def rope_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows of a q/k projection (its weight [out, in], or a bias or norm weight [out]) from
    adjacent RoPE pairs (2i, 2i+1) to halves (i, i+hd/2).

    HF row a*hd/2 + i of a head is our row 2i + a, so HF's rotate_half rotates the same pairs by the same
    angles; q and k get the same reordering, so their dot products, and the logits, do not change."""
    rows = w.view(w.shape[0], -1)
    hd = rows.shape[0] // n_heads
    return rows.view(n_heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def rope_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of rope_to_hf: halves (i, i+hd/2) back to adjacent pairs (2i, 2i+1)."""
    rows = w.view(w.shape[0], -1)
    hd = rows.shape[0] // n_heads
    return rows.view(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)


def rotary_rows(w: torch.Tensor, heads: int, rotary_dim: int, to_hf: bool) -> torch.Tensor:
    """Reorder the rotating rows of a q/k tensor whose rows are `heads` heads (a projection's weight [out, in] or
    bias [out], a whole-projection Q/K norm's weight, or a per-head one's [head_dim] with heads 1) between our
    adjacent pairs and Hugging Face's halves (to_hf: ours -> theirs, rope_to_hf; else back, rope_from_hf): the
    leading rotary_dim rows of each head (partial rotary), the rest kept in place; every row where rotary_dim is
    the whole head (or 0)."""
    reorder = rope_to_hf if to_hf else rope_from_hf
    head_dim = w.shape[0] // heads
    if not rotary_dim or rotary_dim == head_dim:
        return reorder(w, heads)
    rows = w.reshape(heads, head_dim, -1)
    turned = reorder(rows[:, :rotary_dim].reshape(heads * rotary_dim, -1), heads).reshape(heads, rotary_dim, -1)
    return torch.cat([turned, rows[:, rotary_dim:]], dim=1).reshape(w.shape)


def rotary_dim_at(args: DecoderArgs, name: str) -> int:
    """The rotated channels of each head in the layer that parameter `name` ("layers.N. ...") belongs to
    (rotary_dim_of); args.rotary_dim for a name outside the layers."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return rotary_dim_of(args, int(parts[1]))
    return getattr(args, "rotary_dim", 0) or args.head_dim


def to_hf_tensor(args: DecoderArgs, name: str, ours: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s value `ours` in HF's layout: a q/k tensor's rotating rows reordered (rope_heads,
    rotary_rows), any other as it is."""
    heads = rope_heads(args, name)
    return ours if heads is None else rotary_rows(ours, heads, rotary_dim_at(args, name), to_hf=True)


def to_hf(args: DecoderArgs, sd: dict[str, torch.Tensor], take, names: dict[str, str] | None = None):
    """Our state dict -> HF names and layouts (lm_head.weight always present); `take(name)` reads sd. `names`: a
    family's own name map on this decoder's tensors (default: hf_names)."""
    return {
        hf: to_hf_tensor(args, ours, take(ours)) for ours, hf in (hf_names(args) if names is None else names).items()
    }


def from_hf_tensor(args: DecoderArgs, name: str, hf: torch.Tensor) -> torch.Tensor:
    """Our parameter `name`'s full value from its HF tensor (hf_sources[name]): a q/k tensor's rotating rows
    reordered back (rotary_rows), any other as it is."""
    heads = rope_heads(args, name)
    return hf if heads is None else rotary_rows(hf, heads, rotary_dim_at(args, name), to_hf=False).contiguous()


def carried_layer_shapes(
    carried: list[str],
    shapes: dict[str, tuple[int, ...]],
    within_layer,
    like: str,
    own: dict[str, tuple[int, ...]],
) -> dict[str, tuple[int, ...]]:
    """The shapes a folder's carried multi-token-prediction tensors must have to belong to this model: one named as a
    decoder layer's tensor (`within_layer(name)`: its name within the layer, or None) has that tensor's shape in the
    decoder layer whose names begin with `like` (`shapes`: the model's tensors' shapes, Hugging Face names); one of
    the `own` names (the prediction layer's projections and norms, full names) has the shape given there. Others
    (a tensor not of a decoder layer, or one the layer `like` lacks) are carried unchecked."""
    expected: dict[str, tuple[int, ...]] = {}
    for name in carried:
        if name in own:
            expected[name] = own[name]
            continue
        rest = within_layer(name)
        if rest is not None and like + rest in shapes:
            expected[name] = shapes[like + rest]
    return expected


def mtp_names(args) -> dict[str, str]:
    """Multi-token prediction's own tensors (models/common/multi_token.py: mtp.{L}.*, L = n_layers + k - 1 for depth k)
    under the names DeepSeek-V3 and GLM-4.5 store them with, beside the block as further decoder layers
    (model.layers.{L}.*): enorm, hnorm, eh_proj, and shared_head.norm (our mtp.{L}.norm)."""
    names: dict[str, str] = {}
    for i in range(args.n_layers, args.n_layers + getattr(args, "mtp_layers", 0)):
        ours, hf = f"mtp.{i}.", f"model.layers.{i}."
        names |= {f"{ours}{n}.weight": f"{hf}{n}.weight" for n in ("enorm", "hnorm", "eh_proj")}
        names[ours + "norm.weight"] = hf + "shared_head.norm.weight"
    return names


def mtp_copies(args) -> dict[str, str]:
    """Each multi-token prediction layer's copies of the embedding and the head, as DeepSeek-V3 and GLM-4.5 store them
    (HF name -> the shared tensor's HF name): not read into the model, which shares its own, but checked equal to them
    on import and written on export (titanlite/components/hf_weights.py hf_copies)."""
    copies: dict[str, str] = {}
    for i in range(args.n_layers, args.n_layers + getattr(args, "mtp_layers", 0)):
        copies[f"model.layers.{i}.embed_tokens.weight"] = "model.embed_tokens.weight"
        copies[f"model.layers.{i}.shared_head.head.weight"] = "lm_head.weight"
    return copies


def mtp_family_keys(args, keys: list[str]) -> dict[str, str]:
    """hf_keys of a family with multi-token prediction layers and routing biases (DeepSeek-V3, GLM-4.5): the folder's
    tensors the model reads: not a correction bias when this model balances otherwise, not the prediction layers'
    copies of the embedding and head (mtp_copies; layers it does not have are carried: hf_carried)."""
    copies = mtp_copies(args)
    return {
        k: k
        for k in keys
        if (args.moe.balance == "bias" or not k.endswith(".e_score_correction_bias")) and k not in copies
    }


def layers_past(n_layers: int, keys: list[str]) -> list[str]:
    """The tensors of layers past the decoder's `n_layers` (model.layers.N, N >= n_layers): DeepSeek-V3's and GLM's
    multi-token-prediction layers, stored as further layers."""
    past = [(k, re.match(r"model\.layers\.(\d+)\.", k)) for k in keys]
    return [k for k, layer in past if layer is not None and int(layer.group(1)) >= n_layers]


def next_token_layer_shapes(args, carried: list[str], shapes: dict) -> dict[str, tuple[int, ...]]:
    """What the tensors of multi-token-prediction layers stored as further layers (layers_past) must be to belong to
    the model `args`: their block's as the last decoder layer's, and each layer's own norms of the hidden state and of
    the next token's embedding (enorm, hnorm: [dim]), their projection (eh_proj: [dim, 2 dim]) and its head
    (shared_head.norm, and shared_head.head and embed_tokens where a folder stores them)."""
    dim, vocab = args.dim, args.vocab_size
    own: dict[str, tuple[int, ...]] = {}
    for prefix in {m.group(1) for m in (re.match(r"(model\.layers\.\d+\.)", k) for k in carried) if m}:
        own |= {prefix + n: (dim,) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
        own |= {prefix + "eh_proj.weight": (dim, 2 * dim)}
        own |= {prefix + n: (vocab, dim) for n in ("shared_head.head.weight", "embed_tokens.weight")}

    def within_layer(name: str) -> str | None:
        layer = re.match(r"model\.layers\.\d+\.(.+)", name)
        return layer.group(1) if layer else None

    return carried_layer_shapes(carried, shapes, within_layer, f"model.layers.{args.n_layers - 1}.", own)
