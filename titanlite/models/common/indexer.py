"""The lightning indexer's scoring, selection and loss, shared by the two sparse attentions that pick keys with one
(DeepSeek-V3.2 / GLM-5's over tokens: titanlite/models/common/latent/sparse.py; DeepSeek-V4's over compressed blocks:
titanlite/models/common/compressed_attention.py). The scores of query t against key s are
I[t, s] = sum_h w[t, h] relu(scale q[t, h] . k[s]); each query keeps the topk keys of highest score among those its
mask lets it see; the indexer learns from the KL divergence between the attention's own weights over the selected keys
(summed over its heads, renormalised) and the softmax of its scores there. Everything a chunk of queries at a time,
so no T x S matrix exists whole."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titanlite.models.common.attention import block_of

# Elements of one chunk's per-head indexer scores [B, Q, H_index, S] (and of a chunk's gathered keys): chunks of
# queries are cut to stay near it, so memory does not grow with T x S. 16 MiB of float32 on the CPU; 1 GiB on a GPU,
# where many small chunks would cost a launch each (a real model's indexer has 64 heads over 100k keys and more).
CHUNK_ELEMENTS = 1 << 22
CUDA_CHUNK_ELEMENTS = 1 << 28


def chunk_elements(device: str) -> int:
    """The elements of a chunk on `device` ("cuda", "cpu", ...)."""
    return CUDA_CHUNK_ELEMENTS if device == "cuda" else CHUNK_ELEMENTS


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's scores [B, Q, S] of queries q [B, Q, H, D] (head weights [B, Q, H]) against keys k [B, S, D], in
    transformers' order of operations (the same rounding, so the same keys tie); without a gradient, the per-head
    scores scaled and cut at zero in place (one [B, Q, H, S] tensor, not three)."""
    per_head = torch.matmul(q, k.transpose(-1, -2).unsqueeze(1))  # [B, Q, H, S]
    if torch.is_grad_enabled():
        per_head = F.relu(per_head * scale)
    else:
        per_head = per_head.mul_(scale).relu_()
    return torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)


