"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual stream as `n` streams [B, T, n, D] instead of
one [B, T, D]. Each sublayer reads a learned mix of the streams and writes its output back into each of them with a
learned gain, while the streams themselves pass on through an n x n mixing matrix kept doubly stochastic by Sinkhorn's
iterations, so the stream's norm cannot grow layer after layer. A hyper-head folds the streams into one before the
final norm. Plain modules with no parallelism inside.

How a decoder declares its residual (titanlite/models/common/decoder.py `Transformer.build_streams` and `widen`):
the embedded tokens widened into the streams before the first layer (`widen_streams`: copied into each), folded into
one after the last by the hyper-head (`HyperStreams`), each block reading and writing through its own mixings
(`HyperConnection`, used by `HyperBlock`). One stream, the default, is no module at all. Multi-token prediction
over the streams: `HyperMultiTokenProjection`."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] in float32 scaled to unit root mean square (no weight)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


def start_mixing(owner: str, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
    """A stream mixing's parameters as transformers starts them: fn normal of the scheme's std, base at zero, the
    scale(s) at one."""
    if name == "fn":
        scheme.normal(full, generator)
    elif name == "base":
        nn.init.zeros_(full)
    elif name == "scale":
        nn.init.ones_(full)
    else:
        raise KeyError(f"{owner} has no parameter {name!r}")


def sinkhorn(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """A doubly stochastic matrix [..., n, n] from logits: a softmax over each row (plus eps), then the columns and
    the rows normalised in turn, `iterations` column normalisations in all (the first before any row's)."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


class HyperConnection(nn.Module):
    """One sublayer's read and write of `n` streams of width `dim`: from the streams' flattened, unit-RMS values a
    linear map `fn` [(2 + n) n, n dim] (plus `base`) gives per token the read weights `pre` [n] (sigmoid, plus eps),
    the write gains `post` [n] (2 sigmoid) and the mixing matrix `comb` [n, n] (Sinkhorn's), each logit group
    times its own `scale` [3]. All in float32 (the parameters are kept and read as such)."""

    def __init__(self, n: int, dim: int, iterations: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iterations, self.eps, self.norm_eps = n, iterations, eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * dim))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_mixing(type(self).__name__, name, full, generator, scheme)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, n, D] -> (the sublayer's input [B, T, D] in the streams' dtype, post [B, T, n] and comb
        [B, T, n, n] in float32)."""
        n = self.n
        mixes = F.linear(_unit_rms(streams.flatten(2), self.norm_eps), self.fn.float())  # [B, T, (2 + n) n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), self.iterations, self.eps)
        read = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return read, post, comb

    @staticmethod
    def write(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: stream k gets post[k] times its output plus sum_j comb[j, k] streams[j]."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def widen_streams(h: torch.Tensor, n: int) -> torch.Tensor:
    """The embedded tokens [B, T, D] copied into each of `n` streams [B, T, n, D]."""
    return h.unsqueeze(2).expand(-1, -1, n, -1).contiguous()


class HyperStreams(nn.Module):
    """The hyper-head of a decoder's residual of `n` streams (the module docstring): forward folds them into one
    [B, T, D] with per-token weights sigmoid(fn . x * scale + base) + eps from their flattened unit-RMS values
    (`fn` [n, n D], `base` [n], `scale` [1], float32)."""

    def __init__(self, n: int, dim: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.eps, self.norm_eps = n, eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * dim))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_mixing(type(self).__name__, name, full, generator, scheme)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """Fold the streams [B, T, n, D] into one [B, T, D]."""
        mixes = F.linear(_unit_rms(streams.flatten(2), self.norm_eps), self.fn.float())  # [B, T, n]
        weights = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (weights.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


class HyperBlock(nn.Module):
    """A layer over `n` streams: the mixer and the feed-forward, each behind its pre-norm, each reading and writing
    the streams through its HyperConnection (`attention_hc`, `ffn_hc`). Its parts are named as Block's
    (`attention_norm`, `attention`, `ffn_norm`, `feed_forward`), so plans and checkpoints name them alike.
    `feed_forward_reads_tokens`: the feed-forward takes the layer's token ids (a mixture of experts routed by a
    token table: moe/layer.py HashRouter), handed to forward as `tokens`."""

    def __init__(
        self,
        mixer: nn.Module,
        feed_forward: nn.Module,
        norm: Callable[[], nn.Module],
        connection: Callable[[], HyperConnection],
        feed_forward_reads_tokens: bool = False,
    ):
        super().__init__()
        self.reads_tokens = feed_forward_reads_tokens
        self.attention_hc = connection()
        self.attention_norm = norm()
        self.attention = mixer
        self.ffn_hc = connection()
        self.ffn_norm = norm()
        self.feed_forward = feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        read, post, comb = self.attention_hc(x)
        y = self.attention(self.attention_norm(read), cos, sin, cache=cache, sequence=sequence)
        x = HyperConnection.write(x, y, post, comb)
        read, post, comb = self.ffn_hc(x)
        y = self.ffn_norm(read)
        y = self.feed_forward(y, tokens=tokens) if self.reads_tokens else self.feed_forward(y)
        return HyperConnection.write(x, y, post, comb)


class HyperMultiTokenProjection(nn.Module):
    """What surrounds a multi-token prediction depth's block over `n` streams (DeepSeek-V4's MTP layer; the interface
    of models/common/multi_token.py MultiTokenProjection): the block's input streams are h_proj(hnorm(stream)) for
    each of the previous depth's streams (depth 1: the main model's, before its hyper-head: reads_residual) plus
    e_proj(enorm(embedding of the token ahead)), the same in every stream; its output streams are folded by the
    depth's own hyper-head (`streams`) and normed (`norm`) for the shared head, and handed whole to the next depth."""

    reads_residual: ClassVar[bool] = True

    def __init__(self, n: int, dim: int, norm: Callable[[], nn.Module], eps: float, norm_eps: float):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.streams = HyperStreams(n, dim, eps, norm_eps)
        self.norm = norm()

    def forward(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """embedded [B, T, D] and streams [B, T, n, D] -> the block's input streams [B, T, n, D]."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(-2) + self.h_proj(self.hnorm(streams))

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output streams x -> (what the head reads: folded and normed, the next depth's streams: x)."""
        return self.norm(self.streams(x)), x

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """e_proj and h_proj input-side (the norms and the hyper-head start as their own kinds do)."""
        start_linears(name, full, generator, scheme, inputs=("e_proj", "h_proj"), outputs=())
