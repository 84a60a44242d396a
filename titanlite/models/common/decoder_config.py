"""config.json of a family built by the Llama decoder, both ways, torch-free: the fields every such family
shares, read into DecoderArgs and written back under the family's own model_type and architecture. What a
family adds (its switches, its window rule, its own fields) is a DecoderConfig its folder fills in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import refuse
from titanlite.models.common.decoder_args import LAYER_KINDS, DecoderArgs, TransformerArgs, window_of
from titanlite.models.common.rope_args import LayerRope, Llama3RopeScaling, YarnRopeScaling, yarn_from_hf, yarn_to_hf


class DecoderShape(TransformerArgs, Protocol):
    """What a config.json's opening fields read of a family's arguments: the decoder's contract and the key/value
    heads."""

    @property
    def n_kv_heads(self) -> int: ...


def decoder_fields(
    args: DecoderShape,
    architecture: str,
    model_type: str,
    activation: tuple[str, str] = ("hidden_act", "silu"),
    omit: tuple[str, ...] = (),
) -> dict:
    """The fields every decoder family's config.json opens with: its architecture and model_type, the sizes, the
    activation (`activation`: its key and value; Gemma's key is hidden_activation), rms_norm_eps and the context
    length. `omit`: those the family's config.json does not hold (latent attention's head_dim)."""
    key, value = activation
    fields = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        key: value,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
    }
    return {name: field for name, field in fields.items() if name not in omit}


class Expressible(NamedTuple):
    """What a family's config.json can say. True/False: the switch must be that; "same": q/k/v and output
    biases are one attention_bias; "any": either. qk_norm and norm_position: the only value it can hold."""

    qkv_bias: bool | str = "same"
    out_bias: bool | str = "same"
    mlp_bias: bool | str = "any"
    qk_norm: str = "none"
    norm_position: str = "pre"
    nope: bool = False
    partial_rotary: bool = False
    """Whether it can say rotary_dim below head_dim (a partial_rotary_factor the family's model honours)."""


def attention_biases(config: dict, n_layers: int, where: str) -> dict:
    """The switches every decoder config.json sets: attention_bias on q, k, v and o, mlp_bias on the MLP."""
    bias = bool(config.get("attention_bias"))
    return {"qkv_bias": bias, "out_bias": bias, "mlp_bias": bool(config.get("mlp_bias"))}


def no_mlp_bias(family: str, config: dict, where: str) -> None:
    if config.get("mlp_bias"):
        raise refuse(where, "mlp_bias", True, f"{family}'s MLP has no biases")


def attention_shape(config: dict, where: str) -> tuple[int, int, int, int]:
    """(hidden_size, heads, key/value heads, head_dim) of a decoder config.json, refusing what RoPE and
    grouped-query attention cannot take."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise refuse(where, "num_key_value_heads", n_kv_heads, f"it must divide num_attention_heads={n_heads}")
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim % 2:
        raise refuse(where, "head_dim", head_dim, "RoPE rotates pairs, so it must be even")
    return dim, n_heads, n_kv_heads, head_dim


def decoder_sizes(config: dict, where: str, max_seq_len: int, tie: bool = False) -> dict:
    """DecoderArgs' sizes of a decoder config.json (its heads as attention_shape reads them) with the family's config
    defaults where a key is absent: `max_seq_len` positions, rms_norm_eps 1e-6, tie_word_embeddings `tie`."""
    dim, n_heads, n_kv_heads, head_dim = attention_shape(config, where)
    return {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "ffn_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "max_seq_len": config.get("max_position_embeddings", max_seq_len),
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "tie_embeddings": config.get("tie_word_embeddings", tie),
    }


Window = tuple[int, tuple[str, ...]]  # (sliding_window, layer_types): (0, ()) for full attention everywhere


def full_attention(config: dict, where: str, family: str) -> Window:
    """The window rule of a family with full causal attention only: a sliding window is refused."""
    layer_types = layer_types_of(config, where)
    if "sliding_attention" in layer_types:
        raise refuse(where, "layer_types", sorted(set(layer_types)), f"{family} has full causal attention")
    if config.get("sliding_window"):
        raise refuse(where, "sliding_window", config["sliding_window"], f"{family} has full causal attention")
    return 0, ()


def window_always(config: dict, where: str, family: str) -> Window:
    """The window rule of a family whose every layer slides when sliding_window is set (Mistral, Mixtral and
    Qwen3-MoE with use_sliding_window: their attention reads sliding_window alone, whatever layer_types say)."""
    layer_types_of(config, where)
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        return 0, ()
    return config.get("sliding_window") or 0, ()


def window_if_used(max_window_layers: int | None = None) -> Callable[[dict, str, str], Window]:
    """The window rule of a family that slides only with use_sliding_window, on the layers layer_types names; without
    layer_types, on the layers from config.json's max_window_layers on, as transformers derives them. The family's
    `max_window_layers` stands in where config.json gives none (transformers' Qwen2 and Qwen3: 28); None: such a
    config is refused, its sliding layers unnamed."""

    def rule(config: dict, where: str, family: str) -> Window:
        layer_types = layer_types_of(config, where)
        window = config.get("sliding_window") or 0
        if not (config.get("use_sliding_window") and window):
            return 0, ()
        n_layers = config["num_hidden_layers"]
        if not layer_types:
            first = config.get("max_window_layers", max_window_layers)
            if first is None:
                raise refuse(where, "use_sliding_window", True, "without layer_types its sliding layers are not named")
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers:
            raise refuse(where, "layer_types", f"[{len(layer_types)} entries]", f"it needs one per layer ({n_layers})")
        if "sliding_attention" not in layer_types:
            return 0, ()
        return window, tuple(layer_types)

    return rule


def layer_types_of(config: dict, where: str) -> list[str]:
    layer_types = config.get("layer_types") or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise refuse(where, "layer_types", other, "layers have full or sliding causal attention")
    return layer_types


@dataclass(frozen=True)
class DecoderConfig:
    """One family's config.json on the Llama decoder. `switches(config, n_layers, where)`: the DecoderArgs switches
    its fields set; `window(config, where, family)`: its sliding window and layer types, or a refusal;
    `fields(args)`: the fields only it writes; `attention_bias_field`: whether it writes attention_bias."""

    family: str
    model_type: str
    architecture: str
    expressible: Expressible = Expressible()
    switches: Callable[[dict, int, str], dict] = attention_biases
    window: Callable[[dict, str, str], Window] = full_attention
    fields: Callable[[DecoderArgs], dict] = lambda args: {}
    attention_bias_field: bool = True

    def read(self, config: dict, where: str) -> DecoderArgs:
        """DecoderArgs of a config.json of this family."""
        if config.get("hidden_act", "silu") != "silu":
            raise refuse(where, "hidden_act", config["hidden_act"], "the MLP is SwiGLU (silu)")
        sizes = decoder_sizes(config, where, max_seq_len=2048)
        rope_theta, rope_scaling = rope_settings(config, where)
        window, layer_types = self.window(config, where, self.family)
        return DecoderArgs(
            **sizes,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=window,
            layer_types=layer_types,
            family=self.family,
            **self.switches(config, sizes["n_layers"], where),
        )

    def write(self, args: DecoderArgs) -> dict:
        """The config.json fields of this model, in the family's own names (refused, naming the switch, where
        the family's config cannot express it)."""
        self.check_expressible(args)
        config = {
            **decoder_fields(args, self.architecture, self.model_type),
            # transformers 5 reads rope_parameters; 4.x reads the top-level rope_theta and rope_scaling.
            "rope_theta": args.rope_theta,
            "rope_parameters": {"rope_theta": args.rope_theta, **rope_scaling_to_hf(args.rope_scaling)},
            "rope_scaling": rope_scaling_to_hf(args.rope_scaling) if args.rope_scaling else None,
            "attention_dropout": 0.0,
        }
        if self.attention_bias_field:
            config["attention_bias"] = args.qkv_bias
        return config | self.fields(args)

    def check_expressible(self, args: DecoderArgs) -> None:
        can = self.expressible
        problems = []
        if can.qkv_bias == "same" and args.qkv_bias != args.out_bias:
            problems.append(f"qkv_bias={args.qkv_bias} with out_bias={args.out_bias} (one attention_bias)")
        for name in ("qkv_bias", "out_bias", "mlp_bias"):
            want = getattr(can, name)
            if isinstance(want, bool) and getattr(args, name) != want:
                problems.append(f"{name}={getattr(args, name)}")
        if args.qk_norm != can.qk_norm:
            problems.append(f"qk_norm={args.qk_norm!r}")
        if args.norm_position != can.norm_position:
            problems.append(f"norm_position={args.norm_position!r}")
        if self.window is window_always and any(window_of(args, i) is None for i in range(args.n_layers)):
            if args.sliding_window:  # its attention slides on every layer whenever sliding_window is set
                problems.append(f"layer_types={list(args.layer_types)} (full layers among sliding ones)")
        if args.nope_layers and not can.nope:
            problems.append(f"nope_layers={list(args.nope_layers)}")
        if args.rotary_dim < args.head_dim and not can.partial_rotary:
            problems.append(f"rotary_dim={args.rotary_dim} (partial rotary)")
        if problems:
            raise ConfigError(
                f"a {args.family} config.json cannot express {', '.join(problems)}; this model has no "
                "Hugging Face family to be exported as"
            )


def window_fields(args: DecoderArgs, max_window_layers: bool = True) -> dict:
    """The window fields of a family that slides only with use_sliding_window, on the layers layer_types names
    (max_window_layers: the first sliding layer, for readers that derive layer_types from it)."""
    sliding = [window_of(args, i) is not None for i in range(args.n_layers)]
    fields = {
        "use_sliding_window": any(sliding),
        "sliding_window": args.sliding_window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }
    if max_window_layers:
        fields["max_window_layers"] = sliding.index(True) if any(sliding) else args.n_layers
    return fields


def partial_rotary_dim(factor: object, head_dim: int, where: str, key: str = "partial_rotary_factor") -> int:
    """The leading channels of each head a partial_rotary_factor rotates, as transformers derives them:
    int(head_dim x factor); refused, naming `key`, unless a number giving an even count from 2 to head_dim."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise refuse(where, key, factor, "it is a number from 0 to 1")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise refuse(where, key, factor, f"head_dim x it must be an even number up to {head_dim}")
    return rotary_dim


def partial_rotary_factor(args: DecoderArgs) -> float:
    """args.rotary_dim as config.json's partial_rotary_factor (1.0: the whole head)."""
    return args.rotary_dim / args.head_dim


def rotary_dim_unsaid(args: DecoderArgs) -> str | None:
    """args.rotary_dim where no partial_rotary_factor gives it back (transformers reads int(head_dim x factor)), as
    a refusal names it; None where one does."""
    factor = partial_rotary_factor(args)
    if int(args.head_dim * factor) == args.rotary_dim:
        return None
    return f"rotary_dim={args.rotary_dim} (no partial_rotary_factor gives it: int({args.head_dim} x {factor}) differs)"


def rope_settings(config: dict, where: str) -> tuple[float, Llama3RopeScaling | YarnRopeScaling | None]:
    """rope_theta and the frequency scaling (Llama 3.1's "llama3" or "yarn"), from transformers 5's
    rope_parameters or 4.x's top-level rope_theta and rope_scaling; other RoPE types (linear, dynamic,
    longrope) are refused."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    return theta, rope_scaling_of(rope, f"{where} {key}", config)


def rope_scaling_of(rope: dict, where: str, config: dict) -> Llama3RopeScaling | YarnRopeScaling | None:
    """The frequency scaling one rope_parameters / rope_scaling dict asks for (`where` names it): None for
    rope_type "default", Llama 3.1's "llama3", "yarn" (`config`: the fields yarn_from_hf falls back to); others
    refused."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        try:
            return yarn_from_hf(rope, where, config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if rope_type != "llama3":
        raise ConfigError(
            f"{where} rope_type={rope_type!r} is not supported: titanlite implements "
            "unscaled RoPE, Llama 3.1's 'llama3' scaling and 'yarn'"
        )
    fields = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
    absent = [f for f in fields if rope.get(f) is None]
    if absent:
        raise ConfigError(f"{where} of rope_type 'llama3' lacks {absent[0]!r}")
    scaling = Llama3RopeScaling(**{f: rope[f] for f in fields})
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(
            f"{where} needs high_freq_factor > low_freq_factor, not {scaling.high_freq_factor} "
            f"and {scaling.low_freq_factor}"
        )
    return scaling


def per_layer_rope(config: dict) -> bool:
    """Whether config.json's rope_parameters is keyed by layer type (transformers 5's form for Gemma 3 and 4,
    OLMo 3): {"full_attention": {...}, "sliding_attention": {...}}."""
    params = config.get("rope_parameters")
    return bool(params) and isinstance(params, dict) and set(params) <= set(LAYER_KINDS)


def layer_rope_from_hf(
    config: dict, where: str, head_dim: int, types: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
) -> dict[str, LayerRope]:
    """DecoderArgs.layer_rope of a config.json whose rope_parameters is keyed by layer type (per_layer_rope), as
    transformers reads it: each kind's rope_theta (the top-level rope_theta where it gives none), rope_type (those
    of `types`, the family's: "default", "linear" (factor), "llama3", "yarn", "proportional"), and
    partial_rotary_factor (rotary_dim = int(head_dim x factor); "proportional": 2 x int(factor x head_dim // 2)
    channels at frequencies over head_dim). A YaRN entry's original_max_position_embeddings falls back to
    max_position_embeddings (not to a top-level one: transformers reads only the entry's). Anything else refused
    in one line naming the key."""
    found: dict[str, LayerRope] = {}
    for kind, rope in config["rope_parameters"].items():
        key = f"rope_parameters {kind}"
        if rope is None:
            continue
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in types:
            raise refuse(where, f"{key} rope_type", rope_type, f"this family takes {', '.join(types)}")
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is None:
            raise refuse(where, f"{key} rope_theta", None, "give each layer type's rotary base")
        partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0))
        if not 0 < partial <= 1:
            raise refuse(where, f"{key} partial_rotary_factor", partial, "it is a fraction of the head, in (0, 1]")
        fields: dict = {}
        if rope_type == "proportional":
            pairs = int(partial * head_dim // 2)
            if pairs < 1:
                raise refuse(where, f"{key} partial_rotary_factor", partial, "it rotates no channel")
            fields = {"rotary_dim": 2 * pairs if pairs * 2 < head_dim else 0, "frequency_dim": head_dim}
            fields["linear_factor"] = float(rope.get("factor", 1.0))
        elif partial < 1:
            rotary_dim = int(head_dim * partial)
            if rotary_dim < 2 or rotary_dim % 2:
                raise refuse(where, f"{key} partial_rotary_factor", partial, f"it gives {rotary_dim} channels, odd")
            fields["rotary_dim"] = rotary_dim
        if rope_type == "linear":
            fields["linear_factor"] = float(rope.get("factor", 1.0))
        elif rope_type in ("llama3", "yarn"):
            if rope_type == "yarn" and rope.get("truncate") is False:
                # transformers reads truncate from the top of rope_parameters, never a layer type's entry
                raise refuse(where, f"{key} truncate", False, "transformers truncates per-layer YaRN bands always")
            fallback = {"max_position_embeddings": config.get("max_position_embeddings")}
            fields["scaling"] = rope_scaling_of(rope, f"{where} {key}", fallback)
        try:
            found[kind] = LayerRope(float(theta), **fields)
        except ValueError as e:
            raise refuse(where, key, rope, str(e)) from None
    return found


def layer_rope_to_hf(args: DecoderArgs, kinds: tuple[str, ...] = LAYER_KINDS) -> dict:
    """config.json's rope_parameters keyed by layer type for `kinds`: each kind's own settings (args.layer_rope)
    or the shared rope_theta and rope_scaling; what layer_rope_from_hf reads back."""
    head_dim = args.head_dim
    params = {}
    for kind in kinds:
        rope = args.layer_rope.get(kind) or LayerRope(args.rope_theta, args.rope_scaling)
        if isinstance(rope.scaling, YarnRopeScaling) and not rope.scaling.truncate:
            raise ConfigError(f"layer_rope[{kind!r}]: transformers truncates a layer type's YaRN band always")
        entry = {"rope_theta": rope.theta, **rope_scaling_to_hf(rope.scaling)}
        if rope.frequency_dim:
            if rope.frequency_dim != head_dim:
                raise ConfigError(f"layer_rope[{kind!r}].frequency_dim={rope.frequency_dim} is not the head width")
            entry["rope_type"] = "proportional"
            entry["factor"] = rope.linear_factor
        elif rope.linear_factor != 1.0:
            if rope.scaling is not None:
                raise ConfigError(f"layer_rope[{kind!r}]: config.json cannot give a linear factor with a scaling")
            entry["rope_type"], entry["factor"] = "linear", rope.linear_factor
        if rope.rotary_dim and rope.rotary_dim != head_dim:
            entry["partial_rotary_factor"] = rope.rotary_dim / head_dim
        params[kind] = entry
    return params


def rope_scaling_to_hf(scaling: Llama3RopeScaling | YarnRopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default"}
    if isinstance(scaling, YarnRopeScaling):
        return yarn_to_hf(scaling)
    return {"rope_type": "llama3", **dataclasses.asdict(scaling)}
