"""config.json of the families the Llama decoder builds (Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM3, OLMo2), both
ways: each family's fields read into LlamaArgs' switches (honoured, or refused with one line naming the field),
and written back under the family's own model_type, architecture and field names, so that transformers loads
an export as the class it came from. Torch-free, like titanlite/base/hf_config.py, which dispatches to it.
"""

from __future__ import annotations

import dataclasses

from titanlite.base.errors import ConfigError
from titanlite.base.model_args import DECODER_FAMILIES, Llama3RopeScaling, LlamaArgs

# model_type -> our family (model.name), and each family's architecture class in transformers.
FAMILY_OF_TYPE = {model_type: family for family, model_type in DECODER_FAMILIES.items()}
ARCHITECTURES = {
    "llama3": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


def refuse(where: str, key: str, value, why: str) -> ConfigError:
    return ConfigError(f"{where} {key}={value!r} is not supported: {why}")


# ---- reading ------------------------------------------------------------------------------------------


def decoder_args(config: dict, where: str) -> LlamaArgs:
    """LlamaArgs of a config.json whose model_type is one of DECODER_FAMILIES."""
    family = FAMILY_OF_TYPE[config["model_type"]]
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(where, "hidden_act", config["hidden_act"], "the MLP is SwiGLU (silu)")
    if n_heads % n_kv_heads:
        raise refuse(where, "num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads={n_heads}")
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim % 2:
        raise refuse(where, "head_dim", head_dim, "RoPE rotates pairs, so it must be even")
    rope_theta, rope_scaling = rope_settings(config, where)
    n_layers = config["num_hidden_layers"]
    window = sliding_window(config, family, where)
    max_seq_len = config.get("max_position_embeddings", 2048)
    return LlamaArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        # A sliding window no shorter than the context is full causal attention: the context stops there.
        max_seq_len=min(max_seq_len, window) if window else max_seq_len,
        rope_theta=rope_theta,
        norm_eps=config.get("rms_norm_eps", 1e-6),  # the configs' defaults where a key is absent
        tie_embeddings=config.get("tie_word_embeddings", False),
        head_dim=head_dim,
        rope_scaling=rope_scaling,
        sliding_window=window,
        **family_switches(config, family, n_layers, where),
    )


