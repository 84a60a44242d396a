"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): multi-head latent attention whose every query reads only the
`topk` earlier tokens a small "lightning indexer" picks for it, and the indexer trained to pick what the attention
would have weighed most. Plain modules with no parallelism inside.

The indexer (Indexer) scores query t against key s as I[t, s] = sum_h w[t, h] relu(scale q[t, h] . k[s]): its own
heads' queries from the latent query's residual (wq_b of q_norm(wq_a(x))), one key per token shared by its heads
(wk, then a LayerNorm), a weight per head from the token (weights_proj), the first qk_rope_head_dim channels of
queries and key rotated (DeepSeek-V3.2 as halves, GLM-5 in adjacent pairs, as transformers' indexers do). Each query
keeps the topk keys of highest score among those the mask lets it see (earlier positions, and under a block-causal
mask its own document's); fewer than topk visible: all of them. The scores are computed a chunk of queries at a time
(select), so the T x S matrix of them never exists whole.

The attention (sparse_attention) then gathers each query's selected keys and values and attends over them alone: a
chunk of queries at a time, each chunk recomputed in backward, so the gathered copies live one chunk at a time and
attention's memory grows as T x topk, not T x S. Where topk covers every key (topk >= the keys a query can see),
the selection changes nothing and the layer attends densely through its attention core (the fast kernels).

Training the indexer (DeepSeek-V3.2's report, section 2.1): its input is detached from the model (the model's loss
never reaches it, nor its loss the model), and its loss is the KL divergence from the main attention's distribution
over the selected keys (each query's attention weights summed over the heads, renormalised: `target`) to the
softmax of the indexer's scores over the same keys, averaged over the queries (indexer_kl); in the dense warm-up,
over every key the query sees."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titanlite.models.common.attention import Sequence, block_of, mask_function
from titanlite.models.common.attention import local_sinks as local_weight
from titanlite.models.common.auxiliary import add_auxiliary_loss, auxiliary_wanted
from titanlite.models.common.indexer import (
    HeadSums,
    SharedKeys,
    gather_rows,
    indexer_kl,
    recomputed,
    select_among,
    spans,
)
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.mixers import LatentAttention, LatentWidths
from titanlite.models.common.rope import apply_rope, apply_rope_halves

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11; titanlite runs on 3.10

INDEXER_NORM_EPS = 1e-6  # the key's LayerNorm epsilon in DeepSeek's code and transformers'


class Indexer(nn.Module):
    """The lightning indexer of one layer: `n_heads` heads of `head_dim` channels, the first `rope_dim` rotated
    (`interleaved`: adjacent pairs, GLM-5's; else halves, DeepSeek-V3.2's). forward gives what the scores are made
    of (index_scores): the queries [B, T, H_i, D], the keys [B, T, D] and the head weights [B, T, H_i] (times
    H_i^-0.5), all float32."""

    def __init__(
        self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int, interleaved: bool
    ):
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"Indexer head_dim={head_dim} cannot hold the {rope_dim} rotary channels")
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.topk, self.interleaved = topk, interleaved
        self.scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)

    def forward(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bsz, seqlen, _ = x.shape
        q = self.wq_b(q_residual).view(bsz, seqlen, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)  # [B, T, 1, D]
        if cos is not None and sin is not None:
            q, k = self.rotate(q, cos[:seqlen], sin[:seqlen]), self.rotate(k, cos[:seqlen], sin[:seqlen])
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return q.float(), k.squeeze(2).float(), weights

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] with its first rope_dim channels rotated, the rest passed unchanged."""
        r = self.rope_dim
        turned = apply_rope(x[..., :r], cos, sin) if self.interleaved else apply_rope_halves(x[..., :r], cos, sin)
        return torch.cat([turned, x[..., r:]], dim=-1)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """Every projection input-side (the indexer writes nothing into the residual stream); the key norm's
        scale at one, its bias at zero."""
        if name.startswith("k_norm."):
            scheme.norm(name.partition(".")[2], full)
        else:
            start_linears(name, full, generator, scheme, inputs=("wq_b", "wk", "weights_proj"), outputs=())


def keys_in_order(sequence: Sequence | None, *keys: torch.Tensor) -> tuple[Sequence | None, list[torch.Tensor]]:
    """The keys [B, S, ...] put in position order where `sequence` gives them another (context parallelism's
    gathered keys), and the Sequence that describes them so (key positions 0..S-1): the indexer's scores then come
    in the order one process computes them, and equal scores break alike."""
    if sequence is None or sequence.key_positions is None:
        return sequence, list(keys)
    order = sequence.key_positions.argsort()
    documents = None if sequence.key_documents is None else sequence.key_documents[:, order]
    ordered = Sequence(
        positions=sequence.positions,
        documents=sequence.documents,
        key_positions=sequence.key_positions[order],
        key_documents=documents,
    )
    return ordered, [k[:, order] for k in keys]


def select(
    indexer: Indexer, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, sequence: Sequence | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's indexer.topk keys among those `sequence`'s mask lets it see (select_among: indices [B, T, K] and
    which of them it may see)."""
    allowed = mask_function(sequence, q.shape[1], q.device)
    return select_among(q, k, weights, allowed, indexer.topk, indexer.scale)


def _sparse_span(
    q_latent: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of queries over their selected keys (sparse_attention): the output [B, Q, H, r] in the latent's width
    and the attention weights summed over the heads [B, Q, K] (no gradient)."""
    keys, rotary = gather_rows(latent, indices), gather_rows(k_rot, indices)  # [B, Q, K, r], [B, Q, K, rope]
    scores = torch.einsum("bqhr,bqkr->bqhk", q_latent, keys) + torch.einsum("bqhd,bqkd->bqhk", q_rot, rotary)
    scores = (scores * scale).masked_fill(~valid[:, :, None, :], float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1)
    out = torch.einsum("bqhk,bqkr->bqhr", weights.to(latent.dtype), keys)
    return out, weights.detach().sum(dim=2)


def sparse_attention(
    q_latent: torch.Tensor,
    q_rot: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    indices: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention over each query's selected keys, in the latent's space (DeepSeek's "absorbed" form: one key
    per token, the latent, shared by every head, as DeepSeek's own sparse kernels read it): queries q_latent
    [B, T, H, r] (each head's non-rotary query through its part of wkv_b's key rows) and q_rot [B, T, H, rope] over
    the keys' latents [B, S, r] and rotary keys [B, S, rope] at `indices` where `valid` (select). Returns the output
    [B, T, H, r], which each head's value rows of wkv_b turn into its value, and each query's attention weights over
    its keys summed over this rank's heads [B, T, K]. A chunk of queries at a time, each recomputed in backward: the
    gathered keys, K x (r + rope) a query whatever the heads, are never kept."""
    width = q_latent.shape[0] * indices.shape[-1] * (latent.shape[-1] + k_rot.shape[-1] + 2 * q_latent.shape[2])
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q_latent, q_rot, latent, k_rot))
    outs, sums = [], []
    for start, end in spans(q_latent.shape[1], width, latent.device):
        span = (q_latent[:, start:end], q_rot[:, start:end], latent, k_rot, indices[:, start:end], valid[:, start:end])
        out, summed = recomputed(_sparse_span, training, *span, scale)
        outs.append(out)
        sums.append(summed)
    return torch.cat(outs, dim=1), torch.cat(sums, dim=1)


