"""Megatron-LM indexed datasets (a `.bin` of token ids beside its `.idx`, as Megatron's preprocess_data.py
writes them), read in place: the `.idx` is checked once and tells where each document ends in the `.bin`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlite.base.errors import ConfigError

# The .idx layout of megatron/core/datasets/indexed_dataset.py (_IndexWriter), all little-endian: magic,
# uint64 version, uint8 dtype code, uint64 sequence count S, uint64 document-index count D (documents + 1),
# then int32 sequence lengths [S], int64 sequence byte offsets [S], int64 document indices [D] (0 .. S:
# document i is sequences doc[i] .. doc[i+1]) and, for a multimodal dataset only, int8 sequence modes [S].
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
# Megatron's DType codes that hold token ids; 6 and 7 are float64 and float32.
ID_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 8: "<u2"}
FLOAT_CODES = {6: "float64", 7: "float32"}
# Index arrays are checked this many entries at a time, so memory stays bounded with 10^8 sequences.
CHUNK = 2**22
REMAKE = "re-create it with Megatron's tools/preprocess_data.py"


@dataclass(frozen=True)
class IndexedLayout:
    """What a Megatron .idx says of its .bin: the token type, the number of tokens (`count`) and of
    documents, and the token offset where each document ends (cumulative; an empty document ends where
    the one before it does)."""

    dtype: np.dtype
    count: int
    documents: int
    document_ends: np.ndarray


def index_path_for(bin_path: str) -> str | None:
    """The Megatron index beside a `.bin` file (same prefix, `.idx`), or None when there is none."""
    path = Path(bin_path)
    if path.suffix.lower() != ".bin":
        return None
    index = path.with_suffix(".idx")
    return str(index) if index.is_file() else None


def read_indexed_layout(bin_path: str, bin_size: int) -> IndexedLayout:
    """The layout of a Megatron `.bin` (of `bin_size` bytes) from its `.idx`, read through a memory map and
    checked: header, file size, sequence offsets, document indices and the `.bin` size. ConfigError
    (naming the file to re-create) when any of them is wrong."""
    idx_path = index_path_for(bin_path)
    if idx_path is None:
        raise ConfigError(f"{bin_path} has no Megatron index (.idx) beside it; {REMAKE}")
    dtype, sequences, entries = _read_header(idx_path)
    lengths, pointers, doc_index = _index_arrays(idx_path, sequences, entries)
    count = _check_sequences(idx_path, lengths, pointers, dtype.itemsize)
    _check_document_index(idx_path, doc_index, sequences)
    if bin_size != count * dtype.itemsize:
        raise ConfigError(
            f"{bin_path} holds {bin_size:,} bytes but its index lists {count:,} {dtype.name} tokens "
            f"({count * dtype.itemsize:,} bytes): it is truncated or not the index's data file; {REMAKE}"
        )
    if count == 0:
        raise ConfigError(f"{bin_path} holds no tokens; remove it from the corpus")
    ends = _document_ends(doc_index, pointers, count, dtype.itemsize)
    return IndexedLayout(dtype, count, entries - 1, ends)


def documents_end_with(bin_path: str, layout: IndexedLayout, eot_id: int) -> bool:
    """Whether the last token of every non-empty document is `eot_id`, as preprocess_data.py --append-eod
    makes it (it leaves an empty document empty). Reads one token per document."""
    ids = np.memmap(bin_path, dtype=layout.dtype, mode="r", shape=(layout.count,))
    ends = layout.document_ends
    for part in _chunks(len(ends)):
        previous = ends[part.start - 1] if part.start else 0
        last = ends[part][np.diff(ends[part], prepend=previous) > 0] - 1
        if (ids[last] != eot_id).any():
            return False
    return True


def _read_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """Token type, sequence count and document-index count, after checking the header and file size."""
    try:
        with open(idx_path, "rb") as f:
            head = f.read(HEADER.size)
        size = os.path.getsize(idx_path)
    except OSError as e:
        raise ConfigError(f"cannot read {idx_path} ({e.strerror}); fix its permissions or {REMAKE}") from e
    if head[: len(MAGIC)] != MAGIC:
        raise ConfigError(f"{idx_path} does not start with Megatron's index magic MMIDIDX; {REMAKE}")
    if len(head) < HEADER.size:
        raise ConfigError(f"{idx_path} is truncated inside its header; {REMAKE}")
    _, version, code, sequences, entries = HEADER.unpack(head)
    if version != VERSION:
        raise ConfigError(f"{idx_path} has index version {version}, not {VERSION}; {REMAKE}")
    if code in FLOAT_CODES:
        raise ConfigError(f"{idx_path} holds {FLOAT_CODES[code]} values, not token ids; {REMAKE} from text")
    if code not in ID_DTYPES:
        raise ConfigError(f"{idx_path} has the unknown dtype code {code}; {REMAKE}")
    expected = HEADER.size + 12 * sequences + 8 * entries
    if sequences and size == expected + sequences:
        raise ConfigError(
            f"{idx_path} is a multimodal index (it carries sequence_modes); only text token data is read: "
            f"{REMAKE} without multimodal items"
        )
    if size != expected:
        raise ConfigError(
            f"{idx_path} holds {size:,} bytes but its header ({sequences:,} sequences, {entries:,} document "
            f"indices) needs {expected:,}: it is truncated or damaged; {REMAKE}"
        )
    return np.dtype(ID_DTYPES[code]), sequences, entries


def _index_arrays(idx_path: str, sequences: int, entries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of the sequence lengths, sequence byte offsets and document indices in a memory map of the .idx."""
    data = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(data, dtype="<i4", count=sequences, offset=HEADER.size)
    pointers = np.frombuffer(data, dtype="<i8", count=sequences, offset=HEADER.size + 4 * sequences)
    doc_index = np.frombuffer(data, dtype="<i8", count=entries, offset=HEADER.size + 12 * sequences)
    return lengths, pointers, doc_index


