"""gpt-oss's config.json both ways, torch-free. Read: the Llama decoder's fields (titanlite/models/llama3/hf_config.py),
absent keys taking GptOssConfig's defaults (YaRN factor 32 over 4,096 positions, theta 150,000, window 128 on every
other layer, 128 experts, 4 per token); layer_types, sliding_window, attention_bias, num_local_experts,
num_experts_per_tok (experts_per_token, the original's name, must agree), intermediate_size, swiglu_alpha,
swiglu_limit, router_aux_loss_coef honoured. Ignored, as they change no math: hidden_act (gpt-oss's experts apply
their clamped SwiGLU whatever it says, as transformers' do), initial_context_length, output_router_logits,
initializer_range. The published checkpoints' MXFP4 experts are dequantized as they are read
(titanlite/components/hf_quantized.py). Refused in one line: mlp_bias, and what any decoder refuses (other RoPE
types, layer types, head shapes); a training run refuses a non-zero attention_dropout, as for every family
(titanlite/base/hf_config.py check_training_fields)."""

from __future__ import annotations

import dataclasses

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, NUMBER, POSITIVE, FieldTypes, refuse
from titanlite.models.common.decoder_args import DecoderArgs, window_of
from titanlite.models.common.decoder_config import (
    DecoderConfig,
    Expressible,
    Window,
    attention_biases,
    layer_types_of,
    no_mlp_bias,
)
from titanlite.models.common.moe.hf_config import FIXED, MOE_FIELDS, block_from_config, check_expressible
from titanlite.models.gpt_oss.args import GptOssArgs, alternating

# The config.json fields gpt-oss reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts' and
# its clamped SwiGLU's.
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    "experts_per_token": (COUNT, False),
    "swiglu_alpha": (NUMBER, False),
    "swiglu_limit": (POSITIVE, False),
}

MODEL_TYPE = "gpt_oss"

# GptOssConfig's defaults for keys a config.json may leave out (those that differ from the decoder reader's).
DEFAULTS = {
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "sliding_window": 128,
    "attention_bias": True,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "router_aux_loss_coef": 0.001,
}
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _switches(config: dict, n_layers: int, where: str) -> dict:
    no_mlp_bias("gpt_oss", config, where)
    return attention_biases(config, n_layers, where)


def _window(config: dict, where: str, family: str) -> Window:
    """The window on the layers layer_types names (absent: every other layer, from the first), none when
    sliding_window is null."""
    n_layers = config["num_hidden_layers"]
    layer_types = layer_types_of(config, where) or list(alternating(n_layers))
    if len(layer_types) != n_layers:
        raise refuse(where, "layer_types", f"[{len(layer_types)} entries]", f"it needs one per layer ({n_layers})")
    window = config.get("sliding_window") or 0
    if not window or "sliding_attention" not in layer_types:
        return 0, ()
    return window, tuple(layer_types)


def _fields(args: DecoderArgs) -> dict:
    sliding = [window_of(args, i) is not None for i in range(args.n_layers)]
    return {
        "sliding_window": args.sliding_window or None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


DECODER = DecoderConfig(
    family="gpt_oss",
    model_type=MODEL_TYPE,
    architecture="GptOssForCausalLM",
    expressible=Expressible(mlp_bias=False),
    switches=_switches,
    window=_window,
    fields=_fields,
)


def read(config: dict, where: str) -> GptOssArgs:
    """GptOssArgs of a gpt_oss config.json."""
    config = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None or k == "sliding_window"}}
    config["hidden_act"] = "silu"  # not read by gpt-oss's experts (see the module docstring)
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": config["rope_theta"]}
    per_token = config["num_experts_per_tok"]
    if config.get("experts_per_token", per_token) != per_token:
        raise refuse(
            where, "experts_per_token", config["experts_per_token"], f"it differs from num_experts_per_tok={per_token}"
        )
    base = DECODER.read(config, where)
    moe = block_from_config(
        where,
        config,
        {"n_experts": "num_local_experts", "expert_dim": "intermediate_size"},
        n_experts=config["num_local_experts"],
        top_k=per_token,
        expert_dim=config["intermediate_size"],
        norm_topk_prob=True,  # softmax over the top-k logits: the renormalised top-k of the softmax
        router_bias=True,
        aux_loss_coef=config["router_aux_loss_coef"],
    )
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderArgs)}
    try:
        return GptOssArgs(
            **fields,
            moe=moe,
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from e


def write(args: GptOssArgs) -> dict:
    """The config.json fields of a gpt-oss model (refused, naming the switch, where gpt-oss's cannot say it)."""
    moe = args.moe
    # gpt-oss's block: the shared one's softmax router with a bias, renormalised top-k, no dense layers.
    width = () if moe.expert_dim == args.ffn_dim else (
        f"ffn_dim={args.ffn_dim} with MoEArgs.expert_dim={moe.expert_dim} (one intermediate_size)",
    )  # fmt: skip
    check_expressible(
        moe, "gpt_oss", dense_layers=False, fixed={**FIXED, "router_bias": True, "norm_topk_prob": True}, more=width
    )
    return DECODER.write(args) | {
        "num_local_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef if moe.balance == "aux_loss" else 0.0,
        "swiglu_alpha": args.swiglu_alpha,
        "swiglu_limit": args.swiglu_limit,
        "output_router_logits": False,
    }
