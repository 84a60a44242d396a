"""GLM-5 (GlmMoeDsaForCausalLM, model_type glm_moe_dsa: GLM-5, 5.1, 5.2), a family of DeepSeek-V3's folder:
DeepSeek-V3.2's sparse attention (its indexer rotating adjacent pairs) and mixture of experts, in GLM's sizes. Its spec
and its config.json both ways (DeepSeek-V3.2's reader, sparse_hf_config.py, with GlmMoeDsaConfig's defaults for absent
keys); its sizes in sparse_args.py; its module, weights and tensor-parallel plan are DeepSeek-V3's.

Refused beyond DeepSeek-V3.2's refusals: indexer_types with a "shared" layer (GLM's cross-layer reuse of an earlier
layer's selection, or index_topk_freq / index_topk_pattern making one): titanlite builds an indexer on every layer."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, TEXT, TEXTS, FieldTypes, refuse
from titanlite.models.common.decoder_spec import moe_decoder_spec
from titanlite.models.deepseek_v3 import sparse_args, sparse_hf_config
from titanlite.models.deepseek_v3.args import split_sizes
from titanlite.models.deepseek_v3.deepseek_v32 import auxiliary_losses
from titanlite.models.deepseek_v3.sparse_args import GlmMoeDsaArgs
from titanlite.models.deepseek_v3.sparse_hf_config import read_family, write_family

FIELDS: FieldTypes = {
    **sparse_hf_config.FIELDS,
    "indexer_types": (TEXTS, True),
    "index_topk_freq": (COUNT, True),
    "index_topk_pattern": (TEXT, True),
}
MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
# GlmMoeDsaConfig's defaults where they differ from DeepseekV32Config's (which the shared reader takes for absent keys).
DEFAULTS = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
}


def read(config: dict, where: str) -> GlmMoeDsaArgs:
    """GlmMoeDsaArgs of a glm_moe_dsa config.json (absent keys take GlmMoeDsaConfig's defaults)."""
    kinds = config.get("indexer_types") or []
    shared = [i for i, kind in enumerate(kinds) if kind != "full"]
    pattern = config.get("index_topk_pattern")
    if shared or (config.get("index_topk_freq") or 1) > 1 or (pattern and set(pattern) != {"F"}):
        raise refuse(
            where, "indexer_types", kinds or pattern or config.get("index_topk_freq"), "titanlite builds an "
            "indexer on every layer; layers that reuse an earlier layer's selection ('shared') are not built",
        )  # fmt: skip
    return read_family(GlmMoeDsaArgs, {**DEFAULTS, **config}, where, n_index_heads=32, interleaved=True)


def write(args: GlmMoeDsaArgs) -> dict:
    """GLM-5's config.json: DeepSeek-V3.2's fields, every layer's indexer its own ("full"); an indexer rotating halves
    (DeepSeek-V3.2's) is refused."""
    if args.indexer is not None and not args.indexer.interleaved:
        raise ConfigError("a glm_moe_dsa config.json cannot express an indexer rotating halves; export deepseek_v32")
    written = write_family(args, ARCHITECTURE, MODEL_TYPE, "glm_moe_dsa")
    return {**written, "indexer_types": ["full"] * args.n_layers}


SPEC = moe_decoder_spec(
    "glm_moe_dsa",
    sparse_args.GLM_FLAVORS,
    read,
    write,
    "titanlite.models.deepseek_v3.weights",
    "GLM-5: DeepSeek-V3.2's sparse attention through a lightning indexer and its mixture of experts, in GLM's sizes",
    args_type=sparse_args.GlmMoeDsaArgs,
    model="titanlite.models.deepseek_v3.model:DeepseekV3",
    tp_plan="titanlite.models.common.latent.parallelize:tp_plan",
    tp_split_sizes=split_sizes,
    fields=FIELDS,
    auxiliary_losses=auxiliary_losses,
)
