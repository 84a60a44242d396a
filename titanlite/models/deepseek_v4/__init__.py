"""DeepSeek-V4 (DeepseekV4ForCausalLM): hyper-connections over several residual streams, attention with a window,
compressed keys and a lightning indexer (sliding, CSA and HCA layers), a mixture of experts with sqrt-softplus scores,
clamped SwiGLUs and hash-routed first layers. Its sizes (args.py), config.json (hf_config.py) and spec; its module and
weight names are this folder's, its FLOPs the MoE decoder's (the attention reports its own)."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.deepseek_v4 import args, hf_config
from titanlite.models.spec import HFConfig, ModelSpec


def split_sizes(model_args: args.DeepseekV4Args) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: the query heads and the groups of the output projection (a
    rank holds whole groups of whole heads), the experts' width, the vocabulary."""
    return {
        "n_heads": model_args.n_heads,
        "o_groups": model_args.o_groups,
        "ffn_dim": model_args.moe.expert_dim,
        "vocab_size": model_args.vocab_size,
    }


def auxiliary_losses(model_args: args.DeepseekV4Args) -> tuple[str, ...]:
    """The mixture of experts' terms, and the CSA layers' indexer loss."""
    indexer = ("indexer_loss",) if model_args.has_indexer else ()
    return moe_auxiliary_losses(model_args) + indexer


SPEC = ModelSpec(
    name="deepseek_v4",
    args_type=args.DeepseekV4Args,
    flavors=args.FLAVORS,
    model="titanlite.models.deepseek_v4.model:DeepseekV4",
    tp_plan="titanlite.models.deepseek_v4.parallelize:tp_plan",
    hf_weights="titanlite.models.deepseek_v4.weights",
    tp_split_sizes=split_sizes,
    hf=HFConfig(hf_config.MODEL_TYPE, hf_config.read, hf_config.write, experts=True, fields=hf_config.FIELDS),
    moe=lambda a: a.moe,
    with_depth=args.with_depth,
    flops="titanlite.models.common.flops:moe_flops_per_token",
    auxiliary_losses=auxiliary_losses,
    description="DeepSeek-V4: hyper-connections, sliding, compressed sparse (CSA) and heavily compressed (HCA) "
    "attention with sinks, and a mixture of experts with hash-routed first layers",
)
