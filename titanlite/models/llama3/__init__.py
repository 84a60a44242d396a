"""Llama 3 (RoPE, RMSNorm, SwiGLU, grouped-query attention): its spec, and `decoder_spec`, with which the
families that reuse this decoder describe themselves from their own folders."""

from __future__ import annotations

from titanlite.models.common import decoder_args
from titanlite.models.llama3 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec


def tp_refusal(a: decoder_args.DecoderArgs) -> str | None:
    if a.qk_norm == "full":
        return (
            "model qk_norm 'full' (a norm over each token's whole query and key, which tensor parallelism "
            "splits over ranks)"
        )
    return None


def decoder_spec(name: str, flavors: dict, hf: hf_config.DecoderConfig, description: str) -> ModelSpec:
    """The spec of a family built by the Llama decoder: its module, weight names and TP plan are this folder's."""
    return ModelSpec(
        name=name,
        args_type=decoder_args.DecoderArgs,
        flavors=flavors,
        model="titanlite.models.common.decoder:Transformer",
        tp_plan="titanlite.models.llama3.parallelize:tp_plan",
        hf_weights="titanlite.models.llama3.weights",
        tp_split_sizes=decoder_args.tp_split_sizes,
        hf=HFConfig(hf.model_type, hf.read, hf.write),
        tp_refusal=tp_refusal,
        with_depth=decoder_args.with_depth,
        description=description,
    )


SPEC = decoder_spec(
    "llama3", args.FLAVORS, hf_config.LLAMA, "Llama 3: RoPE (with Llama 3.1's scaling), RMSNorm, SwiGLU, GQA"
)
