"""OLMo 3's config.json (model_type "olmo3", Olmo3ForCausalLM), both ways, torch-free: OLMo 2's fields (the shared
decoder's, with post-norm blocks and whole-projection Q/K norms), layer_types (three sliding : one full where
absent) with sliding_window (4,096 where absent), and the rotary settings of each layer type as transformers reads
them: transformers 5's rope_parameters keyed by layer type, or 4.x's top-level rope_scaling, which applies to the
full layers only. OLMo 3 rotates whole heads: partial_rotary_factor, and RoPE types other than default, linear,
llama3 and yarn, are refused in one line naming the key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.base.hf_config import refuse
from titanlite.models.common.decoder_args import DecoderArgs, window_of
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    attention_biases,
    layer_rope_from_hf,
    layer_rope_to_hf,
    layer_types_of,
    no_mlp_bias,
    per_layer_rope,
)
from titanlite.models.common.rope_args import LayerRope

MODEL_TYPE = "olmo3"
DEFAULT_THETA = 500000.0  # Olmo3Config.default_theta
DEFAULT_WINDOW = 4096  # Olmo3Config.sliding_window


def layer_types(n_layers: int) -> tuple[str, ...]:
    """OLMo 3's layer pattern: every fourth layer full, the others sliding (transformers' default layer_types)."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers))


def window(config: dict, where: str, family: str) -> tuple[int, tuple[str, ...]]:
    """(sliding_window, layer_types): config.json's layer_types, or transformers' default pattern."""
    n_layers = config["num_hidden_layers"]
    kinds = tuple(layer_types_of(config, where)) or layer_types(n_layers)
    if len(kinds) != n_layers:
        raise refuse(where, "layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    size = config.get("sliding_window", DEFAULT_WINDOW)
    if "sliding_attention" not in kinds:
        return 0, ()
    if not size:
        raise refuse(where, "sliding_window", size, "the sliding layers need a window")
    return size, kinds


def switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("olmo3", config, where)
    return attention_biases(config, n_layers, where) | {"qk_norm": "full", "norm_position": "post"}


def rope_parameters(config: dict, where: str) -> dict:
    """rope_parameters keyed by layer type, as transformers' Olmo3Config builds it: transformers 5's form as it
    is; from 4.x's form, rope_theta on every layer and rope_scaling on the full layers only. A top-level
    rope_theta other than the default is refused: Olmo3Config gives it to one layer type alone."""
    params = config.get("rope_parameters")
    if params and not per_layer_rope(config):
        raise refuse(where, "rope_parameters", sorted(params), "OLMo 3 keys it by layer type (full_attention, ...)")
    theta = config.get("rope_theta", DEFAULT_THETA)
    if theta != DEFAULT_THETA:
        # transformers' Olmo3Config gives a top-level rope_theta to one layer type only (the other keeps
        # 500000): a folder relying on that reads differently elsewhere.
        raise refuse(where, "rope_theta", theta, "give each layer type's rope_theta in rope_parameters")
    if params:
        return config
    full = {"rope_theta": theta, **(config.get("rope_scaling") or {})}
    return {**config, "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_theta": theta}}}


@dataclass(frozen=True)
class Olmo3Config(DecoderConfig):
    """The shared decoder's config.json with OLMo 3's per-layer-type rotary settings (DecoderArgs.layer_rope)."""

    def read(self, config: dict, where: str) -> DecoderArgs:
        config = rope_parameters(config, where)
        shared = {**config, "rope_parameters": None, "rope_scaling": None, "rope_theta": DEFAULT_THETA}
        args = super().read(shared, where)
        layer_rope = layer_rope_from_hf({**config, "rope_theta": DEFAULT_THETA}, where, args.head_dim)
        for kind, rope in layer_rope.items():
            if rope.rotary_dim:
                raise refuse(where, f"rope_parameters {kind} partial_rotary_factor", rope.rotary_dim / args.head_dim,
                             "OLMo 3 rotates whole heads")  # fmt: skip
        for kind in ("full_attention", "sliding_attention"):  # an absent entry: transformers' default
            layer_rope.setdefault(kind, LayerRope(DEFAULT_THETA))
        # The shared rope_theta and rope_scaling are unused (every kind has its own): the full layers' base, unscaled.
        return dataclasses.replace(args, rope_theta=layer_rope["full_attention"].theta, layer_rope=layer_rope)

    def write(self, args: DecoderArgs) -> dict:
        config = super().write(args)
        for key in ("rope_theta", "rope_scaling"):
            config.pop(key)
        return config | {"rope_parameters": layer_rope_to_hf(args)}


def fields(args: DecoderArgs) -> dict:
    sliding = [window_of(args, i) is not None for i in range(args.n_layers)]
    return {
        # Without sliding layers the window is unused; transformers still reads a number.
        "sliding_window": args.sliding_window or args.max_seq_len,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


HF = Olmo3Config(
    family="olmo3",
    model_type=MODEL_TYPE,
    architecture="Olmo3ForCausalLM",
    expressible=Expressible(mlp_bias=False, qk_norm="full", norm_position="post"),
    switches=switches,
    window=window,
    fields=fields,
)
