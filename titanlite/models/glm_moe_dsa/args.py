"""GLM-5's arguments (GLM-5, 5.1, 5.2; model_type glm_moe_dsa), torch-free: DeepSeek-V3.2's (titanlite/models/
deepseek_v32/args.py) with the indexer rotating adjacent pairs; the published size."""

from __future__ import annotations

from dataclasses import dataclass, field

from titanlite.models.common.latent.args import IndexerArgs
from titanlite.models.common.moe.args import bias_routed
from titanlite.models.deepseek_v3.args import first_dense
from titanlite.models.deepseek_v32.args import FLAVORS as V32_FLAVORS
from titanlite.models.deepseek_v32.args import DeepseekV32Args, fields_of
from titanlite.models.spec import not_math


@dataclass
class GlmMoeDsaArgs(DeepseekV32Args):
    """GLM-5 (titanlite/models/deepseek_v3/model.py builds it): DeepSeek-V3.2's model, its indexer's rotary channels
    in adjacent pairs."""

    family: str = not_math("glm_moe_dsa")
    indexer: IndexerArgs | None = field(
        default_factory=lambda: IndexerArgs(n_heads=4, head_dim=16, topk=16, interleaved=True), kw_only=True
    )


def _glm5() -> GlmMoeDsaArgs:
    """zai-org/GLM-5 (744B, 40B active), as transformers' GlmMoeDsaConfig describes it: 78 layers, the first 3
    dense, 64 heads of key 192 + 64 rotary and value 256 from a latent of 512 (query rank 2,048), 256 experts (one
    group), 8 per token, one shared; an indexer of 32 heads of 128 channels keeping 2,048 keys."""
    return GlmMoeDsaArgs(
        dim=6144,
        n_layers=78,
        n_heads=64,
        ffn_dim=12288,
        vocab_size=154880,
        max_seq_len=202752,
        norm_eps=1e-5,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        moe=bias_routed(256, 8, 2048, 2.5, dense_layers=first_dense(3)),
        indexer=IndexerArgs(n_heads=32, head_dim=128, topk=2048, interleaved=True),
    )


FLAVORS = {
    # DeepSeek-V3.2's debug shape, its indexer rotating pairs.
    "debug": GlmMoeDsaArgs(**fields_of(V32_FLAVORS["debug"])),
    "glm5_744b": _glm5(),
}
