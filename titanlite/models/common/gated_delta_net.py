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

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, local_sinks
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.linear_attention import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from titanlite.models.common.linear_attention_args import GatedDeltaNetArgs

GATES = ("silu", "sigmoid")
BACKENDS = ("torch", "fla")  # how DeltaRule computes (model.linear_attn_backend), never what
L2_EPS = 1e-6  # q and k are divided by sqrt(sum of squares + L2_EPS), as flash-linear-attention and transformers do


@dataclass(frozen=True)
class DecayInit:
    """How a linear-attention layer's decay starts: A = exp(A_log) uniform in `a_range`; dt_bias at one, or with
    `dt_range` the softplus inverse of a dt log-uniform in that range, floored at `dt_floor`."""

    a_range: tuple[float, float]
    dt_range: tuple[float, float] | None = None
    dt_floor: float = 1e-4

    def start(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full`, the layer's A_log or dt_bias, drawing only from `generator`."""
        if name == "A_log":
            full.copy_(torch.empty_like(full).uniform_(*self.a_range, generator=generator).log_())
        elif name == "dt_bias" and self.dt_range is None:
            nn.init.ones_(full)
        elif name == "dt_bias" and self.dt_range is not None:
            low, high = math.log(self.dt_range[0]), math.log(self.dt_range[1])
            dt = torch.empty_like(full).uniform_(low, high, generator=generator).exp_().clamp_(min=self.dt_floor)
            full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        else:
            raise KeyError(f"no decay parameter {name!r}")


# transformers' Qwen3.5 (and Qwen3-Next) init: A uniform in [0.01, 16], dt_bias at one.
QWEN_DECAY = DecayInit(a_range=(0.01, 16.0))


def start_convolution(full: torch.Tensor, generator: torch.Generator) -> None:
    """A depthwise convolution's weight [C, K] as nn.Conv1d starts one: uniform within 1/sqrt(K)."""
    bound = 1.0 / math.sqrt(full.shape[1])
    nn.init.uniform_(full, -bound, bound, generator=generator)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension (not F.normalize's x / max(|x|, eps))."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a per-head parameter (a DTensor sharded by head under tensor parallelism)."""
    return local_sinks(t)


class ShortConvolution(nn.Module):
    """The causal depthwise convolution of a sequence x [B, T, C] with `weight` [C, K] (and `bias` [C], where the
    layer has one: Mamba-2's), then SiLU (linear_attention.causal_conv1d), restarting at each document of `sequence`;
    `state` [B, C, K-1] the inputs before x (generation). Returns the output and the new state. Parameter-free: the
    mixer holds the weights."""

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        documents = None if sequence is None else sequence.documents
        return causal_conv1d(x, weight, bias, documents, state, activation=True)


@functools.cache
def fla_unavailable(device_type: str, smoke: bool = True) -> str | None:
    """Why flash-linear-attention's kernels cannot run on `device_type` here (None: they can): not CUDA, not
    installed or not importable with this torch and Triton, or (`smoke`) failing its smoke check (fla_smoke), which
    touches the device: the launcher, which must not initialise CUDA before its workers fork, asks without it.
    Asked once per process."""
    if device_type != "cuda":
        return f"its Triton kernels need a CUDA device, and this run is on {device_type}"
    try:
        # the optional dependency (pip install flash-linear-attention)
        import fla.ops.gated_delta_rule
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # not installed, or installed for another torch or Triton
        return f"flash-linear-attention does not import ({type(e).__name__}: {e})"
    return fla_smoke(torch.device(device_type)) if smoke else None


def fla_smoke(device: torch.device) -> str | None:
    """Run flash-linear-attention's two kernels once on a tiny packed input on `device` against the chunked PyTorch
    path (float32, two documents, one decay per head and one per key channel): None where both agree to 1e-3, else
    what went wrong, so an install that imports but cannot compute here is found before training, not in it."""
    generator = torch.Generator().manual_seed(0)
    q, k = (l2_normalize(torch.randn(1, 40, 1, 16, generator=generator)).to(device) for _ in range(2))
    v = torch.randn(1, 40, 2, 16, generator=generator).to(device)
    beta = torch.rand(1, 40, 2, generator=generator).to(device)
    documents = torch.zeros(1, 40, dtype=torch.long, device=device)
    documents[:, 23:] = 1
    for g in (-torch.rand(1, 40, 2, generator=generator), -torch.rand(1, 40, 2, 16, generator=generator)):
        g = (g * 0.3).to(device)
        try:
            ours = gated_delta_rule_chunked(q, k, v, g, beta, documents=documents)[0]
            theirs = fla_rule(q, k, v, g, beta, documents)[0].float()
        except Exception as e:  # a kernel that does not compile or launch on this device
            return f"flash-linear-attention fails its check here ({type(e).__name__}: {e})"
        gap = (theirs - ours).abs().max().item()
        if not gap <= 1e-3:
            decay = "per head" if g.dim() == 3 else "per key channel"
            return f"flash-linear-attention's kernel (decay {decay}) differs from the PyTorch path by {gap:.2g} here"
    return None


def resolve_backend(choice: str, device_type: str, smoke: bool = True) -> tuple[str, str]:
    """model.linear_attn_backend `choice` ("auto", "torch", "fla") on `device_type`: the backend DeltaRule runs and,
    for the PyTorch path, why ("" for fla). "fla" where it cannot run is a ValueError saying why. `smoke`:
    fla_unavailable's."""
    if choice == "torch":
        return "torch", "model.linear_attn_backend torch"
    why = fla_unavailable(device_type, smoke)
    if choice == "fla" and why is not None:
        raise ValueError(f"model.linear_attn_backend='fla' cannot run here: {why}; use 'auto' or 'torch'")
    return ("fla", "") if why is None else ("torch", why)


def fla_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    documents: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule by flash-linear-attention's chunked Triton kernels (chunk_gated_delta_rule for a decay
    per head, chunk_kda for one per key channel), from a zero state: packed documents become one row cut at every
    document start (cu_seqlens), which the kernels compute each alone. q and k (already L2-normalised) are cast to
    v's dtype and repeated to the value heads, as the kernels take them."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional dependency (the [linear] extra)
    from fla.ops.kda import chunk_kda

    heads, key_heads = v.shape[2], k.shape[2]
    if heads != key_heads:
        q, k = (x.repeat_interleave(heads // key_heads, dim=2) for x in (q, k))
    q, k = q.to(v.dtype), k.to(v.dtype)
    kernel = chunk_gated_delta_rule if g.dim() == 3 else chunk_kda
    if documents is None:
        o, state = kernel(q, k, v, g, beta, output_final_state=True)
        return o, state
    bsz, seqlen = v.shape[:2]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]  # every row's first token starts a sequence too
    flat_starts = starts.flatten().nonzero().flatten()
    end = torch.tensor([bsz * seqlen], device=v.device)
    cu_seqlens = torch.cat([flat_starts, end]).to(torch.long)
    flat = [x.reshape(1, bsz * seqlen, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, state = kernel(*flat, cu_seqlens=cu_seqlens, output_final_state=False)
    return o.reshape(v.shape), state


class DeltaRule(nn.Module):
    """The gated delta rule over a sequence (linear_attention's arguments: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g
    [B, T, H] or [B, T, H, Dk], beta [B, T, H]), restarting at each document of `sequence`, from `state` [B, H, Dk,
    Dv] (generation; None: zeros). Returns o [B, T, H, Dv] and the final state (None where `backend` "fla" computed
    packed documents). `backend` "torch": the chunked PyTorch path, one token (a decoding step) by the recurrence
    itself; "fla": flash-linear-attention's kernels (CUDA) from a zero state, the PyTorch path from a given one."""

    def __init__(self, chunk_size: int = 64, backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"DeltaRule backend={backend!r}; use one of {', '.join(BACKENDS)}")
        self.chunk_size, self.backend = chunk_size, backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        documents = None if sequence is None else sequence.documents
        if self.backend == "fla" and state is None:
            return fla_rule(q, k, v, g, beta, documents)
        if q.shape[1] == 1:
            return gated_delta_rule_recurrent(q, k, v, g, beta, state, documents)
        return gated_delta_rule_chunked(q, k, v, g, beta, state, documents, chunk_size=self.chunk_size)

    def flops_per_token(self, heads: int, key_dim: int, value_dim: int, score_terms: int = 5) -> float:
        """Training FLOPs per token of the rule, as its chunked kernel (linear_attention.gated_delta_rule_chunked,
        chunk size C) computes it, for `heads` value heads with key width Dk and value width Dv, for each chunk of C
        tokens:

            two C x C score matrices, A (keys with keys) and Q K^T      2 x 2 C^2 Dk
            two triangular solves (I + A) X = ..., Dv and Dk columns    C^2 (Dv + Dk)
            the scores times the chunk's writes                         2 C^2 Dv
            the state read by the writes and by the queries, and
            written with the chunk's keys, a [Dk, Dv] state            3 x 2 C Dk Dv

        so per token R = 3 * H * (5 C Dk + 3 C Dv + 6 Dk Dv), x3 for backward as every matmul in the formula. One
        decay per key channel (Kimi Delta Attention) makes each score an einsum over a [C, C, Dk] decay: one multiply
        more per term, `score_terms` 7 in place of 5. T's padding to a multiple of C and the exponentials of the decays
        are not counted, as norms are not. Linear in T (a fixed C), where attention's term grows with it."""
        chunk = self.chunk_size
        forward = score_terms * chunk * key_dim + 3 * chunk * value_dim + 6 * key_dim * value_dim
        return 3.0 * heads * forward


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (module docstring): `key_heads` x `key_dim` queries and keys, `value_heads` x `value_dim`
    values, a convolution over `conv_size` tokens, one decay per value head, the output norm's epsilon `norm_eps`,
    `beta_scale` on the write strength, the output gate's activation `gate` ("silu": Qwen3.5, Qwen3-Next, OLMo
    Hybrid; "sigmoid") and how the decay starts, `decay_init`. Every projection a separate nn.Linear and each
    convolution's weight [C, K] its own parameter, so tensor parallelism splits them all by heads."""

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
        decay_init: DecayInit = QWEN_DECAY,
    ):
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"GatedDeltaNet value_heads={value_heads} must be a multiple of key_heads={key_heads}")
        if conv_size < 1:
            raise ValueError(f"GatedDeltaNet conv_size={conv_size}; it must be at least 1")
        if gate not in GATES:
            raise ValueError(f"GatedDeltaNet gate={gate!r}; use one of {', '.join(GATES)}")
        self.key_dim, self.value_dim, self.beta_scale, self.gate = key_dim, value_dim, beta_scale, gate
        self.decay_init = decay_init
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

    def sequence_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token that mix the sequence (models/common/flops.py): the gated delta rule's over this
        layer's value heads, whatever `seq_len` (its projections and convolution are parameters, counted apart)."""
        return self.rule.flops_per_token(self.wv.out_features // self.value_dim, self.key_dim, self.value_dim)

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
        if cache is not None and state is not None:
            cache.set_state("conv", conv_state)
            cache.set_state("recurrent", state)
        o = self.norm(o.to(x.dtype))  # [B, T, H, Dv]
        z = self.wz(x).view(bsz, seqlen, -1, self.value_dim).float()
        o = (o * (F.silu(z) if self.gate == "silu" else torch.sigmoid(z))).to(x.dtype)
        return self.wo(o.reshape(bsz, seqlen, -1))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """start_linear_mixer's, the decay as `decay_init` says (the output norm starts at one, its own way)."""
        inputs = ("wq", "wk", "wv", "wa", "wb", "wz")
        start_linear_mixer(name, full, generator, scheme, self.decay_init, inputs)


def start_linear_mixer(
    name: str,
    full: torch.Tensor,
    generator: torch.Generator,
    scheme: InitScheme,
    decay_init: DecayInit,
    inputs: tuple[str, ...],
) -> None:
    """Start a linear-attention mixer's parameter `name` (Gated DeltaNet's, Kimi Delta Attention's): the convolutions
    as nn.Conv1d's, the decay (A_log, dt_bias) as `decay_init` says, the projections `inputs` input-side and wo
    residual-side."""
    if name in ("conv_q", "conv_k", "conv_v"):
        start_convolution(full, generator)
    elif name in ("A_log", "dt_bias"):
        decay_init.start(name, full, generator)
    else:
        start_linears(name, full, generator, scheme, inputs=inputs, outputs=("wo",))


def gated_delta_net_of(args: GatedDeltaNetArgs, **options) -> GatedDeltaNet:
    """The Gated DeltaNet that `args` shape (their linear-layer fields: models/common/linear_attention_args.py;
    `options`: GatedDeltaNet's keywords, from norm_eps on)."""
    shape = (args.linear_key_heads, args.linear_value_heads, args.linear_key_dim, args.linear_value_dim)
    return GatedDeltaNet(args.dim, *shape, args.conv_size, **options)


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head's output [..., D], computed in float32 and cast back before the weight multiplies it (the
    product left in the weight's dtype for the gate that follows), as the hybrid families' gated norms compute it."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        scheme.norm(name, full)
