"""The state-space mixer of the hybrid families: Mamba-2 (state-space duality, Dao & Gu 2024), a layer kind of the
shared decoder (titanlite/models/common/decoder.py) beside attention (Nemotron-H). Plain modules with no parallelism
inside.

Per token x [dim]: projections give the gate z and the input xs [H, P] (H heads of width P), B and C [G, N] (G groups
of state width N; head h reads group h // (H / G)) and one step size per head dt. A short causal depthwise
convolution (with a bias) and SiLU run over xs, B and C together. dt = clamp(softplus(dt + dt_bias), dt_min, dt_max);
A = -exp(A_log) per head. Each head keeps a state S [N, P]:

    S = exp(dt A) S + B (dt xs)^T;    y = S^T C + D xs

which is linear attention with one decay per head (q = C, k = B, v = dt xs, log-decay g = dt A) and no write
correction, so the kernels here are the gated delta rule's (titanlite/models/common/linear_attention.py) without its
triangular solve. y [H, P] is flattened, gated by SiLU(z) and normalised by an RMSNorm over each of `norm_groups`
slices of the width (the gate before the norm or after it, as the family says), then projected back to dim.

Two parameter-free cores do the sequence work, so context parallelism (titanlite/parallel/context_parallel.py) can
wrap them: the gated delta net's `ShortConvolution` and `StateScan` (the recurrence). With a block-causal `Sequence`
both restart at every document start, so packed documents are computed as if each were alone. With a cache
(generation) the layer keeps its state S and its convolution's last inputs (`LayerCache.state`)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.gated_delta_net import BACKENDS, ShortConvolution, local, start_convolution
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.linear_attention import document_starts
from titanlite.models.common.mamba2_args import Mamba2Args

CONVOLVED = ("conv_x", "conv_b", "conv_c")  # the convolution's weights [C, K], by the channels they read
CONVOLVED_BIASES = ("conv_x_bias", "conv_b_bias", "conv_c_bias")


def _shaped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None,
    grouped: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, T, ...] and g [B, H, T, 1] in the computing dtype (float32; float64 where an input is), q and k
    repeated from their G groups to the H heads (`grouped`: left as [B, G, T, N]); and the state the window starts
    from (zeros where None)."""
    batch, length, groups, state_dim = k.shape
    heads, head_dim = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (batch, length) or heads % groups:
        raise ValueError(
            f"C {tuple(q.shape)} and B {tuple(k.shape)} must be equal [B, T, G, N], x {tuple(v.shape)} [B, T, H, P] "
            "with H a multiple of G"
        )
    if g.shape != (batch, length, heads):
        raise ValueError(f"the log-decay {tuple(g.shape)} must be [B, T, H] = {[batch, length, heads]}")
    state_shape = (batch, heads, state_dim, head_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be [B, H, N, P] = {list(state_shape)}")
    dtype = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in (q, k, v, g)) else torch.float32
    if heads != groups and not grouped:
        q, k = (t.repeat_interleave(heads // groups, dim=2) for t in (q, k))
    q, k, v, g = (t.transpose(1, 2).to(dtype) for t in (q, k, v, g.unsqueeze(-1)))
    state = torch.zeros(state_shape, dtype=dtype, device=v.device) if initial_state is None else initial_state
    return q, k, v, g, state.to(dtype)


def ssd_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence one token at a time: S = exp(g_t) S + k_t v_t^T, o_t = S^T q_t. q (C), k (B) [B, T, G, N];
    v (dt x) [B, T, H, P], H a multiple of G (head h reads group h // (H / G)); g (dt A, <= 0) [B, T, H];
    initial_state [B, H, N, P] (None: zeros); `documents` [B, T] (attention.Sequence.documents): the state goes back
    to zero at each token whose document is not the previous token's, so every packed document is computed as if
    alone, the first one continuing initial_state.

    Returns o [B, T, H, P] in v's dtype and the final state [B, H, N, P] in the computing dtype (float32, float64 for
    float64 inputs), the dtype a generation cache keeps it in. The reference, and the kernel of a decoding step."""
    out_dtype = v.dtype
    q, k, v, g, state = _shaped(q, k, v, g, initial_state)
    keep = None if documents is None else (~document_starts(documents)).to(state.dtype)
    outputs = []
    for t in range(v.shape[2]):
        if keep is not None:
            state = state * keep[:, t, None, None, None]
        state = state * g[:, :, t, :, None].exp() + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(torch.einsum("bhnp,bhn->bhp", state, q[:, :, t]))
    return torch.stack(outputs, dim=1).to(out_dtype), state


def ssd_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssd_recurrent` (same arguments, same results) chunk_size tokens at a time, T padded to a multiple of it.

    With D_i the decay from a chunk's start through token i and S0 the state before the chunk, token i's output is
    (D_i q_i)^T S0 + sum_{j <= i} (D_i / D_j) (q_i . k_j) v_j: a masked, decayed attention inside the chunk (the
    quadratic, "dual" form) plus a read of the carried state; the chunk hands on D_C S0 + sum_j (D_C / D_j) k_j v_j^T.
    Every chunk's inner terms are computed at once, C . B once per group (the heads of a group share it; only their
    decays differ), and neither C nor B is repeated to the heads; only the step from one chunk's state to the next, a
    [N, P] product per head, is sequential. Documents mask the pairs that straddle a document start, keep S0 from the
    tokens after one, and keep the chunk's state from passing through it."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be at least 1")
    out_dtype = v.dtype
    q, k, v, g, state = _shaped(q, k, v, g, initial_state, grouped=True)
    batch, heads, length, head_dim = v.shape
    groups, state_dim = q.shape[1], q.shape[3]
    per = heads // groups  # head h = group h // per, so [B, H] views as [B, G, per]
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size
    # C and B once per group ([B, G, 1, N, C, N_state]), the values and decays per head ([B, G, per, N, C, ...])
    q, k = (F.pad(t, (0, 0, 0, pad)).reshape(batch, groups, 1, chunks, chunk_size, -1) for t in (q, k))
    v, g = (F.pad(t, (0, 0, 0, pad)).reshape(batch, groups, per, chunks, chunk_size, -1) for t in (v, g))
    state = state.reshape(batch, groups, per, state_dim, head_dim)

    # Each token's document counted from its chunk's first (0: the one the chunk starts in); the padding adds none.
    starts = torch.zeros(batch, length + pad, dtype=torch.int64, device=v.device)
    if documents is not None:
        starts[:, :length] = document_starts(documents)
    segment = starts.reshape(batch, 1, 1, chunks, chunk_size).cumsum(dim=-1)  # [B, 1, 1, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    reads = causal & (segment[..., :, None] == segment[..., None, :])  # token i reads what token j wrote
    first = (segment == 0)[..., None]  # the tokens that read the state carried into the chunk
    last = (segment == segment[..., -1:])[..., None]  # the tokens whose writes the chunk carries out
    through = first[..., -1, :]  # [B, 1, 1, N, 1]: one document throughout, the carried state passes through

    decay = g.cumsum(dim=4)  # [B, G, per, N, C, 1]: the log of D_i
    # The gaps are masked before the exponential: those where j is after i are positive and could overflow.
    gap = (decay[..., :, None, 0] - decay[..., None, :, 0]).masked_fill(~reads, float("-inf"))
    inner = ((q @ k.transpose(-1, -2)) * gap.exp()) @ v  # C . B per group, decayed per head: [B, G, per, N, C, P]
    written = k.transpose(-1, -2) @ (v * ((decay[..., -1:, :] - decay).exp() * last))  # [B, G, per, N, N_state, P]
    chunk_decay = (decay[..., -1, :].exp() * through)[..., None]  # [B, G, per, N, 1, 1]
    incoming = []
    for n in range(chunks):
        incoming.append(state)
        state = chunk_decay[:, :, :, n] * state + written[:, :, :, n]
    o = inner + (q @ torch.stack(incoming, dim=3)) * (decay.exp() * first)
    o = o.reshape(batch, heads, chunks * chunk_size, head_dim)[:, :, :length]
    return o.transpose(1, 2).to(out_dtype), state.reshape(batch, heads, state_dim, head_dim)


def fla_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, documents: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD scan by flash-linear-attention's chunked Triton kernel for gated linear attention with one decay per
    head (chunk_simple_gla, at scale 1: Mamba-2's C . B is not scaled), from a zero state: packed documents become one
    row cut at every document start (cu_seqlens), which the kernel computes each alone (then no final state is
    returned). C and B are repeated from their groups to the heads and cast to the values' dtype, as it takes them."""
    from fla.ops.simple_gla import chunk_simple_gla  # optional dependency (the [linear] extra)

    heads, groups = v.shape[2], k.shape[2]
    if heads != groups:
        q, k = (t.repeat_interleave(heads // groups, dim=2) for t in (q, k))
    q, k = q.to(v.dtype), k.to(v.dtype)
    if documents is None:
        o, state = chunk_simple_gla(q, k, v, g, scale=1.0, output_final_state=True)
        return o, state.transpose(-1, -2) if state is not None else None  # its state is [N, P] as ours
    bsz, seqlen = v.shape[:2]
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]  # every row's first token starts a sequence too
    cu_seqlens = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([bsz * seqlen], device=v.device)])
    flat = [t.reshape(1, bsz * seqlen, *t.shape[2:]) for t in (q, k, v, g)]
    o, _ = chunk_simple_gla(*flat, scale=1.0, cu_seqlens=cu_seqlens.to(torch.long), output_final_state=False)
    return o.reshape(v.shape), None


@functools.cache
def fla_scan_unavailable(device_type: str, smoke: bool = True) -> str | None:
    """Why flash-linear-attention's scan kernel (chunk_simple_gla) cannot run on `device_type` here (None: it can):
    not CUDA, not importable, or (`smoke`) its result on a tiny packed input differing from ssd_chunked's by more than
    1e-3 (the launcher asks without the smoke check, which touches the device). Asked once per process."""
    if device_type != "cuda":
        return f"its Triton kernels need a CUDA device, and this run is on {device_type}"
    try:
        import fla.ops.simple_gla  # noqa: F401  (the optional dependency: pip install flash-linear-attention)
    except Exception as e:  # not installed, or installed for another torch or Triton
        return f"flash-linear-attention's simple_gla does not import ({type(e).__name__}: {e})"
    if not smoke:
        return None
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 40, 1, 16, generator=generator).cuda() for _ in range(2))
    v = torch.randn(1, 40, 2, 16, generator=generator).cuda()
    g = (-0.3 * torch.rand(1, 40, 2, generator=generator)).cuda()
    documents = torch.zeros(1, 40, dtype=torch.long, device="cuda")
    documents[:, 23:] = 1
    try:
        ours = ssd_chunked(q, k, v, g, documents=documents)[0]
        theirs = fla_scan(q, k, v, g, documents)[0].float()
    except Exception as e:  # a kernel that does not compile or launch on this device
        return f"flash-linear-attention's scan fails its check here ({type(e).__name__}: {e})"
    gap = (theirs - ours).abs().max().item()
    return None if gap <= 1e-3 else f"flash-linear-attention's scan differs from the PyTorch path by {gap:.2g} here"


