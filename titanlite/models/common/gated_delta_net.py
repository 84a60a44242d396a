"""The linear-attention mixer of the hybrid families: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo Hybrid), a layer kind
of the shared decoder (titanlite/models/common/decoder.py) beside attention. Plain modules with no parallelism inside.

Per token x [dim]: q, k [Hk, Dk] and v [H, Dv] are projections of x (H value heads, a multiple of the Hk key heads:
value head h reads key head h // (H / Hk)), each passed through a short causal depthwise convolution over the last
`conv_size` tokens and SiLU; q and k are L2-normalised per head. A decay g (a log, <= 0) and a write strength beta
per value head come from two more projections, g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) (times
`beta_scale`: OLMo Hybrid's 2, which lets the update's eigenvalues turn negative). The gated delta rule
(titanlite/models/common/linear_attention.py) turns them into outputs [H, Dv], which an RMSNorm per head (weight
[Dv]) normalises, a SiLU (or sigmoid) gate of a projection z of x scales, and `wo` projects back to dim.

Two parameter-free cores do the sequence work, so context parallelism (titanlite/parallel/context_parallel.py) can
wrap them as it wraps attention's: `ShortConvolution` (the convolution, which reads the tokens before each one) and
`DeltaRule` (the recurrence, which carries a state from each token to the next). With a block-causal `Sequence`
both restart at every document start, so packed documents are computed as if each were alone; without one they run
across the window. With a cache (generation) the layer keeps its recurrent state and its convolution's last inputs
(`LayerCache.state`) instead of keys and values."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, local_sinks
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.linear_attention import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

GATES = ("silu", "sigmoid")
L2_EPS = 1e-6  # q and k are divided by sqrt(sum of squares + L2_EPS), as flash-linear-attention and transformers do


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension (not F.normalize's x / max(|x|, eps))."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a per-head parameter (a DTensor sharded by head under tensor parallelism)."""
    return local_sinks(t)


class ShortConvolution(nn.Module):
    """The causal depthwise convolution of a sequence x [B, T, C] with `weight` [C, K], then SiLU
    (linear_attention.causal_conv1d), restarting at each document of `sequence`; `state` [B, C, K-1] the inputs
    before x (generation). Returns the output and the new state. Parameter-free: the mixer holds the weights."""

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        documents = None if sequence is None else sequence.documents
        return causal_conv1d(x, weight, None, documents, state, activation=True)


class DeltaRule(nn.Module):
    """The gated delta rule over a sequence (linear_attention's arguments: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g
    [B, T, H] or [B, T, H, Dk], beta [B, T, H]), restarting at each document of `sequence`, from `state` [B, H, Dk,
    Dv] (generation; None: zeros). Returns o [B, T, H, Dv] and the final state. The chunked PyTorch path; one token
    (a decoding step) runs the recurrence itself."""

    def __init__(self, chunk_size: int = 64):
        super().__init__()
        self.chunk_size = chunk_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        documents = None if sequence is None else sequence.documents
        if q.shape[1] == 1:
            return gated_delta_rule_recurrent(q, k, v, g, beta, state, documents)
        return gated_delta_rule_chunked(q, k, v, g, beta, state, documents, chunk_size=self.chunk_size)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (module docstring): `key_heads` x `key_dim` queries and keys, `value_heads` x `value_dim`
    values, a convolution over `conv_size` tokens, one decay per value head, the output norm's epsilon `norm_eps`,
    `beta_scale` on the write strength and the output gate's activation `gate` ("silu": Qwen3.5, Qwen3-Next, OLMo
    Hybrid; "sigmoid"). Every projection a separate nn.Linear and each convolution's weight [C, K] its own
    parameter, so tensor parallelism splits them all by heads."""

    def __init__(
        self,
        dim: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_size: int,
        *,
        norm_eps: float = 1e-6,
        beta_scale: float = 1.0,
        gate: str = "silu",
    ):
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"GatedDeltaNet value_heads={value_heads} must be a multiple of key_heads={key_heads}")
        if conv_size < 1:
            raise ValueError(f"GatedDeltaNet conv_size={conv_size}; it must be at least 1")
        if gate not in GATES:
            raise ValueError(f"GatedDeltaNet gate={gate!r}; use one of {', '.join(GATES)}")
        self.key_dim, self.value_dim, self.beta_scale, self.gate = key_dim, value_dim, beta_scale, gate
        q_width, v_width = key_heads * key_dim, value_heads * value_dim
        self.wq = nn.Linear(dim, q_width, bias=False)
        self.wk = nn.Linear(dim, q_width, bias=False)
        self.wv = nn.Linear(dim, v_width, bias=False)
        self.conv_q = nn.Parameter(torch.empty(q_width, conv_size))
        self.conv_k = nn.Parameter(torch.empty(q_width, conv_size))
        self.conv_v = nn.Parameter(torch.empty(v_width, conv_size))
        self.wa = nn.Linear(dim, value_heads, bias=False)  # the decay's input
        self.wb = nn.Linear(dim, value_heads, bias=False)  # the write strength's
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.wz = nn.Linear(dim, v_width, bias=False)  # the output gate's
        self.norm = HeadRMSNorm(value_dim, eps=norm_eps)
        self.wo = nn.Linear(v_width, dim, bias=False)
        self.conv = ShortConvolution()  # context parallelism wraps these two
        self.rule = DeltaRule()

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, sequence: Sequence | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # this rank's heads under tensor parallelism
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        weight = torch.cat([local(self.conv_q), local(self.conv_k), local(self.conv_v)])
        qkv = torch.cat([q, k, v], dim=-1)
        conv_state = None if cache is None else cache.state("conv")
        qkv, conv_state = self.conv(qkv, weight, sequence, conv_state)
        q, k, v = qkv.split(widths, dim=-1)
        q = l2_normalize(q.view(bsz, seqlen, -1, self.key_dim).float())
        k = l2_normalize(k.view(bsz, seqlen, -1, self.key_dim).float())
        v = v.view(bsz, seqlen, -1, self.value_dim)
        beta = self.wb(x).float().sigmoid()
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        g = -local(self.A_log).float().exp() * F.softplus(self.wa(x).float() + local(self.dt_bias).float())
        state = None if cache is None else cache.state("recurrent")
        o, state = self.rule(q, k, v, g, beta, sequence, state)
        if cache is not None:
            cache.set_state("conv", conv_state)
            cache.set_state("recurrent", state)
        o = self.norm(o.to(x.dtype))  # [B, T, H, Dv]
        z = self.wz(x).view(bsz, seqlen, -1, self.value_dim).float()
        o = (o * (F.silu(z) if self.gate == "silu" else torch.sigmoid(z))).to(x.dtype)
        return self.wo(o.reshape(bsz, seqlen, -1))


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head's output [..., D], computed in float32 and cast back before the weight multiplies it (the
    product left in the weight's dtype for the gate that follows), as the hybrid families' gated norms compute it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
