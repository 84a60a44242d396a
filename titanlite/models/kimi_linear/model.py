"""Kimi Linear on the shared decoder (titanlite/models/common/decoder.py): pre-norm blocks whose mixer is Kimi Delta
Attention (titanlite/models/common/kimi_delta.py) or multi-head latent attention without rotary positions
(titanlite/models/common/mixers.py LatentAttention, rotary=False), as args.layer_types says, and whose feed-forward
is the shared mixture of experts (sigmoid scores, the balancing bias, shared experts, each block its own
load-balancing term) or, at moe.dense_layers, a dense SwiGLU. No layer reads a rotary table. Plain modules with no
parallelism inside."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kimi_delta import KimiDeltaAttention
from titanlite.models.common.mixers import LatentAttention
from titanlite.models.common.rope import RotaryTable
from titanlite.models.kimi_linear.args import KimiLinearArgs


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
        rotary=False,
    )


def kimi_delta_attention(model: Transformer, layer: int) -> nn.Module:
    a = model.args
    return KimiDeltaAttention(a.dim, a.linear_heads, a.linear_head_dim, a.conv_size, norm_eps=a.norm_eps)


class KimiLinear(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: KimiLinearArgs
    mixers = {"full_attention": latent_attention, "linear_attention": kimi_delta_attention}
    pooled_balance = False  # each MoE block adds its own term (transformers' KimiLinear has no pooled one)

    def rotary_tables(self) -> dict[str, RotaryTable]:
        return {}  # nothing is rotated

    def rotary_of(self, layer: int) -> str | None:
        return None

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (parameter `name`'s full value) using only `generator`: DeepSeek-V3's scheme for the norms,
        embedding, head and projections (input side trunc normal std 0.02, residual side (wo, w2) std
        0.02 / sqrt(2 * n_layers)); KDA's convolutions as nn.Conv1d's (uniform within 1/sqrt(K)), A_log the log of
        uniform(1, 16) and dt_bias the inverse softplus of exp(uniform(log 1e-3, log 1e-1)) (flash-linear-attention's
        and transformers' initialisation)."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02

        def trunc(std: float, bound: float = 2.0) -> None:
            nn.init.trunc_normal_(full, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator)

        if leaf in ("conv_q", "conv_k", "conv_v"):
            bound = 1 / math.sqrt(full.shape[1])
            nn.init.uniform_(full, -bound, bound, generator=generator)
        elif leaf == "A_log":
            full.copy_(torch.empty_like(full).uniform_(1.0, 16.0, generator=generator).log())
        elif leaf == "dt_bias":
            dt = torch.empty_like(full).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp()
            dt = dt.clamp_min(1e-4)
            full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        elif parent in ("attention_norm", "ffn_norm", "norm", "q_norm", "kv_norm"):
            nn.init.ones_(full)
        elif parent == "tok_embeddings" or (parent == "output" and self.args.tie_embeddings):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent == "output":
            trunc(self.args.dim**-0.5, bound=3.0)
        elif parent in ("wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b", "wf_a", "wf_b", "wb", "wg_a", "wg_b"):
            trunc(std)
        elif parent in ("w1", "w3", "gate") or leaf in ("w1", "w3"):
            trunc(std)  # leaf w1, w3: the stacked experts' gate and up
        elif parent in ("wo", "w2") or leaf == "w2":
            trunc(std / math.sqrt(2 * self.args.n_layers))
        else:
            raise KeyError(f"KimiLinear.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: KimiLinear) -> Decoder:
        return model
