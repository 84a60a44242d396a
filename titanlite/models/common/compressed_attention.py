"""DeepSeek-V4's attention: one key/value head shared by every query head (the key is the value), a sliding window
over the layer's recent tokens, and in most layers keys compressed from blocks of tokens beside them. Plain modules
with no parallelism inside.

- Queries: a low-rank path (wq_a, its norm, wq_b), each head then RMS-normalised without a weight; the key/value: wkv
  and its norm. The last `rope_dim` channels of each head rotate (adjacent pairs), and the output's rotate back by the
  query's position, so what a key contributes depends on its distance only.
- Every query sees the keys of its last `window` tokens (itself included; its own document's under a block-causal
  mask), the compressed keys its layer's kind gives it, and a learned sink logit per head in the softmax (`sinks`).
- "heavily_compressed_attention" (HCA): every `rate` tokens of a document become one key, a softmax-gated sum of
  their projections (wkv, wgate, a learned bias per place in the block), normalised and rotated at the block's first
  position; a query sees every block that has ended at or before it.
- "compressed_sparse_attention" (CSA): the same with overlapping blocks (each key reads its own block and the one
  before, two projections per token), and of the blocks a query could see it reads only the `topk` a lightning
  indexer picks (titanlite/models/common/indexer.py): the indexer has its own compressor (of its own width) for its
  keys, queries from the query's low-rank residual and a weight per head from the token; it learns from the KL
  divergence to the attention's weights over the blocks it picked (its input detached, as DeepSeek-V3.2's).
- "sliding_attention": the window alone.
- Output: heads in `o_groups` groups, each projected to `o_lora_rank` (wo_a, one matrix per group), then together to
  the model's width (wo_b).

The attention runs a chunk of queries at a time over the window's keys and the compressed keys it may see, each chunk
recomputed in backward, so memory grows linearly in the tokens. Compression follows documents: blocks are counted from
each document's first token and a block is complete only with `rate` tokens of its document (a document's last partial
block makes no key, as the last partial block of a sequence makes none), so a packed sequence computes what each
document alone would.

Generation keeps, per layer, the window's keys and each token's compressor inputs (KVCache rows) and the compressed
keys so far (a state): a step compresses only the blocks its tokens complete."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, block_of, local_sinks, mask_function
from titanlite.models.common.auxiliary import add_auxiliary_loss, auxiliary_wanted
from titanlite.models.common.indexer import (
    HeadSums,
    SharedKeys,
    chunk_elements,
    gather_rows,
    indexer_kl,
    select_among,
)
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.latent.sparse import SequenceKeys, keys_in_order
from titanlite.models.common.norms import Float32RMSNorm
from titanlite.models.common.rope import rotate_pairs

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
COMPRESSED_KINDS = (SLIDING, CSA, HCA)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its last 2 r channels rotated in adjacent pairs by cos and sin [..., r] (broadcast against x's
    leading dimensions), in float32; the leading channels pass unchanged."""
    r = 2 * cos.shape[-1]
    return torch.cat([x[..., :-r], rotate_pairs(x[..., -r:], cos, sin)], dim=-1)


