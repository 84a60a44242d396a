"""A key/value cache for incremental decoding: each layer keeps the keys and values of the positions seen
so far, so a new token costs one attention over the cache rather than a forward over the whole sequence. A
linear-attention layer keeps its recurrent state instead (and its convolution's last inputs): `LayerCache.state`.

KVCache counts positions on the host and attends over the filled part; StaticKVCache keeps the count on the
device and always attends over its whole buffer under a mask, so a decode step has the same shapes and the
same kernels at every position and can be captured once as a CUDA graph and replayed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titanlite.models.common.attention import CoreAttention, Sequence, attend


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
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # layer name -> its states by key (linear attention)
        self.rows: dict[tuple[str, str], torch.Tensor] = {}  # (layer name, key) -> [B, max_len, C] (extend)

    def layer(self, name: str) -> LayerCache:
        """The part of the cache that the model's layer `name` (its key in model.layers) reads and writes."""
        return LayerCache(self, name)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions [t] of t new tokens: the first uncached ones (the model's rotations and embeddings)."""
        return torch.arange(self.length, self.length + t, device=device)

    def store(self, name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, hd] at positions length..length+T-1 of layer `name`; return the keys and
        values of all positions so far, [B, H_kv, length+T, hd] (views of the buffers, not copies)."""
        return self.write(self.keys, name, k, 2), self.write(self.values, name, v, 2)

    def extend(self, name: str, key: str, rows: torch.Tensor) -> torch.Tensor:
        """Write rows [B, T, C] (one per token: what a layer keeps of each, e.g. the sparse attention's latents and
        indexer keys) at positions length..length+T-1 of layer `name`'s `key`; return those of all positions so far
        [B, length+T, C] (a view of the buffer)."""
        return self.write(self.rows, (name, key), rows, 1)

    def write(self, buffers: dict, key, new: torch.Tensor, dim: int) -> torch.Tensor:
        """Write `new` at positions length..length+n-1 along its dimension `dim` (n its size there) into
        buffers[key], made for max_len positions at the first write; return the positions so far (a view)."""
        start, end = self.length, self.length + new.shape[dim]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot add {new.shape[dim]} to {start}")
        if key not in buffers:
            buffers[key] = new.new_empty((*new.shape[:dim], self.max_len, *new.shape[dim + 1 :]))
        buffers[key].narrow(dim, start, end - start).copy_(new)
        return buffers[key].narrow(dim, 0, end)

    def advance(self, n: int) -> None:
        """Count n new positions as cached; the model calls this after its last layer has stored them."""
        self.length += n

    def set_state(self, name: str, key: str, value: torch.Tensor) -> None:
        """Keep `value` as layer `name`'s state `key`: copied into the tensor kept before where there is one of its
        shape and dtype (so a captured CUDA graph that reads and writes it stays right), kept as it is otherwise."""
        held = self.states.setdefault(name, {})
        old = held.get(key)
        if old is not None and old.shape == value.shape and old.dtype == value.dtype:
            old.copy_(value)
        else:
            held[key] = value.detach().clone()

    def attend(
        self,
        name: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        core: CoreAttention | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LayerCache.attend for layer `name`: through the core where it asks for more than plain causal attention,
        with the queries' positions and the stored keys' (stored_positions), else by causal_attention."""
        query_positions = self.positions(q.shape[2], q.device)  # before store(): its writes do not move them
        k, v = self.store(name, k, v)
        if core is not None and (shaped(core) or sinks is not None):
            sequence = Sequence(positions=query_positions, key_positions=self.stored_positions(k.shape[2], q.device))
            return attend(core, q, k, v, sequence, sinks)
        return self.causal_attention(q, k, v, query_positions)

    def stored_positions(self, keys: int, device: torch.device) -> torch.Tensor:
        """The positions [keys] of the keys store() returned: 0..keys-1."""
        return torch.arange(keys, device=device)

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention of the new queries (at `query_positions`) over the stored keys and values, by SDPA."""
        gqa = q.shape[1] != k.shape[1]
        start, t = self.length, q.shape[2]
        if start == 0 or t == 1:
            # A prefill is the usual lower triangle; a single new token is the newest position and sees all.
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=shifted_causal_mask(start, t, q.device), enable_gqa=gqa
        )


class StaticKVCache(KVCache):
    """A KVCache whose count of cached positions is a device tensor (`position`), written and read by kernels.

    Keys and values go to their positions by index (index_copy_), attention reads all max_len positions with a
    mask of those at or before each query's, and advance() adds to `position` in place: no host value changes
    between decode steps, so one step captured as a CUDA graph is right at every position when replayed. The
    caller keeps the positions under max_len (an index past the buffer is a device error, not a host check)."""

    def __init__(self, max_len: int, device: torch.device):  # KVCache's host-side `length` is a property here
        self.max_len = max_len
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self.rows: dict[tuple[str, str], torch.Tensor] = {}
        self.position = torch.zeros((), dtype=torch.long, device=device)  # positions cached so far
        self.key_positions = torch.arange(max_len, device=device)  # [max_len]

    # Read-only where KVCache's is an attribute: nothing here sets it (advance moves `position` instead).
    @property
    def length(self) -> int:  # type: ignore[override]
        """The count on the host (reads the device); not for code that a CUDA graph replays."""
        return int(self.position.item())

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        return self.position + torch.arange(t, device=device)

    def write(self, buffers: dict, key, new: torch.Tensor, dim: int) -> torch.Tensor:
        """Write `new` at positions position..position+n-1 along `dim` by index; return the whole buffer (zeros
        where nothing is cached: those positions are masked, read but never used)."""
        if key not in buffers:
            buffers[key] = new.new_zeros((*new.shape[:dim], self.max_len, *new.shape[dim + 1 :]))
        buffers[key].index_copy_(dim, self.positions(new.shape[dim], new.device), new)
        return buffers[key]

    def advance(self, n: int) -> None:
        self.position += n

    def stored_positions(self, keys: int, device: torch.device) -> torch.Tensor:
        """The whole buffer's positions: those past the cached ones are later than every query, so masked."""
        return self.key_positions

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor
    ) -> torch.Tensor:
        mask = self.key_positions[None, :] <= query_positions[:, None]  # [T, max_len]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@dataclass(frozen=True)