def spans(queries: int, width: int, device: torch.device) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of `queries` when each query costs `width` elements: as many as keep a chunk under
    chunk_elements, all of them on the meta device (the planner's shapes, where a chunk costs no memory and each costs
    time; the planner adds one chunk's scores itself)."""
    chunk = queries if device.type == "meta" else chunk_elements(device.type) // max(width, 1)
    chunk = max(1, chunk)
    for start in range(0, queries, chunk):
        yield start, min(queries, start + chunk)


def recomputed(fn, training: bool, *args):
    """fn(*args), recomputed in backward where `training` (nothing it makes is kept for backward but its inputs)."""
    return checkpoint(fn, *args, use_reentrant=False) if training else fn(*args)


@torch.no_grad()
def select_among(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, allowed, topk: int, scale: float, stable: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's `topk` keys of highest indexer score (at most the S there are) among those `allowed` (a
    mask_function's allowed(b, q_idx, k_idx): titanlite/models/common/attention.py) lets it see: their indices
    [B, T, K] and whether each is one the query may see [B, T, K] (where fewer than K are, the rest are filler); the
    scores of queries q [B, T, H, D] (head weights [B, T, H]) over keys k [B, S, D], a chunk of queries at a time.
    `stable`: equal scores (the relu makes many exactly zero) are taken earliest key first (top_earliest), so the
    choice does not depend on how many keys of other sequences or documents stand around them (a packed row's blocks,
    a document alone's); else torch.topk's order, the one transformers' indexers take."""
    queries, keys = q.shape[1], k.shape[1]
    picked = min(topk, keys)
    # Written in place chunk by chunk: small results kept between the chunks' large scores would pin the heap's
    # freed blocks (the process's memory grew to 25 times its tensors' at 65,536 tokens).
    indices = torch.empty(q.shape[0], queries, picked, dtype=torch.long, device=q.device)
    valid = torch.empty(q.shape[0], queries, picked, dtype=torch.bool, device=q.device)
    for start, end in spans(queries, q.shape[0] * q.shape[2] * keys, q.device):
        scores = index_scores(q[:, start:end], k, weights[:, start:end], scale)
        seen = block_of(allowed, start, end, 0, keys, q.device)[:, 0]  # [B or 1, Q, S]
        scores = scores.masked_fill_(~seen, float("-inf"))
        if stable:
            top_values, top_indices = top_earliest(scores, picked)
        else:
            top_values, top_indices = scores.topk(picked, dim=-1)
        indices[:, start:end] = top_indices
        valid[:, start:end] = top_values > float("-inf")
        del scores, seen, top_values, top_indices
    return indices, valid


def top_earliest(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` highest `scores` along the last dimension and their indices [..., k], highest first and equal ones
    earliest first: a stable descending sort's first k, without sorting every score (a 10th of the time on the CPU for
    8,192 keys). torch.topk finds the k-th value; the scores above it and the earliest of those equal to it are the k;
    a sort of those k alone puts them in order."""
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above, level = scores > kth, scores == kth
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    chosen = above.logical_or_(level.logical_and_(level.cumsum(-1, dtype=torch.int32) <= room))
    del above, level
    # the chosen positions, earliest first: the k largest of -position among them (each position once, so no tie)
    position = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int32)
    indices = torch.where(chosen, -position, torch.iinfo(torch.int32).min).topk(k, dim=-1).indices
    values, order = scores.gather(-1, indices).sort(dim=-1, descending=True, stable=True)
    return values, indices.gather(-1, order)


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...] at indices [B, Q, K]: [B, Q, K, ...]."""
    batch = torch.arange(x.shape[0], device=x.device)[:, None, None]
    return x[batch, indices]


def _kl_span(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor | None,
    valid: torch.Tensor,
    target: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The summed KL divergence of a chunk of queries (indexer_kl)."""
    if indices is None:  # every key
        logits = index_scores(q, k, weights, scale)  # [B, Q, S]
    else:
        keys = gather_rows(k, indices)  # [B, Q, K, D]
        logits = torch.einsum("bqh,bqhk->bqk", weights, F.relu(torch.einsum("bqhd,bqkd->bqhk", q, keys) * scale))
    # In float64: the divergence is a small difference of terms near p log p (1e-4 of them at the start of training),
    # which float32's rounding would swamp, and it would differ from layout to layout by more than the losses do.
    log_q = torch.log_softmax(logits.double().masked_fill(~valid, float("-inf")), dim=-1)
    p = target.double().masked_fill(~valid, 0.0)
    terms = torch.where(p > 0, p * (torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) - log_q), 0.0)
    return terms.sum().float()


def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor | None,
    valid: torch.Tensor,
    head_sums: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The indexer's loss: the mean over queries of KL(p || softmax(I)), p each query's attention weights over its
    keys summed over every head (`head_sums` [B, T, K], all heads' sums) and renormalised, I the indexer's scores
    there (q, k, weights: Indexer's output, with their gradients). The keys: `indices` [B, T, K] (select's), or
    None for every key (then K is S); `valid` says which of them the query sees. Chunked and recomputed as the
    attention is."""
    head_sums = head_sums.double()
    target = head_sums / head_sums.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(head_sums.dtype).tiny)
    width = q.shape[0] * q.shape[2] * (indices.shape[-1] if indices is not None else k.shape[1])
    total = q.new_zeros(())
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, weights))
    for start, end in spans(q.shape[1], width, q.device):
        picked = None if indices is None else indices[:, start:end]
        span = (q[:, start:end], k, weights[:, start:end], picked, valid[:, start:end], target[:, start:end], scale)
        total = total + recomputed(_kl_span, training, *span)
    return total / (q.shape[0] * q.shape[1])


class SharedKeys(nn.Module):
    """The latents every head reads as its keys and values in the sparse path [B, S, r], as they are. Tensor
    parallelism, whose ranks each read them for some heads only, sums their gradient over its ranks here (what
    wkv_b's column-wise split does for the dense path's; models/common/latent/parallelize.py)."""

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return latent


class HeadSums(nn.Module):
    """Attention weights summed over this module's heads [B, T, K], as they are: the sum over every head. Tensor
    parallelism, which gives each rank some of the heads, sums them over its ranks here (models/common/latent/
    parallelize.py)."""

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return sums
