"""DeepSeek-V3.2's and GLM-5's arguments, torch-free: DeepSeek-V3's (titanlite/models/deepseek_v3/args.py) with the
lightning indexer of DeepSeek Sparse Attention on every layer (titanlite/models/common/latent/args.py IndexerArgs),
rotating halves (DeepSeek-V3.2) or adjacent pairs (GLM-5); the published sizes. Two families of this folder
(deepseek_v32.py, glm_moe_dsa.py), as they share DeepSeek-V3's module, weights and plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlite.models.common.latent.args import IndexerArgs
from titanlite.models.common.moe.args import bias_routed
from titanlite.models.deepseek_v3.args import FLAVORS as V3_FLAVORS
from titanlite.models.deepseek_v3.args import DeepseekV3Args, first_dense
from titanlite.models.spec import not_math


@dataclass
class DeepseekV32Args(DeepseekV3Args):
    """DeepSeek-V3.2 (titanlite/models/deepseek_v3/model.py builds it): DeepSeek-V3 whose latent attention reads, for
    each query, the `indexer.topk` keys its indexer selects (models/common/latent/sparse.py)."""

    family: str = not_math("deepseek_v32")
    # The debug model's indexer: 4 heads of 16 channels, 16 keys a query (fewer than the tests' sequences).
    indexer: IndexerArgs | None = field(
        default_factory=lambda: IndexerArgs(n_heads=4, head_dim=16, topk=16), kw_only=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.indexer is None:
            raise ValueError("DeepseekV32Args.indexer=None; DeepSeek-V3.2 attends through an indexer on every layer")
        if not self.rope_interleave:
            raise ValueError("DeepseekV32Args.rope_interleave=False; DeepSeek-V3.2 stores its rotary rows in pairs")


def _deepseek_v32_671b() -> DeepseekV32Args:
    """deepseek-ai/DeepSeek-V3.2 (and V3.2-Exp): DeepSeek-V3 671B's shape, an indexer of 64 heads of 128 channels
    keeping 2,048 keys a query."""
    indexer = IndexerArgs(n_heads=64, head_dim=128, topk=2048)
    return DeepseekV32Args(**fields_of(V3_FLAVORS["deepseek_v3_671b"]), indexer=indexer)


def fields_of(v3: DeepseekV3Args) -> dict:
    """A DeepSeek-V3 flavor's fields, but its family's name: what a DeepSeek-V3.2 of its shape takes."""
    return {f.name: getattr(v3, f.name) for f in dataclasses.fields(v3) if f.name not in ("family", "indexer")}


V32_FLAVORS = {
    # DeepSeek-V3's debug shape with the indexer above.
    "debug": DeepseekV32Args(**fields_of(V3_FLAVORS["debug"])),
    "deepseek_v32_671b": _deepseek_v32_671b(),
}


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


GLM_FLAVORS = {
    # DeepSeek-V3.2's debug shape, its indexer rotating pairs.
    "debug": GlmMoeDsaArgs(**fields_of(V32_FLAVORS["debug"])),
    "glm5_744b": _glm5(),
}
