"""DeepSeek-V3 on the shared decoder (titanlite/models/common/decoder.py): pre-norm blocks of multi-head latent
attention (titanlite/models/common/mixers.py LatentAttention) and a mixture of experts (the shared block,
titanlite/models/common/moe/layer.py: sigmoid scores, group-limited top-k, the balancing bias, shared experts, each
block its own load-balancing term), the first moe.dense_layers with a dense SwiGLU. Plain modules with no
parallelism inside; multi-token prediction (mtp_layers, the shared decoder's: models/common/multi_token.py) after
the decoder's layers, each depth's block a mixture of experts as DeepSeek's layer 61 is."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.interface import Decoder
from titanlite.models.common.mixers import LatentAttention
from titanlite.models.common.rope import RotaryTable
from titanlite.models.deepseek_v3.args import DeepseekV3Args


def latent_attention(model: Transformer, layer: int) -> nn.Module:
    a = model.args
    return LatentAttention(
        a.dim,
        a.n_heads,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        softmax_scale=a.softmax_scale,
    )


class DeepseekV3(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: DeepseekV3Args
    mixers = {"latent_attention": latent_attention}
    pooled_balance = False  # each MoE block adds its own term (transformers' DeepSeek-V3 has no pooled one)

    def layer_kind(self, layer: int) -> str:
        return "latent_attention"

    def rotary_tables(self) -> dict[str, RotaryTable]:
        a = self.args
        return {"rope": RotaryTable(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)}

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (parameter `name`'s full value) using only `generator`: norms at one, the embedding normal
        std 0.02, the input-side projections (latent ones, experts' gate and up, the router) trunc normal std
        0.02, the residual-side ones (wo, w2) at std 0.02 / sqrt(2 * n_layers), an untied head at dim**-0.5."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02
        residual_std = std / math.sqrt(2 * self.args.n_layers)

        def trunc(std: float, bound: float = 2.0) -> None:
            nn.init.trunc_normal_(full, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator)

        if parent in ("attention_norm", "ffn_norm", "norm", "q_norm", "kv_norm", "enorm", "hnorm"):
            nn.init.ones_(full)
        elif parent == "tok_embeddings" or (parent == "output" and self.args.tie_embeddings):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent == "output":
            trunc(self.args.dim**-0.5, bound=3.0)
        elif parent in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w3", "gate", "eh_proj") or leaf in ("w1", "w3"):
            trunc(std)  # leaf w1, w3: the stacked experts' gate and up
        elif parent in ("wo", "w2") or leaf == "w2":
            trunc(residual_std)
        else:
            raise KeyError(f"DeepseekV3.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: DeepseekV3) -> Decoder:
        return model
