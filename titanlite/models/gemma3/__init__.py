"""Gemma 3 (text, Gemma3ForCausalLM): the Llama decoder's attention and projections with Gemma's norms, scaled
embeddings, GELU-tanh MLP, and sliding/full layers with their own RoPE bases. Its sizes, config.json and spec."""

from __future__ import annotations

from titanlite.models.common.decoder_args import tp_split_sizes
from titanlite.models.gemma3 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec

SPEC = ModelSpec(
    name="gemma3",
    args_type=args.Gemma3Args,
    flavors=args.FLAVORS,
    model="titanlite.models.gemma3.model:Gemma3",
    tp_plan="titanlite.models.gemma3.parallelize:tp_plan",
    hf_weights="titanlite.models.gemma3.weights",
    tp_split_sizes=tp_split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, fields=hf_config.FIELDS),
    with_depth=args.with_depth,
    description="Gemma 3 (text): (1 + w) RMSNorms before and after each sublayer, scaled embeddings, GELU-tanh "
    "MLP, 5 sliding : 1 full layers with two RoPE bases",
)
