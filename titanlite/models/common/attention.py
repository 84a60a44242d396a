"""Causal self-attention and the positions it needs: which tokens a query may see (earlier ones, and with a
block-causal mask only those of its own document), and where each token stands in its sequence.

`Sequence` describes the tokens a forward pass holds: by default positions 0..T-1 of whole sequences, plain
causal. Each block's attention runs through a core chosen by name (`build_core`, `ATTENTION_CORES`): "sdpa"
(scaled_dot_product_attention: the fused causal kernel, or a dense [B, 1, T, S] additive mask for anything else)
or "flex" (FlexAttention: the same masks described by a function of the query and key index, built into a
block mask, never a T x S tensor). Context parallelism (titanlite/parallel/context_parallel.py) hands a rank
part of each sequence and gathers the keys and values of the rest; it does so by wrapping each block's core,
whichever it is, and by the positions it gives here. The model itself knows nothing of it.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from titanlite.base.errors import ConfigError

ATTENTION_MASKS = ("causal", "block_causal")


class MaskCache:
    """The masks built for one Sequence, by (queries, keys, dtype), held weakly: a mask lives as long as a
    block keeps it for its backward, so without activation checkpointing every block shares one, and with
    it each block builds its own and frees it. A plain holder, not a dict: FSDP's forward hooks rebuild a
    Sequence for every block and copy the containers they find in it, but hand this on as it is."""

    def __init__(self):
        self.by_shape: dict[tuple, weakref.ref] = {}
        self.block_masks: dict[tuple, BlockMask] = {}  # FlexAttention's, by (queries, keys, device, window)

    def get(self, key: tuple) -> torch.Tensor | None:
        ref = self.by_shape.get(key)
        return None if ref is None else ref()

    def put(self, key: tuple, mask: torch.Tensor) -> torch.Tensor:
        self.by_shape[key] = weakref.ref(mask)
        return mask


@dataclass
class Sequence:
    """Where the forward pass's tokens stand. `positions` [T]: each query token's position in its sequence
    (None: 0..T-1); `documents` [B, T]: each query token's document index (None: one document, plain causal).
    `key_positions` [S] and `key_documents` [B, S]: the same for the keys attention sees, when they are not
    the queries' own (context parallelism gathers them from the other ranks)."""

    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    key_documents: torch.Tensor | None = None

    TENSORS = ("positions", "documents", "key_positions", "key_documents")  # the fields above (not a field)

    # The additive masks built from these (additive_mask): blocks that keep one for their backward share
    # it (SDPA would convert a bool mask, and keep the copy, once per block).
    masks: MaskCache = field(default_factory=lambda: MaskCache(), repr=False, compare=False)

    def batch_major(self, batch: int) -> dict[str, torch.Tensor]:
        """The set fields as [batch, ...] tensors (positions repeated per sequence, as views), so that cutting
        every one along dim 0 cuts the batch: how a pipeline schedule hands them to its micro-batches."""
        fields = {name: getattr(self, name) for name in self.TENSORS}
        return {
            name: value.expand(batch, -1) if name.endswith("positions") else value
            for name, value in fields.items()
            if value is not None
        }

    @classmethod
    def from_batch_major(cls, **fields: torch.Tensor) -> Sequence | None:
        """The Sequence `batch_major` gave these fields for (any slice of the batch); None without fields."""
        if not fields:
            return None
        # The fields are TENSORS' names (batch_major's), never `masks`, which mypy cannot tell from their type.
        return cls(**{name: value[0] if name.endswith("positions") else value for name, value in fields.items()})  # type: ignore[arg-type]

    @property
    def plain(self) -> bool:
        """Whole sequences from position 0, one document each: the fused causal kernel applies."""
        return self.positions is None and self.documents is None and self.key_positions is None