@torch.no_grad()
def dense_head_sums(
    q: torch.Tensor, k: torch.Tensor, sequence: Sequence | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's attention weights over every key [B, T, S] summed over this rank's heads, and which keys it may
    see [B or 1, T, S]: the indexer's target where the attention is dense (the warm-up, or topk over every key)."""
    queries, keys = q.shape[1], k.shape[1]
    allowed = mask_function(sequence, queries, q.device)
    sums, seen_all = [], []
    for start, end in spans(queries, q.shape[0] * q.shape[2] * keys, q.device):
        seen = block_of(allowed, start, end, 0, keys, q.device)[:, 0]  # [B or 1, Q, S]
        scores = torch.einsum("bqhd,bshd->bqhs", q[:, start:end], k) * scale
        weights = torch.softmax(scores.float().masked_fill(~seen[:, :, None, :], float("-inf")), dim=-1)
        sums.append(weights.sum(dim=2))
        seen_all.append(seen)
    return torch.cat(sums, dim=1), torch.cat(seen_all, dim=1)


class SequenceKeys(nn.Module):
    """The keys a layer's queries read: those of the tokens this forward holds [B, T, C], as they are. Context
    parallelism replaces it by one that gathers every rank's (titanlite/parallel/context_parallel.py)."""

    def forward(self, keys: torch.Tensor, sequence: Sequence | None) -> torch.Tensor:
        return keys


class SparseLatentAttention(LatentAttention):
    """Multi-head latent attention (LatentAttention: its projections and widths, `latent` its keyword arguments)
    whose queries each read the keys `indexer` selects (module docstring). `dense_warmup`: attend densely and train
    only the indexer toward the dense attention (DeepSeek-V3.2's first stage; the run freezes the rest); `loss_weight`:
    the indexer loss's weight in the training loss (its logged value, `indexer_loss`, is unweighted)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        indexer: Indexer,
        dense_warmup: bool = False,
        loss_weight: float = 1.0,
        **latent: Unpack[LatentWidths],
    ):
        super().__init__(dim, n_heads, **latent)
        if not latent["q_lora_rank"]:
            raise ValueError("SparseLatentAttention's indexer reads the query's low-rank residual: set q_lora_rank")
        self.indexer = indexer
        self.keys = SequenceKeys()
        self.shared_keys = SharedKeys()
        self.head_sums = HeadSums()
        self.dense_warmup, self.loss_weight = dense_warmup, loss_weight

    def sequence_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token that mix the sequence (models/common/flops.py; its projections, the indexer's
        too, are parameters counted apart), for sequences of seq_len = T tokens. Where the indexer leaves keys out
        (K = topk < T): attention in the latent's space (sparse_attention) over the K keys, scores of r + rope
        channels and outputs of r, forward and backward, 6 H (2 r + rope) K (each head's query and output through
        wkv_b's rows are wkv_b's parameters, counted once each in N, as the dense path's expansion is); the indexer's
        scores (a product of D channels and a weighted sum over its H_i heads: 2 H_i (D + 1) per key) over every
        key without a gradient for the selection, and over the K keys its loss reads forward and backward,
        6 H_i (D + 1) K. Dense (the warm-up, or topk >= T): dense attention's 6 H (w_qk + w_v) T and the indexer's
        loss over every key. Recomputation in backward is not counted, as activation checkpointing's is not."""
        heads = self.wkv_b.out_features // (self.nope + self.v_dim)
        dense = self.dense_warmup or self.indexer.topk >= seq_len
        keys = seq_len if dense else self.indexer.topk
        width = self.nope + self.rope + self.v_dim if dense else 2 * self.kv_rank + self.rope
        attention = 6.0 * heads * width * keys
        score = 2.0 * self.indexer.n_heads * (self.indexer.head_dim + 1)
        selection = 0.0 if dense else score * seq_len
        return attention + selection + 3.0 * score * keys

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        q, residual = self.queries(x, cos, sin)
        assert residual is not None  # q_lora_rank, checked at construction
        latent, k_rot = self.latent(x, cos, sin)
        index_q, index_k, index_w = self.indexer(x.detach(), residual.detach(), cos, sin)
        widths = [latent.shape[-1], k_rot.shape[-1], index_k.shape[-1]]
        own = torch.cat([latent, k_rot, index_k.to(latent.dtype)], dim=-1)  # [B, T, C]: all a key is made of
        if cache is not None:  # generation: the cached tokens' keys, then these
            every = cache.extend("latent", own)  # [B, S, C]
            given: Sequence | None = Sequence(
                positions=cache.positions(x.shape[1], x.device),
                key_positions=cache.stored_positions(every.shape[1], x.device),
            )
        else:
            every, given = self.keys(own, sequence), sequence  # context parallelism: every rank's keys
        ordered, (every,) = keys_in_order(given, every)
        latent_all, k_rot_all, index_k_all = every.split(widths, dim=-1)
        index_k_all = index_k_all.float()
        learn = auxiliary_wanted()
        kl: torch.Tensor | None = None
        if self.dense_warmup or self.indexer.topk >= every.shape[1]:  # every key a query sees is selected
            k, v = self.expand(latent_all, k_rot_all)  # [B, S, H, w], [B, S, H, v]
            # Keys from elsewhere (context parallelism's) reach the core by its own means, in its own order.
            local = every is own or cache is not None
            out = self.attend_dense(q, *((k, v) if local else self.expand(latent, k_rot)), None, given)
            if learn:
                sums, seen = dense_head_sums(q, k, ordered, self.scale)
                kl = indexer_kl(index_q, index_k_all, index_w, None, seen, self.head_sums(sums), self.indexer.scale)
        else:
            indices, valid = select(self.indexer, index_q, index_k_all, index_w, ordered)
            # Each head's key and value rows of wkv_b (this rank's heads: its shard under tensor parallelism).
            rows = local_weight(self.wkv_b.weight).view(-1, self.nope + self.v_dim, latent.shape[-1])
            q_latent = torch.einsum("bthn,hnr->bthr", q[..., : self.nope], rows[:, : self.nope])
            out, sums = sparse_attention(
                q_latent, q[..., self.nope :], self.shared_keys(latent_all), k_rot_all, indices, valid, self.scale
            )
            out = torch.einsum("bthr,hvr->bthv", out, rows[:, self.nope :])
            if learn:
                sums = self.head_sums(sums)
                kl = indexer_kl(index_q, index_k_all, index_w, indices, valid, sums, self.indexer.scale)
        if kl is not None:
            out = add_auxiliary_loss(out, "indexer_loss", kl, self.loss_weight)
        return self.wo(out.flatten(2))


def train_indexers_only(model: nn.Module) -> int:
    """The dense warm-up's freeze: every parameter of `model` but its indexers' stops requiring a gradient (so no
    optimizer, gradient norm or clip sees it). Returns how many indexer parameters train."""
    trained = 0
    for name, param in model.named_parameters():
        own = ".indexer." in f".{name}"
        param.requires_grad_(own)
        trained += param.numel() if own else 0
    return trained
