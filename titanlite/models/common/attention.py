"""Causal self-attention and the positions it needs: which tokens a query may see (earlier ones, and with a
block-causal mask only those of its own document), and where each token stands in its sequence.

`Sequence` describes the tokens a forward pass holds: by default positions 0..T-1 of whole sequences, plain
causal. Each block's attention runs through a core chosen by name (`build_core`, `ATTENTION_CORES`). Context
parallelism (titanlite/parallel/context_parallel.py) hands a rank part of each sequence and gathers the keys and
values of the rest; it does so by wrapping each block's core, whichever it is, and by the positions it gives
here. The model itself knows nothing of it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.base.errors import ConfigError

ATTENTION_MASKS = ("causal", "block_causal")


class MaskCache:
    """The masks built for one Sequence, by (queries, keys, dtype), held weakly: a mask lives as long as a
    block keeps it for its backward, so without activation checkpointing every block shares one, and with
    it each block builds its own and frees it. A plain holder, not a dict: FSDP's forward hooks rebuild a
    Sequence for every block and copy the containers they find in it, but hand this on as it is."""

    def __init__(self):
        self.by_shape: dict[tuple, weakref.ref] = {}

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
    whole sequences, plain causal), giving [B, Hq, T, hd]. A core has no parameters or buffers, so choosing
    another, or wrapping one (context parallelism), leaves a model's state dict as it is."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence: Sequence | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is an attention core without a forward")


class SDPAttention(CoreAttention):
    """scaled_dot_product_attention: the fused causal kernel for plain sequences, an additive mask otherwise;
    grouped-query attention (query head j reads key/value head j // (Hq / Hkv)) inside the kernel, without
    copying K and V per head."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequence: Sequence | None) -> torch.Tensor:
        gqa = q.shape[1] != k.shape[1]
        if sequence is None or sequence.plain:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = additive_mask(sequence, q.shape[2], k.shape[2], q.dtype, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# The attention cores by name: what a family's blocks build (build_core).
ATTENTION_CORES: dict[str, type[CoreAttention]] = {"sdpa": SDPAttention}


def build_core(name: str) -> CoreAttention:
    """A new attention core of the kind registered as `name` in ATTENTION_CORES."""
    if name not in ATTENTION_CORES:
        raise ConfigError(f"attention core {name!r} is not a known one; use one of: {', '.join(ATTENTION_CORES)}")
    return ATTENTION_CORES[name]()


def additive_mask(sequence: Sequence, queries: int, keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """attention_mask as the float SDPA adds to the scores (0 where a query may attend, -inf elsewhere),
    shared by every block that keeps it (MaskCache); under torch.compile built in each block's graph."""
    key = (queries, keys, dtype)
    compiling = torch.compiler.is_compiling()
    mask = None if compiling else sequence.masks.get(key)
    if mask is None:
        allowed = attention_mask(sequence, queries, keys, device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        if not compiling:
            sequence.masks.put(key, mask)
    return mask


def attention_mask(sequence: Sequence, queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """[B or 1, 1, T, S] bool, True where a query may attend: keys at or before its position, and, with
    documents, only those of its own document."""
    q_pos = sequence.positions if sequence.positions is not None else torch.arange(queries, device=device)
    k_pos = sequence.key_positions if sequence.key_positions is not None else q_pos
    mask = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if sequence.documents is None:
        return mask[None, None]
    k_doc = sequence.key_documents if sequence.key_documents is not None else sequence.documents
    same = sequence.documents[:, :, None] == k_doc[:, None, :]  # [B, T, S]
    return (mask[None] & same)[:, None]