class Blocks:
    """The compressed keys of a forward: `keys` [B, C, D] (C = L // rate slots; a row with fewer complete blocks
    leaves the rest empty), and per slot whether it holds a block (`valid` [B, C]), its document (`documents` [B, C],
    None without documents) and the position of its last token (`ends` [B, C]), which a query must have reached."""

    def __init__(self, keys: torch.Tensor, valid: torch.Tensor, documents: torch.Tensor | None, ends: torch.Tensor):
        self.keys, self.valid, self.documents, self.ends = keys, valid, documents, ends

    def allowed(self, positions: torch.Tensor, documents: torch.Tensor | None):
        """mask_function's allowed(b, q_idx, k_idx) of queries at `positions` [T] (documents [B, T]) over the slots."""

        def allowed(b, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
            batch = slice(None) if b is None else b
            ok = self.valid[batch, k_idx] & (self.ends[batch, k_idx] <= positions[q_idx])
            if self.documents is not None and documents is not None:
                ok = ok & (self.documents[batch, k_idx] == documents[batch, q_idx])
            return ok

        return allowed


class Compressor(nn.Module):
    """Keys of `width` channels compressed from blocks of `rate` tokens (module docstring): wkv and wgate [dim ->
    width, or 2 width where `overlap`], `position_bias` [rate, that width] added to the gate by a token's place in its
    block, the block's softmax-gated sum normalised (`norm`, float32), its last `rope_dim` channels rotated at the
    block's first position. With `overlap`, a token's first `width` channels join the next block's key, its last
    `width` its own block's."""

    def __init__(self, dim: int, width: int, rate: int, overlap: bool, norm_eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        projected = 2 * width if overlap else width
        self.wkv = nn.Linear(dim, projected, bias=False)
        self.wgate = nn.Linear(dim, projected, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, projected))
        self.norm = Float32RMSNorm(width, norm_eps)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The projections input-side, the position bias at zero (transformers' start)."""
        if name == "position_bias":
            nn.init.zeros_(full)
        else:
            start_linears(name, full, generator, scheme, inputs=("wkv", "wgate"), outputs=())

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """What a token gives its blocks [B, T, 2 P]: its key projection then its gate (P = width, 2 width)."""
        return torch.cat([self.wkv(x), self.wgate(x)], dim=-1)

    def compress(
        self,
        projected: torch.Tensor,
        positions: torch.Tensor,
        documents: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> Blocks:
        """The complete blocks of the tokens whose projections (`project`) are `projected` [B, L, 2 P], at
        consecutive `positions` [L] (documents [B, L]); cos, sin: the whole rotary table [positions, r]."""
        batch, length, _ = projected.shape
        kv, gate = projected.float().chunk(2, dim=-1)
        if documents is None:
            starts = positions[:1].expand(batch, length)  # one document, from the first position given
            new_document = torch.zeros(batch, length, dtype=torch.bool, device=projected.device)
        else:
            new_document = torch.ones_like(documents, dtype=torch.bool)
            new_document[:, 1:] = documents[:, 1:] != documents[:, :-1]
            starts = torch.where(new_document, positions, torch.zeros_like(positions)).cummax(dim=1).values
        within = positions - starts  # [B, L] each token's place in its document
        block = within // self.rate  # its block's index in the document
        opens = new_document | (within % self.rate == 0)
        opens[:, 0] = True
        group = opens.long().cumsum(dim=1) - 1  # [B, L] each token's block, counted along the row
        gate = gate + self.position_bias.float()[within % self.rate]
        # Each block's contributions: its tokens (their last `width` channels where blocks overlap), and, where they
        # overlap, the first `width` of the tokens of the block before it in the same document.
        if self.overlap:
            after = _first_of(group, (group + 1).clamp(max=length - 1))  # the first token of the next block
            follows = block.gather(1, after) == block + 1
            if documents is not None:
                follows = follows & (documents.gather(1, after) == documents)
            targets = torch.cat([torch.where(follows, group + 1, length), group], dim=1)  # length: dropped
            kv = torch.cat(kv.chunk(2, dim=-1), dim=1)  # [B, 2 L, width]: the first halves, then the second
            gate = torch.cat(gate.chunk(2, dim=-1), dim=1)
        else:
            targets = group
        keys = _segment_softmax_sum(kv, gate, targets, length + 1)[:, :length]  # [B, L groups, width]
        counts = torch.zeros(batch, length + 1, dtype=torch.long, device=projected.device)
        counts.scatter_add_(1, group, torch.ones_like(group))
        complete = counts[:, :length] == self.rate  # [B, groups]
        # The complete blocks into C = L // rate slots, in order.
        slots = length // self.rate
        slot = torch.where(complete, complete.long().cumsum(dim=1) - 1, slots)  # slots: dropped
        first_position = torch.full((batch, length + 1), -1, dtype=positions.dtype, device=projected.device)
        first_position.scatter_reduce_(1, group, positions.expand(batch, length), "amin", include_self=False)
        keys = self.norm(keys.to(projected.dtype))
        place = first_position[:, :length].clamp(min=0)
        keys = rotate_tail(keys, cos[place], sin[place])
        out = keys.new_zeros(batch, slots + 1, self.width).scatter_(
            1, slot[..., None].expand(-1, -1, self.width), keys
        )[:, :slots]
        valid = torch.zeros(batch, slots + 1, dtype=torch.bool, device=projected.device).scatter_(1, slot, complete)
        ends = torch.zeros(batch, slots + 1, dtype=positions.dtype, device=projected.device).scatter_(
            1, slot, place + self.rate - 1
        )
        docs = None
        if documents is not None:
            group_docs = torch.zeros(batch, length + 1, dtype=documents.dtype, device=projected.device)
            group_docs.scatter_(1, group, documents)
            docs = torch.zeros_like(group_docs).scatter_(1, slot, group_docs[:, :length])[:, :slots]
        return Blocks(out, valid[:, :slots], docs, ends[:, :slots])


def _first_of(group: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The index of the first token of block `nxt` [B, L] along each row (`group`: each token's block; a block that
    does not exist gives 0, a row's first token, whose block is its document's first)."""
    first = torch.zeros_like(group)
    index = torch.arange(group.shape[1], device=group.device).expand_as(group)
    first.scatter_reduce_(1, group, index, "amin", include_self=False)
    return first.gather(1, nxt)


def _segment_softmax_sum(
    values: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, groups: int
) -> torch.Tensor:
    """For each group g < `groups`: sum over the rows i with targets[i] = g of softmax(logits)[i] * values[i], the
    softmax over those rows, channel by channel (values, logits [B, N, C] float32; targets [B, N]); zero for a group
    without rows."""
    index = targets[..., None].expand_as(logits)
    peak = torch.full((logits.shape[0], groups, logits.shape[2]), float("-inf"), device=logits.device)
    peak = peak.scatter_reduce(1, index, logits.detach(), "amax", include_self=True)
    weights = torch.exp(logits - peak.gather(1, index))
    total = logits.new_zeros(peak.shape).scatter_add(1, index, weights)
    summed = logits.new_zeros(peak.shape).scatter_add(1, index, weights * values)
    return summed / total.clamp_min(torch.finfo(total.dtype).tiny)


class GroupedLinear(nn.Module):
    """`groups` linear maps side by side, group g's input channels to its `out_features // groups` outputs: weight
    [out_features, in_features // groups], group g's rows the g-th slice (transformers' DeepseekV4GroupedLinear).
    Tensor parallelism may shard the weight by rows (whole groups): forward maps the groups of its shard."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.per_group = out_features // groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features // groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., g, in / groups] -> [..., g, out / groups], g the groups this module holds."""
        w = local_sinks(self.weight).unflatten(0, (-1, self.per_group))  # [g, out / groups, in / groups]
        return torch.einsum("...gi,goi->...go", x, w)


class CompressedIndexer(nn.Module):
    """The lightning indexer over compressed blocks (module docstring): `n_heads` queries of `head_dim` from the
    query's low-rank residual (wq_b), their last rope_dim channels rotated at the query's position, a weight per head
    from the token (weights_proj, times n_heads^-0.5), and keys from its own overlapping Compressor of head_dim."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, rate: int, topk: int, eps: float):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.compressor = Compressor(dim, head_dim, rate, overlap=True, norm_eps=eps)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("wq_b", "weights_proj"), outputs=())

    def queries(
        self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, T, H, D] and head weights [B, T, H], float32; cos, sin at the queries' positions [T, r]."""
        batch, length, _ = x.shape
        q = self.wq_b(residual).view(batch, length, self.n_heads, self.head_dim)
        q = rotate_tail(q, cos[:, None], sin[:, None])
        return q.float(), self.weights_proj(x).float() * self.n_heads**-0.5


class CompressedAttention(nn.Module):
    """One DeepSeek-V4 attention layer of kind `kind` (COMPRESSED_KINDS; module docstring). `rate`: tokens per
    compressed block (CSA's or HCA's); `indexer`: CSA's; `loss_weight`: the indexer loss's weight in the training
    loss (its logged value, `indexer_loss`, is unweighted). Called as the shared decoder's mixers are, with the
    layer's whole rotary table (cos, sin [max positions, r])."""

    # Why a decode step of it cannot be captured as a CUDA graph (titanlite/commands/generate.py): the compressed
    # blocks grow as a state, one more every `rate` tokens, and which are complete is read on the host.
    static_cache_refusal = (
        "its compressed attention keeps a growing list of compressed blocks, counted on the host at every step"
    )

    def __init__(
        self,
        dim: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        kind: str,
        norm_eps: float,
        rate: int = 0,
        indexer: CompressedIndexer | None = None,
        loss_weight: float = 1.0,
    ):
        super().__init__()
        if kind not in COMPRESSED_KINDS:
            raise ValueError(f"CompressedAttention kind {kind!r}; use one of {', '.join(COMPRESSED_KINDS)}")
        if (kind == CSA) != (indexer is not None):
            raise ValueError("CompressedAttention: an indexer exactly for compressed sparse attention")
        self.n_heads, self.head_dim, self.rope_dim, self.window, self.kind = n_heads, head_dim, rope_dim, window, kind
        self.o_groups, self.scale, self.norm_eps, self.loss_weight = o_groups, head_dim**-0.5, norm_eps, loss_weight
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = Float32RMSNorm(q_lora_rank, norm_eps)
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = Float32RMSNorm(head_dim, norm_eps)
        self.wo_a = GroupedLinear(n_heads * head_dim, o_groups * o_lora_rank, o_groups)
        self.wo_b = nn.Linear(o_groups * o_lora_rank, dim, bias=False)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor = None if kind == SLIDING else Compressor(dim, head_dim, rate, kind == CSA, norm_eps)
        self.indexer = indexer
        # What each token's keys are made of, as this forward holds them; context parallelism gathers every rank's.
        self.keys = SequenceKeys()
        # The keys every head reads (the window's and the compressed ones), and the heads' weights over the picked
        # blocks: identities that tensor parallelism, which gives each rank some heads, sums over its ranks (the
        # keys' gradient in backward; the weights forward) (models/deepseek_v4/parallelize.py).
        self.shared_keys = SharedKeys()
        self.head_sums = HeadSums()

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """Projections input-side, wo_b residual-side, the sinks at zero (transformers' start)."""
        if name == "sinks":
            nn.init.zeros_(full)
        elif name == "wo_a.weight":
            scheme.projection(full, generator)
        else:
            start_linears(name, full, generator, scheme, inputs=("wq_a", "wq_b", "wkv"), outputs=("wo_b",))

    def describe_kernel(self, seq_len: int) -> str:
        """What this layer computes for sequences of `seq_len` tokens, for the start-up line."""
        what = f"window {self.window}"
        if self.compressor is not None:
            blocks = seq_len // self.compressor.rate
            read = f"{min(self.indexer.topk, blocks)} picked of" if self.indexer is not None else "all"
            what += f" + {read} {blocks} blocks of {self.compressor.rate}"
        return f"PyTorch's chunks of queries ({what}, sinks)"

    def sequence_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token that mix the sequence (models/common/flops.py; every projection, the
        compressors' and the indexer's too, is a parameter counted apart), for sequences of T = seq_len tokens, causal
        masking not discounted (as for dense attention): scores and weighted sums of H heads of D channels over
        the keys a query reads, forward and backward, 12 H D K, K the window's min(window, T) keys plus the compressed
        ones (HCA: T / rate; CSA: the min(topk, T / rate) picked); for CSA the indexer's scores (a product of its D_i
        channels and a weighted sum over its H_i heads: 2 H_i (D_i + 1) a key) over the T / rate blocks without a
        gradient, and over the picked ones its loss reads, forward and backward, 6 H_i (D_i + 1) K. The compressors'
        gated sums and the norms are not counted, as norms are not."""
        window = min(self.window, seq_len)
        blocks = 0 if self.compressor is None else seq_len // self.compressor.rate
        picked = blocks if self.indexer is None else min(self.indexer.topk, blocks)
        attention = 12.0 * self.n_heads * self.head_dim * (window + picked)
        if self.indexer is None:
            return attention
        score = 2.0 * self.indexer.n_heads * (self.indexer.head_dim + 1)
        return attention + score * blocks + 3.0 * score * picked

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        if cache is not None:
            positions = cache.positions(length, x.device)
        elif sequence is not None and sequence.positions is not None:
            positions = sequence.positions
        else:
            positions = torch.arange(length, device=x.device)
        documents = None if sequence is None else sequence.documents
        q_cos, q_sin = cos[positions], sin[positions]  # [T, r]
        residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(residual).view(batch, length, -1, self.head_dim)  # this rank's heads (tensor parallelism)
        q = F.rms_norm(q.float(), (self.head_dim,), eps=self.norm_eps).to(q.dtype)
        q = rotate_tail(q, q_cos[:, None], q_sin[:, None])
        # What each token gives the keys: its key (and value), and its compressors' inputs (the indexer's detached).
        parts = [rotate_tail(self.kv_norm(self.wkv(x)), q_cos, q_sin)]
        if self.compressor is not None:
            parts.append(self.compressor.project(x))
        if self.indexer is not None:
            parts.append(self.indexer.compressor.project(x.detach()).to(x.dtype))
        widths = [part.shape[-1] for part in parts]
        own = torch.cat(parts, dim=-1)  # [B, T, C]
        if cache is not None:  # generation: the cached tokens', then these
            every = cache.extend("tokens", own)
            window = Sequence(positions=positions, key_positions=cache.stored_positions(every.shape[1], x.device))
        else:  # context parallelism: every rank's, put in position order
            ordered, (every,) = keys_in_order(sequence, self.keys(own, sequence))
            window = ordered if ordered is not None else Sequence(positions=positions)
        key_positions = window.key_positions if window.key_positions is not None else positions
        key_documents = window.key_documents if window.key_documents is not None else documents
        kv, *inputs = every.split(widths, dim=-1)
        kv = self.shared_keys(kv)
        blocks = index_blocks = None
        if self.compressor is not None:
            blocks = self.blocks(self.compressor, inputs[0], key_positions, key_documents, cos, sin, cache, "attention")
            blocks.keys = self.shared_keys(blocks.keys)
        indices = valid = index_q = index_w = None
        if self.indexer is not None and blocks is not None and blocks.keys.shape[1]:
            index_q, index_w = self.indexer.queries(x.detach(), residual.detach(), q_cos, q_sin)
            index_blocks = self.blocks(self.indexer.compressor, inputs[1], key_positions, key_documents, cos, sin,
                                       cache, "indexer")  # fmt: skip
            allowed = blocks.allowed(positions, documents)
            indices, valid = select_among(
                index_q, index_blocks.keys.float(), index_w, allowed, self.indexer.topk, self.indexer.scale, stable=True
            )
        out, sums = compressed_attention(
            q, kv, window, self.window, blocks, positions, documents, indices, valid, local_sinks(self.sinks),
            self.scale, plain=cache is None and (sequence is None or sequence.positions is None),
        )  # fmt: skip
        if index_blocks is not None and indices is not None and valid is not None and auxiliary_wanted():
            assert sums is not None and index_q is not None and index_w is not None and self.indexer is not None
            sums = self.head_sums(sums)
            kl = indexer_kl(index_q, index_blocks.keys.float(), index_w, indices, valid, sums, self.indexer.scale)
            out = add_auxiliary_loss(out, "indexer_loss", kl, self.loss_weight)
        out = rotate_tail(out, q_cos[:, None], -q_sin[:, None])  # the values' rotation undone at the query
        out = self.wo_a(out.reshape(batch, length, -1, self.wo_a.weight.shape[-1])).flatten(2)  # [B, T, g, in / G]
        return self.wo_b(out)

    def blocks(
        self,
        compressor: Compressor,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        documents: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None,
        name: str,
    ) -> Blocks:
        """`compressor`'s complete blocks of the tokens whose inputs (Compressor.project) are `inputs` [B, S, 2 P], at
        consecutive `positions` [S]. With a cache, `inputs` are every token's so far: the blocks kept from before (a
        state) and those the new tokens complete, from their tokens' inputs (and those of the block before, which an
        overlapping block reads)."""
        if cache is None:
            return compressor.compress(inputs, positions, documents, cos, sin)
        rate = compressor.rate
        done = cache.cache.length // rate  # blocks complete before this forward
        first = max(0, (done - 1 if compressor.overlap else done) * rate)
        fresh = compressor.compress(inputs[:, first:], positions[first:], None, cos, sin)
        kept = cache.state(f"{name}_blocks")
        new = fresh.keys[:, done - first // rate :]  # the block before, recomputed only to be read, left out
        keys = new if kept is None else torch.cat([kept, new], dim=1)
        cache.set_state(f"{name}_blocks", keys)
        count = keys.shape[1]
        ends = (torch.arange(count, device=inputs.device) * rate + rate - 1).expand(inputs.shape[0], count)
        valid = torch.ones(inputs.shape[0], count, dtype=torch.bool, device=inputs.device)
        return Blocks(keys, valid, None, ends)


def compressed_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    window: Sequence,
    width: int,
    blocks: Blocks | None,
    positions: torch.Tensor,
    documents: torch.Tensor | None,
    indices: torch.Tensor | None,
    valid: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    plain: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of queries q [B, T, H, D] at `positions` over the window's keys (`keys` [B, S, D], both the keys and
    the values, key s at position s; `window` the mask's Sequence, of which a query sees the last `width` positions)
    and the compressed `blocks` (all it may see, or where `indices` [B, T, K] are given those with `valid`), with one
    sink logit per head: the output [B, T, H, D] and, where indices are given, each query's attention weights over its
    picked blocks summed over the heads [B, T, K] (no gradient; the indexer's target). A chunk of queries at a time,
    over the keys its window spans, recomputed in backward. `plain`: the queries are positions 0..T-1 (the spans
    follow without reading the positions on the host)."""
    batch, length = q.shape[:2]
    allowed = mask_function(window, length, q.device, width)
    n_blocks = 0 if blocks is None else blocks.keys.shape[1]
    seen = None if blocks is None or indices is not None else blocks.allowed(positions, documents)
    extra = indices.shape[-1] if indices is not None else n_blocks  # the compressed keys a query reads
    chunks = []
    for start, end in query_chunks(length, batch * q.shape[2], min(width, length) + extra, q.device):
        if plain:
            first, last = start, end - 1
        else:  # the chunk's positions (context parallelism's two runs, a cache's offset), read on the host
            first, last = int(positions[start:end].min()), int(positions[start:end].max())
        lo, hi = max(0, first - width + 1), last + 1
        picked = None
        if indices is not None and valid is not None and blocks is not None:
            picked = (indices[:, start:end], valid[:, start:end])
        # The masks are made inside the chunk, again in its recompute: kept for backward, the chunks' [Q, K] masks
        # would sum to T^2 / 2 bytes (a dense window's), where nothing else the attention keeps grows past T.
        chunks.append(Chunk(start, end, lo, hi, ChunkMasks(allowed, seen, start, end, lo, hi, n_blocks), picked))
    plan = ChunkPlan(chunks, scale, extra if indices is not None else 0)
    compressed = None if blocks is None else blocks.keys
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, keys, compressed, sinks)):
        out, summed = ChunkedAttention.apply(plan, q, keys, compressed, sinks)
    else:
        out, summed = plan.forward(q, keys, compressed, sinks)
    return out, (summed if indices is not None else None)


