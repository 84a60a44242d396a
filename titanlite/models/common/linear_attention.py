"""The linear-attention kernels of the hybrid families, in plain PyTorch: the gated delta rule (Gated DeltaNet in
Qwen3-Next and Qwen3.5, one decay per head; Kimi Delta Attention in Kimi Linear, one decay per key channel), the short
causal convolution that feeds it and the gated norm that reads it.

The gated delta rule keeps a state S [Dk, Dv] per head, a map from keys to values. At each token it decays S by
exp(g) (g a log-decay, <= 0, scaling every row of S or each row by its own channel's), then writes, under key k, the
part of v that S does not already recall for k, at the rate beta in (0, 1), and reads the state with the query:

    S = exp(g_t) S;    S = S + k_t (beta_t (v_t - S^T k_t))^T;    o_t = S^T (scale q_t)

`gated_delta_rule_recurrent` runs that loop token by token: the reference, and the kernel of a decoding step.
`gated_delta_rule_chunked` gives the same result for training and prefill with T / chunk_size sequential steps: the
writes inside a chunk form a unit lower-triangular system (DeltaNet's WY / UT form), solved at once, so the cost is
O(T chunk_size), not O(T^2). Neither normalises q or k: the families L2-normalise both in the mixer, before the call.
`causal_conv1d` is the depthwise convolution over the last few tokens that precedes the kernel, and `GatedRMSNorm`
the RMSNorm gated by SiLU that follows it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _computing_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float32, or float64 when an input is: the state sums many small writes, too many for a 16-bit float."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the tokens whose document is not the previous token's. Never the window's first token: what came
    before the window (a state handed in) belongs to the first token's document."""
    starts = torch.zeros_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def _heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """q (scaled), k, v, g, beta as [B, H, T, ...] in the computing dtype, q and k repeated to the value heads, g as
    [B, H, T, 1] (one decay per head) or [B, H, T, Dk] (one per key channel); and the state the window starts from."""
    batch, length, key_heads, key_dim = k.shape
    heads, value_dim = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (batch, length) or heads % key_heads:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal [B, T, Hk, Dk], v {tuple(v.shape)} [B, T, H, Dv] "
            "with H a multiple of Hk"
        )
    if beta.shape != (batch, length, heads):
        raise ValueError(f"beta {tuple(beta.shape)} must be [B, T, H] = {[batch, length, heads]}")
    if g.shape not in ((batch, length, heads), (batch, length, heads, key_dim)):
        raise ValueError(
            f"g {tuple(g.shape)} must be [B, T, H] (one decay per head) or [B, T, H, Dk] (one per key channel), "
            f"[B, T, H, Dk] = {[batch, length, heads, key_dim]}"
        )
    state_shape = (batch, heads, key_dim, value_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be [B, H, Dk, Dv] = {list(state_shape)}")
    dtype = _computing_dtype(q, k, v, g, beta, initial_state)
    if heads != key_heads:  # grouped value heads: value head h reads query and key head h // (H / Hk)
        q, k = (x.repeat_interleave(heads // key_heads, dim=2) for x in (q, k))
    if g.dim() == 3:
        g = g.unsqueeze(-1)
    q, k, v, g, beta = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g, beta))
    q = q * (key_dim**-0.5 if scale is None else scale)
    if initial_state is None:
        state = torch.zeros(state_shape, dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype)
    return q, k, v, g, beta, state


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time. q, k [B, T, Hk, Dk]; v [B, T, H, Dv] (H a multiple of Hk: value
    head h reads query and key head h // (H / Hk)); beta [B, T, H]; g, the log-decay, [B, T, H] (Gated DeltaNet) or
    [B, T, H, Dk] (Kimi Delta Attention); initial_state [B, H, Dk, Dv] (None: zeros); `documents` [B, T], each token's
    document index (attention.Sequence.documents): the state goes back to zero, not to initial_state, at each token
    whose document is not the previous token's, so every packed document is computed as if alone, the first one
    continuing initial_state; `scale` multiplies q (None: Dk^-0.5).

    Returns o [B, T, H, Dv] in q's dtype and the final state [B, H, Dk, Dv] in the computing dtype (float32, float64
    for float64 inputs), the dtype a generation cache keeps it in."""
    out_dtype = q.dtype
    q, k, v, g, beta, state = _heads_first(q, k, v, g, beta, initial_state, scale)
    keep = None if documents is None else (~document_starts(documents)).to(state.dtype)
    outputs = []
    for t in range(v.shape[2]):
        if keep is not None:
            state = state * keep[:, t, None, None, None]
        state = state * g[:, :, t, :, None].exp()
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        written = beta[:, :, t, None] * (v[:, :, t] - recalled)
        state = state + k[:, :, t, :, None] * written[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(outputs, dim=1).to(out_dtype), state


def decayed_scores(a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[..., C, C]: sum over channels d of a_i[d] b_j[d] exp(decay_i[d] - decay_j[d]) where mask[i, j], else 0.
    a, b [..., C, Dk]; decay, the cumulative log-decay, [..., C, 1] (one per head) or [..., C, Dk]. The gaps are
    masked before the exponential: those where j is after i are positive and could overflow."""
    if decay.shape[-1] == 1:
        gap = decay[..., :, None, 0] - decay[..., None, :, 0]
        return (a @ b.transpose(-1, -2)) * gap.masked_fill(~mask, float("-inf")).exp()
    gap = decay[..., :, None, :] - decay[..., None, :, :]  # [..., C, C, Dk]: the whole cost of per-channel decay
    return torch.einsum("...id,...jd,...ijd->...ij", a, b, gap.masked_fill(~mask[..., None], float("-inf")).exp())


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of `gated_delta_rule_recurrent` (same arguments, same results), chunk_size tokens at a
    time (T is padded to a multiple of it inside).

    Within a chunk, with D_i the decay from the chunk's start through token i and S0 the state before the chunk, the
    state after token i is D_i S0 + sum_{j <= i} (D_i / D_j) k_j u_j^T, where u_j is what token j writes. Each u_j
    depends on the earlier writes of the chunk through a unit lower-triangular system, (I + A) U = beta V - beta
    (D K) S0 with A[i, j] = beta_i k_i . (D_i / D_j) k_j for j < i, so two triangular solves give every write of every
    chunk at once, and only the step from one chunk's state to the next is sequential. Documents mask the pairs that
    straddle a document start, keep S0 from the tokens after one, and keep the chunk's state from passing through
    it. Per-channel decay builds a [B, H, T, chunk_size, Dk] tensor of pairwise decays (per head: no Dk)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be at least 1")
    out_dtype = q.dtype
    q, k, v, g, beta, state = _heads_first(q, k, v, g, beta, initial_state, scale)
    batch, heads, length, value_dim = v.shape
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size
    q, k, v, g = (F.pad(x, (0, 0, 0, pad)).reshape(batch, heads, chunks, chunk_size, -1) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad)).reshape(batch, heads, chunks, chunk_size, 1)

    # The document each token is in, counted from the chunk's first: 0 for the one the chunk starts in. Padding adds
    # no start, so the padded tokens (which write nothing and decay nothing) extend the last document.
    starts = torch.zeros(batch, length + pad, dtype=torch.int64, device=v.device)
    if documents is not None:
        starts[:, :length] = document_starts(documents)
    segment = starts.reshape(batch, 1, chunks, chunk_size).cumsum(dim=-1)  # [B, 1, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    same = segment[..., :, None] == segment[..., None, :]
    reads = causal & same  # token i sees what token j wrote
    first = (segment == 0)[..., None]  # the tokens that see the state carried into the chunk
    last = (segment == segment[..., -1:])[..., None]  # the tokens whose writes the chunk carries out
    through = first[:, :, :, -1, 0]  # [B, 1, N]: one document throughout, the carried state passes through

    decay = g.cumsum(dim=3)  # [B, H, N, C, 1 or Dk]: the log of D_i
    chunk_decay = decay[:, :, :, -1].exp() * through[..., None]  # [B, H, N, 1 or Dk]
    k_beta = k * beta
    system = decayed_scores(k_beta, k, decay, reads.tril(-1))  # A, strictly below the diagonal
    eye = torch.eye(chunk_size, dtype=system.dtype, device=system.device)
    writes_without_state = torch.linalg.solve_triangular(system + eye, v * beta, upper=False, unitriangular=True)
    writes_per_state = torch.linalg.solve_triangular(
        system + eye, k_beta * decay.exp() * first, upper=False, unitriangular=True
    )
    scores = decayed_scores(q, k, decay, reads)
    q_reading_state = q * decay.exp() * first
    k_writing_state = k * (decay[:, :, :, -1:] - decay).exp() * last

    outputs = []
    for n in range(chunks):
        writes = writes_without_state[:, :, n] - writes_per_state[:, :, n] @ state  # U [B, H, C, Dv]
        outputs.append(q_reading_state[:, :, n] @ state + scores[:, :, n] @ writes)
        state = chunk_decay[:, :, n, :, None] * state + k_writing_state[:, :, n].transpose(-1, -2) @ writes
    o = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk_size, value_dim)[:, :, :length]
    return o.transpose(1, 2).to(out_dtype), state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time: y_t[c] = bias[c] + sum_j weight[c, j] x_{t-K+1+j}[c], then SiLU when
    `activation`. x [B, T, C]; weight [C, K], nn.Conv1d(C, C, K, groups=C)'s weight [C, 1, K] without its middle
    dimension (weight[:, K - 1] multiplies the current token), as the families' checkpoints store it; `documents`
    [B, T]: no token sees an earlier document's inputs, so each document is convolved as if alone; `state` [B, C, K-1]:
    the K-1 inputs before x, oldest first (None: zeros), which belong to the first token's document.

    Returns y [B, T, C] in x's dtype (computed in the weight's, as the families do) and the new state [B, C, K-1]: the
    last K-1 inputs, those of an earlier document zeroed, so feeding tokens one at a time gives the whole sequence's y.
    (Hugging Face's cache keeps K inputs; its last K-1 are this state.)"""
    batch, length, channels = x.shape
    width = weight.shape[1]
    if weight.shape[0] != channels:
        raise ValueError(f"weight {tuple(weight.shape)} must be [C, K] with C = x.shape[-1] = {channels}")
    if state is None:
        state = x.new_zeros(batch, channels, width - 1)
    if state.shape != (batch, channels, width - 1):
        raise ValueError(f"state {tuple(state.shape)} must be [B, C, K-1] = {[batch, channels, width - 1]}")
    inputs = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    segment = None
    if documents is not None:
        # Each token's document counted from the first token's; the state's inputs are in that first one (0).
        segment = F.pad(document_starts(documents).to(torch.int64).cumsum(dim=1), (width - 1, 0))
    y = torch.zeros(batch, length, channels, dtype=weight.dtype, device=x.device)
    for j in range(width):
        term = inputs[:, j : j + length].to(weight.dtype) * weight[:, j]
        if segment is not None:
            term = term * (segment[:, j : j + length] == segment[:, width - 1 :])[..., None]
        y = y + term
    if bias is not None:
        y = y + bias
    if activation:
        y = F.silu(y)
    new_state = inputs[:, length:]
    if segment is not None:
        new_state = new_state * (segment[:, length:] == segment[:, -1:])[..., None]
    return y.to(x.dtype), new_state.transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """RMSNorm of x gated by SiLU(gate): normalised in float32, cast to x's dtype, times weight, times SiLU of the
    gate in float32, then x's dtype: Qwen3-Next's and Qwen3.5's norm of the gated delta rule's output, per head
    (dim = Dv), step for step, so imported weights give Hugging Face's outputs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)