class StateScan(nn.Module):
    """The SSD scan over a sequence (ssd_chunked's arguments: q, k [B, T, G, N], v [B, T, H, P], g [B, T, H]),
    restarting at each document of `sequence`, from `state` [B, H, N, P] (generation; None: zeros). Returns o
    [B, T, H, P] and the final state (None where `backend` "fla" computed packed documents). `backend` "torch": one
    token (a decoding step) by the recurrence itself, more by the chunked path in chunks of `chunk_size`; "fla":
    flash-linear-attention's kernel (CUDA) from a zero state, the PyTorch path from a given one
    (model.linear_attn_backend, which says how the gated delta rule computes too)."""

    def __init__(self, chunk_size: int = 64, backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"StateScan backend={backend!r}; use one of {', '.join(BACKENDS)}")
        self.chunk_size, self.backend = chunk_size, backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        sequence: Sequence | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        documents = None if sequence is None else sequence.documents
        if self.backend == "fla" and state is None:
            return fla_scan(q, k, v, g, documents)
        if v.shape[1] == 1:
            return ssd_recurrent(q, k, v, g, state, documents)
        return ssd_chunked(q, k, v, g, state, documents, chunk_size=self.chunk_size)

    def flops_per_token(self, heads: int, groups: int, state_dim: int, head_dim: int) -> float:
        """Training FLOPs per token of the scan as ssd_chunked computes it, for `heads` heads of width P reading
        `groups` groups of B and C over a state of width N, for each chunk of C tokens:

            the C x C scores C B^T, once per group                   2 C^2 N
            the decayed scores times the chunk's values, per head    2 C^2 P
            the chunk's writes into its [N, P] state, per head       2 C N P
            the carried state read by the chunk's queries, per head  2 C N P

        so per token R = 3 * (2 C N G + H (2 C P + 4 N P)), x3 for backward as every matmul in the formula. The
        decays' exponentials, the masks, T's padding to a multiple of C and the one [N, P] update per chunk are not
        counted, as norms are not. Linear in T (a fixed C), where attention's term grows with it."""
        chunk = self.chunk_size
        return 3.0 * (2 * chunk * state_dim * groups + heads * (2 * chunk * head_dim + 4 * state_dim * head_dim))


