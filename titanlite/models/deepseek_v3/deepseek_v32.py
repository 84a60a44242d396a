"""DeepSeek-V3.2 (DeepseekV32ForCausalLM, V3.2 and V3.2-Exp), a family of DeepSeek-V3's folder: DeepSeek-V3 whose latent
attention is sparse, each query reading the keys a lightning indexer selects (titanlite/models/common/latent/sparse.py).
Its spec; its sizes in sparse_args.py, its config.json in sparse_hf_config.py; its module, weights and tensor-parallel
plan are DeepSeek-V3's, which build the indexer where the arguments have one."""

from __future__ import annotations

from titanlite.models.common.decoder_args import moe_auxiliary_losses
from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.deepseek_v3 import sparse_args, sparse_hf_config
from titanlite.models.deepseek_v3.args import split_sizes


def auxiliary_losses(a: sparse_args.DeepseekV32Args) -> tuple[str, ...]:
    """The mixture of experts' terms, and the indexer's loss."""
    return (*moe_auxiliary_losses(a), "indexer_loss")


SPEC = moe_decoder_spec(
    "deepseek_v32",
    sparse_args.V32_FLAVORS,
    sparse_hf_config.read,
    sparse_hf_config.write,
    "titanlite.models.deepseek_v3.weights",
    "DeepSeek-V3.2: DeepSeek-V3 with sparse attention, each query reading the keys a lightning indexer selects",
    args_type=sparse_args.DeepseekV32Args,
    model="titanlite.models.deepseek_v3.model:DeepseekV3",
    tp_plan="titanlite.models.common.latent.parallelize:tp_plan",
    tp_split_sizes=split_sizes,
    fields=sparse_hf_config.FIELDS,
    auxiliary_losses=auxiliary_losses,
)
