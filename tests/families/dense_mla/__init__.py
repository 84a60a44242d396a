"""dense_mla: a latent-attention family defined entirely outside titanlite, registered when this module is imported
(`--model.custom_import tests.families.dense_mla`). Multi-head latent attention (titanlite/models/common/latent/:
its arguments, module, initialisation and tensor-parallel plan) on every layer, with a dense SwiGLU in every block
instead of DeepSeek's experts, tied embeddings, and values narrower than the queries and keys. Its arguments and spec
are all the folder holds: the module and the plan are the shared latent decoder's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.registry import register
from titanlite.models.spec import ModelSpec


@dataclass
class DenseMLAArgs(LatentArgs):
    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 256
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    family: str = "dense_mla"
    layer_types: ClassVar[tuple[str, ...]] = ()  # every layer latent attention


SPEC = ModelSpec(
    name="dense_mla",
    args_type=DenseMLAArgs,
    flavors={
        # 4 heads of key 8 + 4 rotary, value 6, a query bottleneck of 16 and a latent of 16.
        "debug": DenseMLAArgs(
            dim=32,
            n_layers=2,
            n_heads=4,
            ffn_dim=64,
            vocab_size=0,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
        ),
    },
    model="titanlite.models.common.latent.model:LatentDecoder",
    tp_plan="titanlite.models.common.latent.parallelize:tp_plan",
    hf_weights="",
    tp_split_sizes=lambda a: {"n_heads": a.n_heads, "ffn_dim": a.ffn_dim, "vocab_size": a.vocab_size},
    description="a test family: multi-head latent attention with a dense SwiGLU, tied embeddings",
)
register(SPEC)