def _check_sequences(idx_path: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """The total number of tokens, after checking that each sequence starts (in bytes) where the ones
    before it end, which is how Megatron lays out the .bin."""
    total = 0
    for part in _chunks(len(lengths)):
        sizes = lengths[part].astype(np.int64)
        starts = (total + np.cumsum(sizes) - sizes) * itemsize
        bad = np.flatnonzero((sizes < 0) | (pointers[part] != starts))
        if len(bad):
            raise ConfigError(
                f"{idx_path} has sequence {part.start + int(bad[0]):,} at a byte offset that does not follow the "
                f"lengths before it: the index is damaged; {REMAKE}"
            )
        total += int(sizes.sum())
    return total


def _check_document_index(idx_path: str, doc_index: np.ndarray, sequences: int) -> None:
    rising = (
        len(doc_index) > 0
        and doc_index[0] == 0
        and doc_index[-1] == sequences
        and all((np.diff(doc_index[part.start : part.stop + 1]) >= 0).all() for part in _chunks(len(doc_index)))
    )
    if not rising:
        raise ConfigError(
            f"{idx_path} has document indices that do not rise from 0 to its {sequences:,} sequences: the index "
            f"is damaged; {REMAKE}"
        )


def _document_ends(doc_index: np.ndarray, pointers: np.ndarray, count: int, itemsize: int) -> np.ndarray:
    """The token offset where each document ends: where its next sequence starts, or the end of the data."""
    following = doc_index[1:]
    ends = np.full(len(following), count, dtype=np.int64)
    for part in _chunks(len(following)):
        inside = np.flatnonzero(following[part] < len(pointers))
        ends[part.start + inside] = pointers[following[part][inside]] // itemsize
    return ends


def _chunks(n: int) -> Iterator[slice]:
    return (slice(lo, min(n, lo + CHUNK)) for lo in range(0, n, CHUNK))