class LayerCache:
    """One layer's view of a KVCache: its attention hands over the new q, k, v and gets the output back."""

    cache: KVCache
    name: str

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        core: CoreAttention | None = None,
        sinks: torch.Tensor | None = None,
    ):
        """Attention [B, Hq, T, hd] of the T new queries over every cached position and themselves.

        q is [B, Hq, T, hd], k and v [B, H_kv, T, hd]; with fewer key/value heads than query heads (Llama's
        grouped-query attention) query head j reads key/value head j // (Hq / H_kv), as in the model. `core`:
        the layer's attention core; where it has a window, a softcap, a scale or `sinks` (the block's sink logits
        [Hq]), it attends with them, over the cached positions."""
        return self.cache.attend(self.name, q, k, v, core, sinks)

    def extend(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """This layer's rows `key` of every cached position and the new ones [B, S, C] (KVCache.extend)."""
        return self.cache.extend(self.name, key, rows)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The positions [t] of the t new tokens (before the model advances the cache past them)."""
        return self.cache.positions(t, device)

    def stored_positions(self, keys: int, device: torch.device) -> torch.Tensor:
        """The positions of the `keys` rows extend returned (a static cache's whole buffer: those past the cached
        ones are later than every query, so masked)."""
        return self.cache.stored_positions(keys, device)

    def state(self, key: str) -> torch.Tensor | None:
        """This layer's state `key` after the cached positions (None before the first forward): a linear-attention
        layer's recurrent state or its convolution's last inputs."""
        return self.cache.states.get(self.name, {}).get(key)

    def set_state(self, key: str, value: torch.Tensor) -> None:
        """Keep `value` as this layer's state `key` for the next forward (KVCache.set_state)."""
        self.cache.set_state(self.name, key, value)


def shaped(core: CoreAttention) -> bool:
    """Whether a core asks for more than plain causal attention (a window, a softcap, a scale, sinks)."""
    return any(value is not None and value is not False for value in core.options().values())


def shifted_causal_mask(start: int, t: int, device: torch.device) -> torch.Tensor:
    """[t, start+t] booleans: new query i (position start+i) sees cached positions 0..start+i.

    SDPA's is_causal aligns its triangle to the top-left corner when queries and keys differ in number,
    which would hide from T > 1 new tokens the positions cached before them."""
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start)