@dataclass(frozen=True)
class Chunk:
    """A chunk of queries start..end over the window's keys lo..hi, its masks, and its queries' picked blocks."""

    start: int
    end: int
    lo: int
    hi: int
    masks: ChunkMasks
    picked: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one attention call, its scale, and the picked blocks a query reads (0: none picked)."""

    chunks: list[Chunk]
    scale: float
    picked: int

    def forward(self, q, keys, compressed, sinks) -> tuple[torch.Tensor, torch.Tensor]:
        """The output [B, T, H, D] and the picked blocks' summed weights [B, T, P], each chunk's written in place: a
        chunk's small results kept between the next chunks' large scores would pin the heap's freed blocks, and the
        process's memory would grow as T^2 (some 9 times its tensors' at 16,384 tokens)."""
        out = torch.empty_like(q)
        summed = torch.empty(q.shape[0], q.shape[1], self.picked, device=q.device, dtype=torch.float32)
        for c in self.chunks:
            o, s = _attend_chunk(q[:, c.start : c.end], keys[:, c.lo : c.hi], c.masks, compressed, c.picked, sinks,
                                 self.scale)  # fmt: skip
            out[:, c.start : c.end] = o
            summed[:, c.start : c.end] = s
            del o, s
        return out, summed


class ChunkedAttention(torch.autograd.Function):
    """The chunks' attention, nothing kept for backward but its inputs: backward recomputes one chunk at a time and
    writes its queries' gradient in place and adds its keys', blocks' and sinks' to theirs (not autograd's slices of
    each chunk, whose backward would make a whole-length zero gradient per chunk: T^2 / Q of memory traffic)."""

    @staticmethod
    def forward(ctx, plan: ChunkPlan, q, keys, compressed, sinks):
        ctx.plan = plan
        ctx.save_for_backward(q, keys, compressed, sinks)
        out, summed = plan.forward(q, keys, compressed, sinks)
        ctx.mark_non_differentiable(summed)
        return out, summed

    @staticmethod
    def backward(ctx, grad_out, _grad_summed):
        plan: ChunkPlan = ctx.plan
        q, keys, compressed, sinks = ctx.saved_tensors
        _, want_q, want_keys, want_compressed, want_sinks = ctx.needs_input_grad
        dq = torch.zeros_like(q) if want_q else None
        dkeys = torch.zeros_like(keys) if want_keys else None
        dcompressed = torch.zeros_like(compressed) if compressed is not None and want_compressed else None
        dsinks = torch.zeros_like(sinks) if want_sinks else None
        for c in plan.chunks:
            with torch.enable_grad():
                q_part = q[:, c.start : c.end].detach().requires_grad_(want_q)
                keys_part = keys[:, c.lo : c.hi].detach().requires_grad_(want_keys)
                compressed_part = None if compressed is None else compressed.detach().requires_grad_(want_compressed)
                sinks_part = sinks.detach().requires_grad_(want_sinks)
                o, _ = _attend_chunk(q_part, keys_part, c.masks, compressed_part, c.picked, sinks_part, plan.scale)
                wanted = [(t, g) for t, g in ((q_part, dq), (keys_part, dkeys), (compressed_part, dcompressed),
                                              (sinks_part, dsinks)) if t is not None and g is not None]  # fmt: skip
                found = torch.autograd.grad(o, [t for t, _ in wanted], grad_out[:, c.start : c.end], allow_unused=True)
            for (part, total), grad in zip(wanted, found, strict=True):
                if grad is None:
                    continue
                if part is q_part:
                    total[:, c.start : c.end] = grad
                elif part is keys_part:
                    total[:, c.lo : c.hi] += grad
                else:
                    total += grad
            del o, found, wanted
        return None, dq, dkeys, dcompressed, dsinks


def query_chunks(queries: int, rows: int, keys: int, device: torch.device) -> list[tuple[int, int]]:
    """(start, end) of each chunk of `queries`, `rows` score rows a query (batch x heads), each reading `keys` keys
    beside the window's span, which grows with the chunk (its Q queries' windows span Q + window keys): chunks of Q
    queries with rows x Q x (Q + keys) scores under twice chunk_elements (all at once on the meta device, the
    planner's shapes)."""
    if device.type == "meta":
        return [(0, queries)]
    budget = chunk_elements(device.type)
    chunk = max(1, min(budget // max(rows * keys, 1), math.isqrt(budget // max(rows, 1))))
    return [(start, min(queries, start + chunk)) for start in range(0, queries, chunk)]


@dataclass(frozen=True)
class ChunkMasks:
    """What a chunk's masks are made from: the window's mask function over queries start..end and keys lo..hi, and
    the compressed blocks' (`seen`, over all n_blocks; None where each query reads its picked ones)."""

    allowed: Callable
    seen: Callable | None
    start: int
    end: int
    lo: int
    hi: int
    n_blocks: int

    def window(self, device: torch.device) -> torch.Tensor:
        """[B or 1, Q, K] bool."""
        return block_of(self.allowed, self.start, self.end, self.lo, self.hi, device)[:, 0]

    def blocks(self, device: torch.device) -> torch.Tensor | None:
        """[B or 1, Q, C] bool, or None."""
        return None if self.seen is None else block_of(self.seen, self.start, self.end, 0, self.n_blocks, device)[:, 0]


def _attend_chunk(
    q: torch.Tensor,
    keys: torch.Tensor,
    masks: ChunkMasks,
    compressed: torch.Tensor | None,
    picked: tuple[torch.Tensor, torch.Tensor] | None,
    sinks: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of queries [B, Q, H, D] over its window's keys [B, K, D] (masks.window) and the compressed keys: all of
    them under masks.blocks, or each query's picked ones (indices, valid [B, Q, P]); the sinks [H] in the softmax's
    denominator. The output, and the weights over the picked keys summed over the heads [B, Q, P] (empty
    without)."""
    ruled_out = float("-inf")
    window_mask, block_mask = masks.window(q.device), masks.blocks(q.device)
    scores = [
        (torch.einsum("bqhd,bkd->bqhk", q, keys) * scale).float().masked_fill(~window_mask[:, :, None], ruled_out)
    ]
    values = [keys]
    if compressed is not None and picked is not None:
        chosen = gather_rows(compressed, picked[0])  # [B, Q, P, D]
        picked_scores = torch.einsum("bqhd,bqpd->bqhp", q, chosen) * scale
        scores.append(picked_scores.float().masked_fill(~picked[1][:, :, None], ruled_out))
        values.append(chosen)
    elif compressed is not None and block_mask is not None:
        block_scores = torch.einsum("bqhd,bcd->bqhc", q, compressed) * scale
        scores.append(block_scores.float().masked_fill(~block_mask[:, :, None], ruled_out))
        values.append(compressed)
    sink = sinks.float()[None, None, :, None].expand(q.shape[0], q.shape[1], -1, 1)
    weights = torch.softmax(torch.cat([*scores, sink], dim=-1), dim=-1)
    parts = weights.split([*(s.shape[-1] for s in scores), 1], dim=-1)
    out = torch.einsum("bqhk,bkd->bqhd", parts[0].to(q.dtype), values[0])
    summed = torch.zeros(q.shape[0], q.shape[1], 0, device=q.device)
    if picked is not None and len(values) > 1:
        out = out + torch.einsum("bqhp,bqpd->bqhd", parts[1].to(q.dtype), values[1])
        summed = parts[1].detach().sum(dim=2)
    elif len(values) > 1:
        out = out + torch.einsum("bqhc,bcd->bqhd", parts[1].to(q.dtype), values[1])
    return out, summed
