"""Kimi Delta Attention (KDA), the linear-attention mixer of Kimi Linear: Gated DeltaNet
(titanlite/models/common/gated_delta_net.py) with one decay per key channel instead of one per head, a low-rank
forget gate and a low-rank, sigmoid-gated output norm. Plain modules with no parallelism inside.

Per token x [dim], with H heads of width D (queries, keys and values alike): q, k, v = wq(x), wk(x), wv(x), each
through the short causal convolution over the last `conv_size` tokens and SiLU (one call over the three), q and k
L2-normalised per head. The decay, a log <= 0 per head and key channel, is g = -exp(A_log[h]) softplus(wf_b(wf_a(x))
+ dt_bias) (wf_a: dim -> D, wf_b: D -> H D); the write strength beta = sigmoid(wb(x)) per head. The gated delta rule
(titanlite/models/common/linear_attention.py) turns them into outputs o [H, D]; each head's o is RMS-normalised
(weight [D], in float32), multiplied by the SIGMOID of the low-rank gate wg_b(wg_a(x)) (Qwen's norm gates with SiLU),
and wo projects back to dim: transformers' KimiLinearDeltaAttention step for step.

The sequence work is done by Gated DeltaNet's parameter-free cores, `conv` (ShortConvolution) and `rule` (DeltaRule),
which context parallelism wraps by name; with a cache (generation) the layer keeps its recurrent state and its
convolution's last inputs (`LayerCache.state`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.gated_delta_net import (
    DecayInit,
    DeltaRule,
    HeadRMSNorm,
    ShortConvolution,
    l2_normalize,
    local,
    start_linear_mixer,
)
from titanlite.models.common.init_scheme import InitScheme
from titanlite.models.common.kv_cache import LayerCache

# flash-linear-attention's and transformers' KDA init: A uniform in [1, 16], dt log-uniform in [1e-3, 1e-1] floored at
# 1e-4, dt_bias its softplus inverse.
KDA_DECAY = DecayInit(a_range=(1.0, 16.0), dt_range=(1e-3, 1e-1))


class KimiDeltaAttention(nn.Module):
    """KDA (module docstring): `heads` heads of width `head_dim`, a convolution over `conv_size` tokens, the output
    norm's epsilon `norm_eps`. Every projection a separate nn.Linear and each convolution's weight [C, K], the decay's
    A_log [H] and dt_bias [H D] their own parameters, so tensor parallelism splits the per-head ones by heads; the
    low-rank gates' first projections (wf_a, wg_a) are shared by every head and stay whole."""

    def __init__(self, dim: int, heads: int, head_dim: int, conv_size: int, *, norm_eps: float = 1e-6):
        super().__init__()
        if conv_size < 1:
            raise ValueError(f"KimiDeltaAttention conv_size={conv_size}; it must be at least 1")
        self.head_dim = head_dim
        width = heads * head_dim
        self.wq = nn.Linear(dim, width, bias=False)
        self.wk = nn.Linear(dim, width, bias=False)
        self.wv = nn.Linear(dim, width, bias=False)
        self.conv_q = nn.Parameter(torch.empty(width, conv_size))
        self.conv_k = nn.Parameter(torch.empty(width, conv_size))
        self.conv_v = nn.Parameter(torch.empty(width, conv_size))
        self.wf_a = nn.Linear(dim, head_dim, bias=False)  # the forget gate's low-rank projection
        self.wf_b = nn.Linear(head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(width))
        self.wb = nn.Linear(dim, heads, bias=False)  # the write strength's
        self.wg_a = nn.Linear(dim, head_dim, bias=False)  # the output gate's low-rank projection
        self.wg_b = nn.Linear(head_dim, width, bias=False)
        self.norm = HeadRMSNorm(head_dim, eps=norm_eps)
        self.wo = nn.Linear(width, dim, bias=False)
        self.conv = ShortConvolution()  # context parallelism wraps these two
        self.rule = DeltaRule()

    def sequence_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token that mix the sequence (models/common/flops.py): the gated delta rule's, each score
        carrying the per-channel decay (7 C D where Gated DeltaNet's is 5 C D; DeltaRule.flops_per_token)."""
        d = self.head_dim
        return self.rule.flops_per_token(self.wv.out_features // d, d, d, score_terms=7)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, D]: -exp(A_log) softplus(wf_b(wf_a(x)) + dt_bias), in float32."""
        bsz, seqlen, _ = x.shape
        f = self.wf_b(self.wf_a(x)).float() + local(self.dt_bias).float()
        f = f.view(bsz, seqlen, -1, self.head_dim)
        return -local(self.A_log).float().exp()[:, None] * F.softplus(f)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, sequence: Sequence | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        shape = (bsz, seqlen, -1, self.head_dim)  # -1 heads: this rank's under tensor parallelism
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        weight = torch.cat([local(self.conv_q), local(self.conv_k), local(self.conv_v)])
        conv_state = None if cache is None else cache.state("conv")
        qkv, conv_state = self.conv(torch.cat([q, k, v], dim=-1), weight, sequence, conv_state)
        q, k, v = qkv.split(widths, dim=-1)
        q, k, v = l2_normalize(q.view(shape).float()), l2_normalize(k.view(shape).float()), v.view(shape)
        beta = self.wb(x).float().sigmoid()
        state = None if cache is None else cache.state("recurrent")
        o, state = self.rule(q, k, v, self.decay(x), beta, sequence, state)
        if cache is not None and state is not None:  # fla returns none for packed documents, which a cache never has
            cache.set_state("conv", conv_state)
            cache.set_state("recurrent", state)
        # The rule's output in x's dtype, then the gated norm in float32 throughout (the float32 input keeps the
        # norm's product in float32), cast once at the end: transformers' KimiLinearRMSNormGated.
        gate = self.wg_b(self.wg_a(x)).view(shape).float()
        o = (self.norm(o.to(x.dtype).float()) * torch.sigmoid(gate)).to(x.dtype)
        return self.wo(o.reshape(bsz, seqlen, -1))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """start_linear_mixer's, the decay as KDA_DECAY says (the output norm starts at one, its own way)."""
        inputs = ("wq", "wk", "wv", "wf_a", "wf_b", "wb", "wg_a", "wg_b")
        start_linear_mixer(name, full, generator, scheme, KDA_DECAY, inputs)
