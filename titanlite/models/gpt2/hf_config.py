"""GPT-2's config.json (GPT2LMHeadModel) both ways, torch-free."""

from __future__ import annotations

from titanlite.base.hf_config import COUNT, FLAG, NONNEGATIVE, TEXT, FieldTypes, refuse
from titanlite.models.gpt2.args import GPT2Args

# The config.json fields GPT-2 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): its own names.
FIELDS: FieldTypes = {
    "n_embd": (COUNT, False),
    "n_layer": (COUNT, False),
    "n_head": (COUNT, False),
    "n_inner": (COUNT, True),
    "n_positions": (COUNT, False),
    "layer_norm_epsilon": (NONNEGATIVE, False),
    "activation_function": (TEXT, False),
    "scale_attn_weights": (FLAG, False),
    "scale_attn_by_inverse_layer_idx": (FLAG, False),
    "add_cross_attention": (FLAG, False),
}

# HF activation names that are our GPT-2 MLP's GELUs ("gelu_fast" is the tanh formula written differently).
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def read(config: dict, where: str) -> GPT2Args:
    dim, n_heads = config["n_embd"], config["n_head"]
    activation = config.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise refuse(where, "activation_function", activation, f"the MLP's GELU is one of {', '.join(_ACTIVATIONS)}")
    if config.get("scale_attn_by_inverse_layer_idx"):
        raise refuse(where, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if config.get("scale_attn_weights", True) is not True:
        raise refuse(where, "scale_attn_weights", config["scale_attn_weights"], "attention scales by 1/sqrt(head_dim)")
    if config.get("add_cross_attention"):
        raise refuse(where, "add_cross_attention", True, "titanlite's GPT-2 is a decoder without cross-attention")
    if dim % n_heads:
        raise refuse(where, "n_head", n_heads, f"it must divide n_embd={dim}")
    return GPT2Args(
        dim=dim,
        n_layers=config["n_layer"],
        n_heads=n_heads,
        vocab_size=config["vocab_size"],
        max_seq_len=config.get("n_positions", 1024),
        norm_eps=config.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", True),
        ffn_dim=config.get("n_inner") or 4 * dim,
        activation=_ACTIVATIONS[activation],
    )


def write(args: GPT2Args) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": args.dim,
        "n_layer": args.n_layers,
        "n_head": args.n_heads,
        "n_inner": args.ffn_dim,
        "n_positions": args.max_seq_len,
        "layer_norm_epsilon": args.norm_eps,
        "activation_function": _ACTIVATION_TO_HF[args.activation],
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def tokenizer(args: GPT2Args) -> str | None:
    """GPT-2's own vocabulary (folders with vocab.json/merges.txt only) is the shipped GPT-2 tokenizer's."""
    return "gpt2" if args.vocab_size in (50257, 50304) else None
