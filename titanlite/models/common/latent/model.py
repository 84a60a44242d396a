"""The shared decoder with multi-head latent attention (titanlite/models/common/mixers.py LatentAttention) built from
a family's LatentArgs: the attention's builder, its rotary table, and DeepSeek-V3's initialisation. Plain modules with
no parallelism inside; DeepSeek-V3's and Kimi Linear's modules derive from LatentDecoder."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from titanlite.models.common.decoder import Transformer
from titanlite.models.common.latent.args import LatentArgs
from titanlite.models.common.mixers import LatentAttention
from titanlite.models.common.rope import RotaryTable

NORMS = ("attention_norm", "ffn_norm", "norm", "q_norm", "kv_norm")  # initialised at one
# Input-side projections, trunc normal std 0.02: the query's and the latent's, the dense MLP's gate and up, the router.
PROJECTIONS = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w3", "gate")


def latent_attention(model: Transformer, layer: int) -> LatentAttention:
    """The arguments' multi-head latent attention (LatentArgs), its rotary channels rotated where they say so."""
    a = model.args
    assert isinstance(a, LatentArgs)  # a latent family's module builds it
    return LatentAttention(
        a.dim,
        a.n_heads,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        softmax_scale=a.softmax_scale,
        rotary=a.latent_rotary,
    )


class LatentDecoder(Transformer):
    """The shared decoder (Transformer) whose full-attention layers are multi-head latent attention, reading one rotary
    table over qk_rope_head_dim channels (none where the arguments' latent_rotary is False). A family adds its own
    mixer kinds to `mixers`, and names its own norms and input-side projections for init_param in `own_norms` and
    `own_projections`."""

    mixers = {"full_attention": latent_attention}
    own_norms: ClassVar[tuple[str, ...]] = ()
    own_projections: ClassVar[tuple[str, ...]] = ()

    def rotary_tables(self) -> dict[str, RotaryTable]:
        a = self.args
        assert isinstance(a, LatentArgs)
        return {"rope": RotaryTable(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)} if a.latent_rotary else {}

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (parameter `name`'s full value) using only `generator`, as DeepSeek-V3 starts: norms at one,
        the embedding normal std 0.02, input-side projections (the latent ones, the experts' gate and up, the router)
        trunc normal std 0.02, residual-side ones (wo, w2, the experts' down) at std 0.02 / sqrt(2 * n_layers), an
        untied head at dim**-0.5."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02

        def trunc(std: float, bound: float = 2.0) -> None:
            nn.init.trunc_normal_(full, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator)

        if parent in NORMS or parent in self.own_norms:
            nn.init.ones_(full)
        elif parent == "tok_embeddings" or (parent == "output" and self.args.tie_embeddings):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent == "output":
            trunc(self.args.dim**-0.5, bound=3.0)
        elif parent in PROJECTIONS or parent in self.own_projections or leaf in ("w1", "w3"):
            trunc(std)  # leaf w1, w3: the stacked experts' gate and up
        elif parent in ("wo", "w2") or leaf == "w2":
            trunc(std / math.sqrt(2 * self.args.n_layers))
        else:
            raise KeyError(f"{type(self).__name__}.init_param: unknown parameter {name!r}")
