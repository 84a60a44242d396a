"""The attention mixers of the shared blocks (titanlite/models/common/decoder.py): grouped-query attention (full or
sliding, with or without rotations, Q/K norms, biases, a score scale and sinks, as each family asks) and
multi-head latent attention. Each runs its scores through an attention core (titanlite/models/common/attention.py:
sdpa or flex, block-causal masks), which context parallelism wraps; plain modules with no parallelism inside.

A mixer is called as mixer(x, cos, sin, cache=..., sequence=...) when its block reads a rotary table (cos and sin
the full tables [max_seq_len, rotary_dim // 2], or those of the tokens' positions), as mixer(x, cache=...,
sequence=...) when it reads none; x [B, T, dim] in, [B, T, dim] out. With a cache (generation) the tokens continue
the cached sequence and the mixer adds its state (keys and values) to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, attend, build_core, local_sinks
from titanlite.models.common.decoder_args import QK_NORMS
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.rope import apply_rope


class AttentionOptions(TypedDict, total=False):
    """Attention's keyword options (its __init__ says what each does): what a family's attention builder changes of
    the shared arguments' (models/common/decoder.py grouped_query_attention)."""

    qkv_bias: bool
    out_bias: bool
    qk_norm: str
    norm: Callable[..., nn.Module]
    norm_eps: float
    rotary: bool
    window: int | None
    scale: float | None
    sinks: bool
    rotary_dim: int | None
    output_gate: bool


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads over n_kv_heads key/value heads of width head_dim.

    `qk_norm`: "head" normalises each head's query and key (one weight of head_dim shared by the heads), "full"
    each token's whole query and key projection, built by `norm(width, eps=norm_eps)`; `rotary`: rotate queries
    and keys by the tables the block hands in, the whole of each head or, with `rotary_dim`, its leading rotary_dim
    channels (partial rotary: Qwen3.5, Qwen3-Next); `window`: sliding-window attention; `scale` replaces
    head_dim**-0.5 of the scores; `sinks`: one learned sink logit per query head (gpt-oss), added to each softmax
    denominator; `output_gate`: the attention's output multiplied by the sigmoid of a projection of the input
    (`wg`, as wide as the queries) before the output projection (Qwen3.5's and Qwen3-Next's gated attention)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm: str = "none",
        norm: Callable[..., nn.Module] = nn.RMSNorm,
        norm_eps: float = 1e-5,
        rotary: bool = True,
        window: int | None = None,
        scale: float | None = None,
        sinks: bool = False,
        rotary_dim: int | None = None,
        output_gate: bool = False,
    ):
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"Attention qk_norm={qk_norm!r}; use one of {', '.join(QK_NORMS)}")
        if rotary_dim is not None and not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
            raise ValueError(f"Attention rotary_dim={rotary_dim}; use an even number from 2 to head_dim={head_dim}")
        self.head_dim, self.use_rope = head_dim, rotary
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        q_width, kv_width = n_heads * head_dim, n_kv_heads * head_dim
        # Separate projections (not one fused qkv) so tensor parallelism can shard each column-wise.
        self.wq = nn.Linear(dim, q_width, bias=qkv_bias)
        self.wk = nn.Linear(dim, kv_width, bias=qkv_bias)
        self.wv = nn.Linear(dim, kv_width, bias=qkv_bias)
        self.wg: nn.Linear | None = nn.Linear(dim, q_width, bias=qkv_bias) if output_gate else None
        self.wo = nn.Linear(q_width, dim, bias=out_bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            per_head = qk_norm == "head"
            self.q_norm = norm(head_dim if per_head else q_width, eps=norm_eps)
            self.k_norm = norm(head_dim if per_head else kv_width, eps=norm_eps)
        # context parallelism wraps the core to gather the other ranks' keys
        self.core = build_core("sdpa", window=window, scale=scale, sinks=sinks)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(n_heads)) if sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, T, H*hd]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism the local head counts follow from the sharded weights.
        q = q.view(bsz, seqlen, -1, self.head_dim)  # [B, T, Hq, hd]
        k = k.view(bsz, seqlen, -1, self.head_dim)  # [B, T, Hkv, hd]
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and cos is not None and sin is not None:
            # The full tables come in and are cut here: under sequence parallelism the block's input
            # holds a slice of the sequence, but attention sees the whole of it.
            cos, sin = cos[:seqlen], sin[:seqlen]  # [T, rotary_dim/2]
            q, k = apply_rope(q, cos, sin, self.rotary_dim), apply_rope(k, cos, sin, self.rotary_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        # This rank's heads' sink logits (under tensor parallelism the parameter is sharded by head).
        sinks = local_sinks(self.sinks) if self.sinks is not None else None
        if cache is None:
            out = attend(self.core, q, k, v, sequence, sinks)
        else:  # the cache keeps H_kv heads and attends over the cached positions too
            out = cache.attend(q, k, v, self.core, sinks)  # [B, Hq, T, hd]; the core's window applies there too
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, Hq*hd]
        if self.wg is not None:
            out = out * torch.sigmoid(self.wg(x))
        return self.wo(out)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The query, key, value and gate projections input-side, wo residual-side, biases zero; the sinks normal
        (transformers' gpt-oss)."""
        if name == "sinks":
            scheme.normal(full, generator)
        else:
            start_linears(name, full, generator, scheme, inputs=("wq", "wk", "wv", "wg"), outputs=("wo",))


class LatentWidths(TypedDict):
    """LatentAttention's keyword arguments (its __init__ says what each does)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float | None
    rotary: bool


LATENT_NORM_EPS = 1e-6  # the latent norms' epsilon in DeepSeek's code and transformers', whatever rms_norm_eps says


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). Per token x [dim]: the query is wq(x), or wq_b(q_norm(wq_a(x)))
    through a rank-q_lora_rank bottleneck; wkv_a(x) gives the compressed latent c [kv_lora_rank] and ONE rotary key
    k_rot [qk_rope_head_dim] shared by every head; wkv_b(kv_norm(c)) expands the latent into each head's non-rotary
    key [qk_nope_head_dim] and value [v_head_dim]. Each head attends with query [q_nope, rope(q_rot)] and key
    [k_nope, rope(k_rot)] at `softmax_scale`. The core takes keys and values of one width: where v_head_dim differs
    from the query/key width, the narrower side is padded with zeros (zeros change no score, and the output's
    padding is cut). Every projection a separate nn.Linear, so tensor parallelism splits the per-head ones (wq or
    wq_b, wkv_b, wo) by heads and keeps the latent ones whole. `rotary=False`: the q_rot and k_rot channels are
    kept but not rotated, and the block hands in no tables (Kimi Linear's latent attention, which has no positions)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float | None = None,
        rotary: bool = True,
    ):
        super().__init__()
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_rank, self.use_rope = kv_lora_rank, rotary
        q_width = n_heads * (qk_nope_head_dim + qk_rope_head_dim)
        self.wq: nn.Linear | None = None
        if q_lora_rank:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_lora_rank, q_width, bias=False)
        else:
            self.wq = nn.Linear(dim, q_width, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if softmax_scale is None else softmax_scale
        self.core = build_core("sdpa", scale=softmax_scale)  # context parallelism wraps it

    def queries(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each head's query [B, T, H, nope + rope] (its rotary channels rotated), and the query's low-rank
        residual q_norm(wq_a(x)) [B, T, q_lora_rank] that it is expanded from (None without query compression)."""
        bsz, seqlen, _ = x.shape
        residual = None if self.wq is not None else self.q_norm(self.wq_a(x))
        q = self.wq(x) if self.wq is not None else self.wq_b(residual)
        # -1 heads: under tensor parallelism the local head count follows from the sharded weights.
        q_nope, q_rot = q.view(bsz, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        if self.use_rope and cos is not None and sin is not None:
            q_rot = apply_rope(q_rot, cos[:seqlen], sin[:seqlen])
        return torch.cat([q_nope, q_rot], dim=-1), residual

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's normed latent kv_norm(c) [B, T, kv_lora_rank] and its rotary key [B, T, rope], rotated:
        all a key and a value are expanded from (expand)."""
        seqlen = x.shape[1]
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        if self.use_rope and cos is not None and sin is not None:
            # The full tables come in and are cut here: under sequence parallelism the block's input holds a slice
            # of the sequence, but attention sees the whole of it.
            k_rot = apply_rope(k_rot.unsqueeze(2), cos[:seqlen], sin[:seqlen]).squeeze(2)
        return self.kv_norm(latent), k_rot

    def expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's key [B, S, H, nope + rope] and value [B, S, H, v] of the latents and rotary keys (latent)."""
        bsz, keys, _ = latent.shape
        kv = self.wkv_b(latent).view(bsz, keys, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, S, H, nope], [B, S, H, v]
        return torch.cat([k_nope, k_rot.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        q, _ = self.queries(x, cos, sin)
        k, v = self.expand(*self.latent(x, cos, sin))
        return self.wo(self.attend_dense(q, k, v, cache, sequence).flatten(2))

    def attend_dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerCache | None,
        sequence: Sequence | None,
    ) -> torch.Tensor:
        """Attention [B, T, H, v] of queries q [B, T, H, w] over keys [B, T, H, w] and values [B, T, H, v] through
        the core (context parallelism's, which gathers the other ranks' keys, where it wraps it), or the cache."""
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, width]
        out = self.core(q, k, v, sequence) if cache is None else cache.attend(q, k, v, self.core)
        return out[..., : self.v_dim].transpose(1, 2)  # [B, T, H, v]

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The query's and the latent's projections input-side, wo residual-side (DeepSeek-V3's); the norms at one."""
        inputs = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")
        start_linears(name, full, generator, scheme, inputs=inputs, outputs=("wo",))
