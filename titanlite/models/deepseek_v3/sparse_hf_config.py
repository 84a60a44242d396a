"""DeepSeek-V3.2's config.json (model_type deepseek_v32, DeepseekV32ForCausalLM) both ways, torch-free: DeepSeek-V3's
fields (titanlite/models/deepseek_v3/hf_config.py, honoured and refused as there) and the indexer's.

Honoured beyond DeepSeek-V3's: index_n_heads, index_head_dim, index_topk (indexer_fields), mlp_layer_types (which
layers are dense: the first ones, as first_k_dense_replace says). Refused: a layer_types entry other than
"indexed_attention" (every layer attends through its indexer), q_lora_rank null (the indexer reads the query's
low-rank residual), rope_interleave false (transformers' DeepseekV32 rotates the main attention's channels in pairs
whatever it says, and reads no such field). The published weights' FP8 blocks are dequantized as they are read
(titanlite/components/hf_quantized.py).

GLM-5's reader (glm_moe_dsa.py) is this one, with GLM's defaults and its indexer rotating adjacent pairs."""

from __future__ import annotations

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import COUNT, TEXTS, FieldTypes, refuse
from titanlite.models.common.latent.args import IndexerArgs
from titanlite.models.deepseek_v3 import hf_config as v3
from titanlite.models.deepseek_v3.sparse_args import DeepseekV32Args

# Beyond DeepSeek-V3's: the indexer's shape, the layers' kinds.
FIELDS: FieldTypes = {
    **v3.FIELDS,
    "index_n_heads": (COUNT, False),
    "index_head_dim": (COUNT, False),
    "index_topk": (COUNT, False),
    "mlp_layer_types": (TEXTS, True),
}
INDEXER_KEYS = {"n_heads": "index_n_heads", "head_dim": "index_head_dim", "topk": "index_topk"}
MODEL_TYPE = "deepseek_v32"
ARCHITECTURE = "DeepseekV32ForCausalLM"


def indexer_fields(config: dict, where: str, n_heads: int, interleaved: bool) -> IndexerArgs:
    """The indexer of a config.json (absent keys: DeepseekV32Config's 128 channels and 2,048 keys; `n_heads` the
    family's default heads); every layer's attention must be "indexed_attention"."""
    kinds = config.get("layer_types") or []
    other = sorted({kind for kind in kinds if kind != "indexed_attention"})
    if other:
        raise refuse(where, "layer_types", other, "every layer of this family attends through its indexer")
    return IndexerArgs(
        n_heads=config.get("index_n_heads", n_heads),
        head_dim=config.get("index_head_dim", 128),
        topk=config.get("index_topk", 2048),
        interleaved=interleaved,
    )


def dense_layers_agree(config: dict, where: str, args) -> None:
    """mlp_layer_types, where given, must name as dense the layers first_k_dense_replace does (what the model
    builds)."""
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        return
    dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    if len(kinds) != args.n_layers or set(kinds) - {"dense", "sparse"} or dense != args.moe.dense_layers:
        raise refuse(
            where, "mlp_layer_types", kinds, f"give {args.n_layers} entries, 'dense' for the first "
            f"first_k_dense_replace={len(args.moe.dense_layers)} layers and 'sparse' after them",
        )  # fmt: skip


def read_family(args_type: type, config: dict, where: str, n_index_heads: int, interleaved: bool):
    """`args_type` of a config.json of DeepSeek-V3's fields and the indexer's (DeepSeek-V3.2's, GLM-5's)."""
    if config.get("rope_interleave") is False:
        raise refuse(
            where, "rope_interleave", False, "this family rotates the attention's channels in pairs whatever "
            "rope_interleave says (transformers reads no such field for it); leave it out",
        )  # fmt: skip
    if not config.get("q_lora_rank", 1536):
        raise refuse(where, "q_lora_rank", None, "the indexer reads the query's low-rank residual; give its rank")
    indexer = indexer_fields(config, where, n_index_heads, interleaved)
    args = v3.read_as(args_type, config, where, interleave=True, indexer=indexer)
    dense_layers_agree(config, where, args)
    return args


def read(config: dict, where: str) -> DeepseekV32Args:
    """DeepseekV32Args of a deepseek_v32 config.json (absent keys take DeepseekV32Config's defaults)."""
    return read_family(DeepseekV32Args, config, where, n_index_heads=64, interleaved=False)


def write_family(args: DeepseekV32Args, architecture: str, model_type: str, family: str) -> dict:
    """DeepSeek-V3's config.json fields (for `model_type`) and the indexer's."""
    indexer = args.indexer
    assert indexer is not None  # the family's arguments refuse None
    return {
        **v3.write_as(args, architecture, model_type, family),
        "index_n_heads": indexer.n_heads,
        "index_head_dim": indexer.head_dim,
        "index_topk": indexer.topk,
    }


def write(args: DeepseekV32Args) -> dict:
    """DeepSeek-V3.2's config.json; what it cannot say is refused, as DeepSeek-V3's writer refuses it, and an indexer
    that rotates in pairs (GLM-5's, model_type glm_moe_dsa)."""
    if args.indexer is not None and args.indexer.interleaved:
        raise ConfigError("a deepseek_v32 config.json cannot express an indexer rotating pairs; export glm_moe_dsa")
    return write_family(args, ARCHITECTURE, MODEL_TYPE, "deepseek_v32")
