"""A key/value cache for incremental decoding: each layer keeps the keys and values of the positions seen
so far, so a new token costs one attention over the cache rather than a forward over the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of positions 0..length-1 for every layer, in buffers preallocated for max_len positions.

    A model's forward(tokens, cache=cache) reads and extends it: the tokens sit at positions
    length..length+T-1, and length grows by T once every layer has stored its keys and values.
    Buffers are allocated at a layer's first write, with the batch size, local head count, dtype and device of
    its keys (bfloat16 under autocast), so neither the model nor the caller has to state them."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.keys: dict[str, torch.Tensor] = {}  # layer name -> [B, H_kv, max_len, head_dim]
        self.values: dict[str, torch.Tensor] = {}

    def layer(self, name: str) -> LayerCache:
        """The part of the cache that the model's layer `name` (its key in model.layers) reads and writes."""
        return LayerCache(self, name)

    def store(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, hd] at positions length..length+T-1 of layer `name`; return the keys and
        values of all positions so far, [B, H_kv, length+T, hd] (views of the buffers, not copies)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot add {k.shape[2]} to {start}")
        if name not in self.keys:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys[name] = k.new_empty(shape)
            self.values[name] = v.new_empty(shape)
        self.keys[name][:, :, start:end] = k
        self.values[name][:, :, start:end] = v
        return self.keys[name][:, :, :end], self.values[name][:, :, :end]

    def advance(self, n: int) -> None:
        """Count n new positions as cached; the model calls this after its last layer has stored them."""
        self.length += n


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a KVCache: its attention hands over the new q, k, v and gets the output back."""

    cache: KVCache
    name: str

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention [B, Hq, T, hd] of the T new queries over every cached position and themselves.

        q is [B, Hq, T, hd], k and v [B, H_kv, T, hd]; with fewer key/value heads than query heads (Llama's
        grouped-query attention) query head j reads key/value head j // (Hq / H_kv), as in the model."""
        start = self.cache.length
        k, v = self.cache.store(self.name, k, v)
        gqa = q.shape[1] != k.shape[1]
        t = q.shape[2]
        if start == 0 or t == 1:
            # A prefill is the usual lower triangle; a single new token is the newest position and sees all.
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=shifted_causal_mask(start, t, q.device), enable_gqa=gqa
        )


def shifted_causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor:
    """[t, start+t] booleans: new query i (position start+i) sees cached positions 0..start+i.

    SDPA's is_causal aligns its triangle to the top-left corner when queries and keys differ in number,
    which would hide from T > 1 new tokens the positions cached before them."""
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start)