def document_ids(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """[B, T] index of each token's document: the end-of-text id closes a document (it belongs to the one it
    ends), so a token's document is the count of end-of-text ids before it."""
    ends = (tokens == eot_id).to(torch.int32)
    return torch.cumsum(ends, dim=1) - ends


class CoreAttention(nn.Module):
    """What every attention core is: attention of queries q [B, Hq, T, hd] over keys and values
    [B, Hkv, S, hd] (Hq a multiple of Hkv: grouped-query attention) with the mask `sequence` describes (None:
    whole sequences, plain causal), giving [B, Hq, T, hd]. A block may ask for a sliding `window` (a query sees
    the keys fewer than `window` positions before it, itself included), a logit `softcap` (scores become
    softcap x tanh(scores / softcap) before the mask), a `scale` of the scores (default hd^-0.5) and attention
    `sinks` (gpt-oss): forward then takes `sinks` [Hq], one learned logit per query head that joins each query's
    softmax denominator and contributes no value (with sink logit s: out = sum_j e^(x_j) v_j / (e^s + sum_j
    e^(x_j))). A core has no parameters or buffers (the sink logits are the block's, handed in), so choosing
    another, or wrapping one (context parallelism), leaves a model's state dict as it is."""

    def __init__(
        self,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        self.window, self.softcap, self.scale, self.sinks = window, softcap, scale, sinks

    def options(self) -> dict:
        """What the block asked of its attention: build_core(another name, **options) builds its equal."""
        return {"window": self.window, "softcap": self.softcap, "scale": self.scale, "sinks": self.sinks}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequence: Sequence | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is an attention core without a forward")


def attend(
    core: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """core(q, k, v, sequence), with the sink logits only where there are some: a core that takes none (one
    registered outside titanlite) keeps its four-argument forward."""
    return core(q, k, v, sequence) if sinks is None else core(q, k, v, sequence, sinks=sinks)


def local_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """This rank's heads' sink logits: under tensor parallelism the parameter is a DTensor sharded by head, and the
    core sees this rank's heads only (the gradient flows back into the shard)."""
    return sinks.to_local() if isinstance(sinks, DTensor) else sinks


class SDPAttention(CoreAttention):
    """scaled_dot_product_attention: the fused causal kernel for plain sequences, an additive mask otherwise
    (a window too); grouped-query attention (query head j reads key/value head j // (Hq / Hkv)) inside the kernel,
    without copying K and V per head. With a logit softcap or sinks, which SDPA cannot apply, the scores are
    computed explicitly ([B, H, T, S]): correct, and what "flex" exists to avoid."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequence: Sequence | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        plain = (sequence is None or sequence.plain) and self.window is None
        explicit = self.softcap is not None or sinks is not None
        if plain and not explicit:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        seq = sequence if sequence is not None else _PLAIN_SEQUENCE  # plain causal with a window: masks shared
        if explicit:
            allowed = attention_mask(seq, q.shape[2], k.shape[2], q.device, self.window)
            return _attend_block(q, k, v, allowed, self.softcap, self.scale, sinks)
        mask = additive_mask(seq, q.shape[2], k.shape[2], q.dtype, q.device, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)


class FlexAttention(CoreAttention):
    """FlexAttention: the mask is a function of (batch, query index, key index) (`mask_function`: causal by
    position, within the window, the same document under a block-causal mask), built into a BlockMask once per
    batch and shape, so no [T, S] mask is ever materialised and the blocks a mask leaves out are skipped; the
    softcap is a score modification inside the kernel. On CUDA it runs torch's compiled flex_attention (a Triton
    kernel); sinks there rescale its output by the log-sum-exp it returns (flex_with_sinks). torch has no
    FlexAttention backward on the CPU, so there the same mask runs through `blockwise_attention`: each block of
    queries over the keys it may see, recomputed in backward, the same numbers to rounding."""

    BLOCK = 128  # queries per block, as FlexAttention's block mask counts them
    CHUNK = 1024  # keys per chunk of the CPU path's online softmax

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sequence: Sequence | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if q.device.type == "cuda":
            block_mask = flex_block_mask(sequence, q.shape[0], q.shape[2], k.shape[2], q.device, self.window)
            cap = self.softcap
            score_mod = None if cap is None else (lambda score, b, h, q_idx, k_idx: cap * torch.tanh(score / cap))
            return flex_with_sinks(compiled_flex_attention(), q, k, v, block_mask, score_mod, self.scale, sinks)
        return blockwise_attention(
            q, k, v, sequence, self.BLOCK, self.window, self.softcap, self.scale, sinks, self.CHUNK
        )


def flex_with_sinks(attention, q, k, v, block_mask: BlockMask, score_mod, scale: float | None, sinks):
    """`attention` (torch's flex_attention, compiled or not) of q over k, v; with sinks [Hq], its output times
    sigmoid(lse - sink) per query and head, lse the log-sum-exp of the query's scores it returns: the softmax's
    denominator Z becomes Z + e^sink, so every weight, and the output, scale by Z / (Z + e^sink) =
    sigmoid(lse - sink). Exact, gradients included (flex_attention differentiates its lse)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        return attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    keep = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # [B, Hq, T]
    return (out * keep[..., None].to(out.dtype)).to(out.dtype)


# The attention cores by name: what a family's blocks build (build_core).
ATTENTION_CORES: dict[str, type[CoreAttention]] = {"sdpa": SDPAttention, "flex": FlexAttention}


def build_core(
    name: str,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: bool = False,
):
    """A new attention core of the kind registered as `name` in ATTENTION_CORES, with the block's options."""
    if name not in ATTENTION_CORES:
        raise ConfigError(f"attention core {name!r} is not a known one; use one of: {', '.join(ATTENTION_CORES)}")
    extra = {"sinks": True} if sinks else {}  # a core registered outside titanlite may not take sinks
    return ATTENTION_CORES[name](window=window, softcap=softcap, scale=scale, **extra)


def additive_mask(
    sequence: Sequence, queries: int, keys: int, dtype: torch.dtype, device, window: int | None = None
) -> torch.Tensor:
    """attention_mask as the float SDPA adds to the scores (0 where a query may attend, -inf elsewhere),
    shared by every block that keeps it (MaskCache); under torch.compile built in each block's graph."""
    key = (queries, keys, dtype, str(device), window)
    compiling = torch.compiler.is_compiling()
    mask = None if compiling else sequence.masks.get(key)
    if mask is None:
        allowed = attention_mask(sequence, queries, keys, device, window)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        if not compiling:
            sequence.masks.put(key, mask)
    return mask


def attention_mask(
    sequence: Sequence, queries: int, keys: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """[B or 1, 1, T, S] bool, True where a query may attend: keys at or before its position (fewer than
    `window` positions before it), and, with documents, only those of its own document."""
    allowed = mask_function(sequence, queries, device, window)
    q_idx, k_idx = torch.arange(queries, device=device)[:, None], torch.arange(keys, device=device)[None, :]
    return allowed(None, q_idx, k_idx)[:, None]


def mask_function(sequence: Sequence | None, queries: int, device: torch.device, window: int | None = None):
    """allowed(b, q_idx, k_idx) -> bool, True where query q_idx may attend to key k_idx of sequence b: the key's
    position at or before the query's (and fewer than `window` before it) and, with documents, the same
    document. Indices broadcast; b None: every sequence of the batch, as a leading batch dimension (size 1 without
    documents). The one definition of the mask: SDPA's dense mask evaluates it on the whole grid, FlexAttention's
    block mask on index tensors."""
    q_pos = torch.arange(queries, device=device)
    k_pos, docs, k_docs = q_pos, None, None
    if sequence is not None:
        q_pos = sequence.positions if sequence.positions is not None else q_pos
        k_pos = sequence.key_positions if sequence.key_positions is not None else q_pos
        docs = sequence.documents
        k_docs = sequence.key_documents if sequence.key_documents is not None else docs

    def allowed(b, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
        ok = k_pos[k_idx] <= q_pos[q_idx]
        if window is not None:
            ok = ok & (q_pos[q_idx] - k_pos[k_idx] < window)
        if docs is None or k_docs is None:
            return ok if b is not None else ok[None]
        if b is None:
            return ok[None] & (docs[:, q_idx] == k_docs[:, k_idx])
        return ok & (docs[b, q_idx] == k_docs[b, k_idx])

    return allowed


def flex_block_mask(
    sequence: Sequence | None, batch: int, queries: int, keys: int, device, window: int | None = None
) -> BlockMask:
    """FlexAttention's block mask for `sequence` (None: plain causal), built by a compiled create_block_mask (which
    never holds the [T, S] mask eager create_block_mask would): once per Sequence and shape, kept in its MaskCache
    and shared by every block (plain causal: once per shape and device); inside a compiled model, in each block's
    graph, as the dense masks are."""
    allowed = mask_function(sequence, queries, device, window)
    per_batch = sequence is not None and sequence.documents is not None

    def build(create=create_block_mask) -> BlockMask:
        return create(
            lambda b, h, q_idx, k_idx: allowed(b, q_idx, k_idx),
            batch if per_batch else None,
            None,
            queries,
            keys,
            device=device,
        )

    if torch.compiler.is_compiling():
        return build()
    key = (queries, keys, str(device), window)
    cache = sequence.masks.block_masks if sequence is not None and not sequence.plain else _PLAIN_BLOCK_MASKS
    if key not in cache:
        cache[key] = build(compiled_create_block_mask())
    return cache[key]


_PLAIN_BLOCK_MASKS: dict[tuple, BlockMask] = {}
# Whole sequences from position 0: the Sequence the dense masks of windowed blocks are cached in (weakly, as every
# Sequence's), so the blocks of one forward pass share one.
_PLAIN_SEQUENCE = Sequence()


@functools.cache
def compiled_create_block_mask():
    return torch.compile(create_block_mask)


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once: FlexAttention runs as a Triton kernel only compiled (eager it materialises
    the scores); inside a compiled model the call is traced into the model's graph instead."""
    return torch.compile(flex_attention, dynamic=False)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequence: Sequence | None,
    block: int,
    window: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Attention of q [B, Hq, T, hd] over k, v [B, Hkv, S, hd] under mask_function, one block of `block` queries
    at a time over the chunks of `chunk` keys any of them may see (all keys, one chunk, under torch.compile or on
    meta), each block recomputed in backward (checkpoint) with its mask: at most block x chunk scores at once, and
    nothing saved for backward but q, k and v (the mask is rebuilt from the positions and documents, never kept).
    Sinks [Hq] join each block's softmax (they see no key, so the span of keys does not change them).

    Chunks start at multiples of `chunk`, so every block's scores have one size: tensors whose sizes grow block
    after block leave glibc's heap (which titanlite's CPU runs keep, builder/runtime.py) too fragmented to reuse,
    and the process's resident memory grew to several times its tensors' (16,384 tokens: 4.6 GiB for 0.2). For the
    same reason each block's forward records no graph (_RecomputedSpan, rather than torch's checkpoint, which
    records one and drops its tensors): the small autograd nodes each recorded op leaves behind are carved from
    the blocks' freed scores and pin them."""
    queries, keys = q.shape[2], k.shape[2]
    allowed = mask_function(sequence, queries, q.device, window)
    whole = torch.compiler.is_compiling() or q.device.type == "meta"  # meta: the planner's shapes
    chunk = keys if whole else min(chunk, keys)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    outs = []
    for start in range(0, queries, block):
        end = min(queries, start + block)
        lo, hi = 0, keys
        if not whole:
            seen = block_of(allowed, start, end, 0, keys, q.device).any(dim=(0, 1, 2)).nonzero()
            lo, hi = int(seen[0]) // chunk * chunk, min(keys, -(-(int(seen[-1]) + 1) // chunk) * chunk)
        tensors = (q[:, :, start:end], k[:, :, lo:hi], v[:, :, lo:hi], sinks)
        options: tuple = (allowed, start, lo, softcap, scale, chunk)
        if not training:
            outs.append(_attend_span(*tensors, *options))
        elif whole:
            outs.append(checkpoint(_attend_span, *tensors, *options, use_reentrant=False))
        else:
            outs.append(_RecomputedSpan.apply(*tensors, options))
    return torch.cat(outs, dim=2)


def block_of(allowed, q_start: int, q_end: int, k_start: int, k_end: int, device) -> torch.Tensor:
    """[B or 1, 1, q_end - q_start, k_end - k_start] bool: mask_function's `allowed` on that block."""
    q_idx = torch.arange(q_start, q_end, device=device)[:, None]
    return allowed(None, q_idx, torch.arange(k_start, k_end, device=device)[None, :])[:, None]


class _RecomputedSpan(torch.autograd.Function):
    """_attend_span run without a graph, and again with one in backward, which differentiates it there and frees
    it: what torch's checkpoint does, but with no graph recorded in forward (blockwise_attention says why), and
    a single node that any backward (torch.autograd.grad with inputs too, as pipeline schedules call it) runs."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options):
        ctx.save_for_backward(q, k, v, sinks)
        ctx.options = options
        return _attend_span(q, k, v, sinks, *options)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t if t is None else t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = _attend_span(inputs[0], inputs[1], inputs[2], inputs[3], *ctx.options)
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t is not None and t.requires_grad else None for t in inputs), None)


def _attend_span(
    q, k, v, sinks, allowed, q_start: int, k_start: int, softcap: float | None, scale: float | None, chunk: int
) -> torch.Tensor:
    """Attention of a block of queries over a span of keys, `chunk` keys at a time with an online softmax: each
    chunk's scores are exponentiated against the running row maximum (a constant for the gradient: the result
    does not depend on it), the sums and outputs so far rescaled when it grows."""
    q_end = q_start + q.shape[2]
    if k.shape[2] <= chunk:
        return _attend_block(q, k, v, block_of(allowed, q_start, q_end, k_start, k_start + k.shape[2], q.device),
                             softcap, scale, sinks)  # fmt: skip
    groups = q.shape[1] // k.shape[1]
    rows = (*q.shape[:3], 1)
    peak = q.new_full(rows, float("-inf"))  # each row's largest score so far
    total, out = q.new_zeros(rows), v.new_zeros((*q.shape[:3], v.shape[3]))
    for c in range(0, k.shape[2], chunk):
        kc, vc = k[:, :, c : c + chunk], v[:, :, c : c + chunk]
        if groups > 1:  # grouped-query attention: query head j reads key/value head j // groups
            kc, vc = kc.repeat_interleave(groups, dim=1), vc.repeat_interleave(groups, dim=1)
        mask = block_of(allowed, q_start, q_end, k_start + c, k_start + c + kc.shape[2], q.device)
        scores = _scores(q, kc, mask, softcap, scale)  # [B, H, bq, chunk]
        new_peak = torch.maximum(peak, scores.detach().amax(dim=-1, keepdim=True))
        safe = new_peak.masked_fill(new_peak == float("-inf"), 0.0)  # rows that have seen no key yet
        weights, decay = torch.exp(scores - safe), torch.exp(peak - safe)
        total = total * decay + weights.sum(dim=-1, keepdim=True)
        out = out * decay.to(out.dtype) + weights.to(v.dtype) @ vc
        peak = new_peak
    if sinks is not None:  # one more term in each denominator, e^sink, against the larger of the two maxima
        sink = sinks.to(total.dtype)[None, :, None, None]
        top = torch.maximum(peak, sink)
        rescale = torch.exp(peak - top)
        total, out = total * rescale + torch.exp(sink - top), out * rescale.to(out.dtype)
    return out / total.to(out.dtype)


def _scores(q, k, mask, softcap: float | None, scale: float | None) -> torch.Tensor:
    """Scaled (and softcapped) scores of q over k [B, H, T, S], -inf where the bool mask rules a key out."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~mask, float("-inf"))


def _attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softcap: float | None,
    scale: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with explicit scores under a bool mask [B or 1, 1, T, S]; sinks [Hq]: one more logit per query
    head in each softmax, whose weight is dropped (it has no value)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: query head j reads key/value head j // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = _scores(q, k, mask, softcap, scale)
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(scores.shape[0], -1, scores.shape[2], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, H, T, S]
    return weights.to(v.dtype) @ v
