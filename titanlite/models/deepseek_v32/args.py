"""DeepSeek-V3.2's arguments, torch-free: DeepSeek-V3's (titanlite/models/deepseek_v3/args.py) with the lightning
indexer of DeepSeek Sparse Attention on every layer (titanlite/models/common/latent/args.py IndexerArgs); the
published sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titanlite.models.common.latent.args import IndexerArgs
from titanlite.models.deepseek_v3.args import FLAVORS as V3_FLAVORS
from titanlite.models.deepseek_v3.args import DeepseekV3Args
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


FLAVORS = {
    # DeepSeek-V3's debug shape with the indexer above.
    "debug": DeepseekV32Args(**fields_of(V3_FLAVORS["debug"])),
    "deepseek_v32_671b": _deepseek_v32_671b(),
}