class GroupedGatedRMSNorm(nn.Module):
    """Mamba-2's output norm: x [..., W] gated by SiLU(z) before the norm (or after it, `norm_before_gate`), each of
    `groups` equal slices of W normalised by its own RMS, times a weight [W]; computed in float32, returned in x's
    dtype (transformers' Nemotron-H and Falcon-H1 gated norms). Under tensor parallelism each rank holds whole groups
    of the width (the weight sharded with them), so it is the same module on the local width."""

    def __init__(self, width: int, groups: int = 1, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        if width % groups:
            raise ValueError(f"GroupedGatedRMSNorm width={width} must be a multiple of groups={groups}")
        self.group_size, self.eps, self.norm_before_gate = width // groups, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = F.silu(z.float())
        y = x.float() if self.norm_before_gate else x.float() * gate
        shape = y.shape
        y = F.rms_norm(y.view(*shape[:-1], -1, self.group_size), (self.group_size,), eps=self.eps).view(shape)
        y = local(self.weight).float() * y
        return (y * gate if self.norm_before_gate else y).to(x.dtype)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        scheme.norm(name, full)


def _times(t: torch.Tensor, multiplier: float) -> torch.Tensor:
    """`t` times a multiplier of the projections (Mamba2's `multipliers`); `t` itself where it is one."""
    return t if multiplier == 1.0 else t * multiplier


def start_step_bias(
    full: torch.Tensor, generator: torch.Generator, dt_range: tuple[float, float], floor: float
) -> None:
    """dt_bias as Mamba-2 starts it: the softplus inverse of a step log-uniform in `dt_range`, floored at `floor`."""
    low, high = math.log(dt_range[0]), math.log(dt_range[1])
    dt = torch.empty_like(full).uniform_(low, high, generator=generator).exp_().clamp_(min=floor)
    full.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt


class Mamba2(nn.Module):
    """The Mamba-2 mixer (module docstring): `heads` x `head_dim` inputs, `groups` x `state_dim` B and C, a
    convolution over `conv_size` tokens (with a bias where `conv_bias`), the step clamped to `dt_limit`, biases on the
    projections where `bias` (on the output projection where `out_bias`, `bias` when None), the output norm over
    `norm_groups` slices (`norm_eps`, the gate before the norm where not `norm_before_gate`), the scan in chunks of
    `chunk_size`. Every projection a separate nn.Linear and each convolution's weight its own parameter, so tensor
    parallelism splits them by heads and groups; dt_bias starts log-uniform in `dt_init` floored at `dt_floor`, A_log
    at log(1..H), D at one (Mamba-2's).

    Falcon-H1's options: `multipliers`, five numbers (z, x, B, C, dt) each projection's output is multiplied by (its
    ssm_multipliers, transformers' mup_vector), before the convolution, the gate and the step's bias; `gated_norm`
    False, no output norm (its mamba_rms_norm false): the scan's output is gated by SiLU(z) alone."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        groups: int,
        state_dim: int,
        conv_size: int = 4,
        *,
        conv_bias: bool = True,
        bias: bool = False,
        out_bias: bool | None = None,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        norm_groups: int | None = None,
        norm_eps: float = 1e-5,
        norm_before_gate: bool = False,
        gated_norm: bool = True,
        multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0),
        chunk_size: int = 64,
        dt_init: tuple[float, float] = (0.001, 0.1),
        dt_floor: float = 1e-4,
    ):
        super().__init__()
        if heads % groups:
            raise ValueError(f"Mamba2 heads={heads} must be a multiple of groups={groups}")
        if conv_size < 1:
            raise ValueError(f"Mamba2 conv_size={conv_size}; it must be at least 1")
        if len(multipliers) != 5:
            raise ValueError(f"Mamba2 multipliers={multipliers}; give five, of z, x, B, C and dt")
        self.head_dim, self.state_dim, self.dt_limit = head_dim, state_dim, dt_limit
        self.multipliers = tuple(multipliers)
        self.dt_init, self.dt_floor = dt_init, dt_floor
        width, bc_width = heads * head_dim, groups * state_dim
        self.wz = nn.Linear(dim, width, bias=bias)  # the gate's
        self.wx = nn.Linear(dim, width, bias=bias)
        self.wb = nn.Linear(dim, bc_width, bias=bias)
        self.wc = nn.Linear(dim, bc_width, bias=bias)
        self.wdt = nn.Linear(dim, heads, bias=bias)
        for name, channels in zip(CONVOLVED, (width, bc_width, bc_width)):
            self.register_parameter(name, nn.Parameter(torch.empty(channels, conv_size)))
        for name, channels in zip(CONVOLVED_BIASES, (width, bc_width, bc_width)):
            self.register_parameter(name, nn.Parameter(torch.empty(channels)) if conv_bias else None)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        norm_groups = groups if norm_groups is None else norm_groups
        self.norm: GroupedGatedRMSNorm | None = (
            GroupedGatedRMSNorm(width, norm_groups, norm_eps, norm_before_gate) if gated_norm else None
        )
        self.wo = nn.Linear(width, dim, bias=bias if out_bias is None else out_bias)
        self.conv = ShortConvolution()  # context parallelism wraps these two
        self.scan = StateScan(chunk_size)

    def sequence_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token that mix the sequence (models/common/flops.py): the scan's over this layer's
        heads, whatever `seq_len` (its projections and convolution are parameters, counted apart)."""
        groups = self.wb.out_features // self.state_dim
        return self.scan.flops_per_token(self.wdt.out_features, groups, self.state_dim, self.head_dim)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, sequence: Sequence | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        mz, mx, mb, mc, mdt = self.multipliers
        # this rank's heads and groups under tensor parallelism
        xs, b, c = _times(self.wx(x), mx), _times(self.wb(x), mb), _times(self.wc(x), mc)
        widths = [xs.shape[-1], b.shape[-1], c.shape[-1]]
        weight = torch.cat([local(getattr(self, name)) for name in CONVOLVED])
        biases = [getattr(self, name) for name in CONVOLVED_BIASES]
        bias = torch.cat([local(t) for t in biases]) if biases[0] is not None else None
        conv_state = None if cache is None else cache.state("conv")
        xbc, conv_state = self.conv(torch.cat([xs, b, c], dim=-1), weight, sequence, conv_state, bias)
        xs, b, c = xbc.split(widths, dim=-1)
        xs = xs.view(bsz, seqlen, -1, self.head_dim)  # [B, T, H, P]
        dt = _times(self.wdt(x), mdt).float() + local(self.dt_bias).float()
        dt = F.softplus(dt).clamp(*self.dt_limit)  # [B, T, H]
        g = -local(self.A_log).float().exp() * dt
        v = xs.float() * dt[..., None]
        k, q = (t.view(bsz, seqlen, -1, self.state_dim) for t in (b, c))  # [B, T, G, N]
        state = None if cache is None else cache.state("recurrent")
        y, state = self.scan(q, k, v, g, sequence, state)
        if cache is not None:
            cache.set_state("conv", conv_state)
            cache.set_state("recurrent", state)
        y = (y + local(self.D).float()[:, None] * xs.float()).reshape(bsz, seqlen, -1)
        z = _times(self.wz(x), mz)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.wo(y.to(x.dtype))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The projections input-side and wo residual-side, the convolution as nn.Conv1d starts one (its biases at
        zero), dt_bias log-uniform (start_step_bias), A_log at log(1..H), D at one."""
        if name in CONVOLVED:
            start_convolution(full, generator)
        elif name in CONVOLVED_BIASES:
            nn.init.zeros_(full)
        elif name == "dt_bias":
            start_step_bias(full, generator, self.dt_init, self.dt_floor)
        elif name == "A_log":
            full.copy_(torch.arange(1, full.numel() + 1, dtype=full.dtype).log())
        elif name == "D":
            nn.init.ones_(full)
        else:
            start_linears(name, full, generator, scheme, inputs=("wz", "wx", "wb", "wc", "wdt"), outputs=("wo",))


def mamba2_of(args: Mamba2Args, **options) -> Mamba2:
    """The Mamba-2 mixer that `args` shape (their Mamba fields: models/common/mamba2_args.py; the output norm's epsilon
    the decoder's norm_eps); `options`: Mamba2's keywords a family sets beyond them (Falcon-H1's multipliers)."""
    return Mamba2(
        args.dim,
        args.mamba_heads,
        args.mamba_head_dim,
        args.mamba_groups,
        args.state_dim,
        args.conv_size,
        conv_bias=args.conv_bias,
        bias=args.mamba_bias,
        dt_limit=(args.dt_min, args.dt_max),
        norm_groups=args.mamba_norm_groups,
        norm_eps=args.norm_eps,
        chunk_size=args.mamba_chunk_size,
        dt_init=(args.dt_init_min, args.dt_init_max),
        dt_floor=args.dt_init_floor,
        **options,
    )