def family_switches(config: dict, family: str, n_layers: int, where: str) -> dict:
    """The LlamaArgs switches a family's config.json sets (see each field's docstring in base/model_args.py)."""
    bias = bool(config.get("attention_bias"))
    switches = {"family": family, "qkv_bias": bias, "out_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}
    if family == "qwen2":  # biases on q, k and v only, whatever the config says (Qwen2Attention hard-codes them)
        switches |= {"qkv_bias": True, "out_bias": False}
    elif family == "qwen3":
        switches["qk_norm"] = "head"
    elif family == "olmo2":
        switches |= {"qk_norm": "full", "norm_position": "post"}
    elif family == "smollm3":
        switches["nope_layers"] = smollm3_nope_layers(config, n_layers, where)
    if family in ("mistral", "qwen2", "qwen3", "olmo2") and config.get("mlp_bias"):
        raise refuse(where, "mlp_bias", True, f"{family}'s MLP has no biases")
    return switches


def smollm3_nope_layers(config: dict, n_layers: int, where: str) -> tuple[int, ...]:
    """Layers without RoPE: no_rope_layers holds 1 (RoPE) or 0 (none) per layer, else every
    no_rope_layer_interval-th layer has none."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)
    if len(flags) != n_layers:
        raise refuse(where, "no_rope_layers", f"[{len(flags)} entries]", f"it needs one per layer ({n_layers})")
    return tuple(i for i, use in enumerate(flags) if not use)


def sliding_window(config: dict, family: str, where: str) -> int:
    """The window of a family whose layers (some or all) attend to the last `sliding_window` positions only, or 0.
    titanlite computes full causal attention, which is the same while the context is no longer than the window:
    the model's context is then cut to the window (and a longer training.seq_len refused, naming the field)."""
    window = config.get("sliding_window") or 0
    layer_types = config.get("layer_types") or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise refuse(where, "layer_types", other, "layers have full or sliding causal attention")
    if family == "mistral":
        return window
    if family in ("qwen2", "qwen3", "smollm3"):
        used = config.get("use_sliding_window", False) and (not layer_types or "sliding_attention" in layer_types)
        return window if used else 0
    if "sliding_attention" in layer_types:
        raise refuse(where, "layer_types", sorted(set(layer_types)), f"{family} has full causal attention")
    if window:
        raise refuse(where, "sliding_window", window, f"{family} has full causal attention")
    return 0


def rope_settings(config: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """rope_theta and the llama3 frequency scaling, from transformers 5's rope_parameters or 4.x's top-level
    rope_theta and rope_scaling; other RoPE types (linear, dynamic, yarn, longrope) are refused."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    if rope_type != "llama3":
        raise ConfigError(
            f"{where} {key} rope_type={rope_type!r} is not supported: titanlite implements "
            "unscaled RoPE and Llama 3.1's 'llama3' scaling"
        )
    fields = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
    absent = [f for f in fields if rope.get(f) is None]
    if absent:
        raise ConfigError(f"{where} {key} of rope_type 'llama3' lacks {absent[0]!r}")
    scaling = Llama3RopeScaling(**{f: rope[f] for f in fields})
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"{where} {key} needs high_freq_factor > low_freq_factor, not {scaling.high_freq_factor} "
            f"and {scaling.low_freq_factor}"
        )
    return theta, scaling


# ---- writing ------------------------------------------------------------------------------------------


def decoder_config(args: LlamaArgs) -> dict:
    """The config.json fields of a decoder model, in its family's own names (refused, naming the switch, where
    the family's config cannot express it)."""
    family = args.family
    check_expressible(args)
    config = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": DECODER_FAMILIES[family],
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and rope_scaling.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_theta": args.rope_theta, **rope_scaling_to_hf(args.rope_scaling)},
        "rope_scaling": rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
        "attention_dropout": 0.0,
    }
    if family != "qwen2":
        config["attention_bias"] = args.qkv_bias
    if family in ("llama3", "smollm3"):
        config["mlp_bias"] = args.mlp_bias
    if family == "llama3":
        config["pretraining_tp"] = 1
    if family == "mistral":
        config["sliding_window"] = args.sliding_window or None
    if family in ("qwen2", "qwen3", "smollm3"):
        # Within the exported context a window no shorter than it changes nothing: attention is full there.
        config |= {
            "use_sliding_window": False,
            "sliding_window": args.sliding_window or None,
            "layer_types": ["full_attention"] * args.n_layers,
        }
        if family != "smollm3":
            config["max_window_layers"] = args.n_layers
    if family == "smollm3":
        config["no_rope_layers"] = [int(i not in args.nope_layers) for i in range(args.n_layers)]
    return config


# What each family's config.json can say: (q/k/v bias, output bias, MLP bias, qk_norm, norm_position, NoPE).
_EXPRESSIBLE = {
    "llama3": ("same", "same", "any", "none", "pre", False),
    "mistral": (False, False, False, "none", "pre", False),
    "qwen2": (True, False, False, "none", "pre", False),
    "qwen3": ("same", "same", False, "head", "pre", False),
    "smollm3": ("same", "same", "any", "none", "pre", True),
    "olmo2": ("same", "same", False, "full", "post", False),
}


def check_expressible(args: LlamaArgs) -> None:
    qkv, out, mlp, qk_norm, position, nope = _EXPRESSIBLE[args.family]
    problems = []
    if qkv == "same" and args.qkv_bias != args.out_bias:
        problems.append(f"qkv_bias={args.qkv_bias} with out_bias={args.out_bias} (one attention_bias)")
    for name, want in (("qkv_bias", qkv), ("out_bias", out), ("mlp_bias", mlp)):
        if isinstance(want, bool) and getattr(args, name) != want:
            problems.append(f"{name}={getattr(args, name)}")
    if args.qk_norm != qk_norm:
        problems.append(f"qk_norm={args.qk_norm!r}")
    if args.norm_position != position:
        problems.append(f"norm_position={args.norm_position!r}")
    if args.nope_layers and not nope:
        problems.append(f"nope_layers={list(args.nope_layers)}")
    if problems:
        raise ConfigError(
            f"a {args.family} config.json cannot express {', '.join(problems)}; this model has no "
            "Hugging Face family to be exported as"
        )


def rope_scaling_to_hf(scaling: Llama3RopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}
