"""Token files read in place: where the ids of an llm.c / modded-nanogpt `.bin`, a nanoGPT raw `.bin`, a
`.npy` array or a Megatron `.bin`/`.idx` pair lie, their id type, and a check that every id is in the vocabulary.
"""

from __future__ import annotations

import numpy as np

from titanlite.base.errors import ConfigError
from titanlite.data.indexed import documents_end_with, index_path_for, read_indexed_layout
from titanlite.data.sources import SourceFile, fingerprint
from titanlite.data.tokenizer import Tokenizer

LLMC_HEADER_INTS = 256
LLMC_FORMATS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, token dtype)
SCAN_CHUNK = 2**26


def inspect_token_file(f: SourceFile, tokenizer: Tokenizer) -> dict:
    """Where the ids of a .bin/.npy file lie and what type they are; ConfigError (naming the file) for a
    bad header, a truncated file or an id outside the tokenizer's vocabulary. A .bin with a Megatron .idx
    beside it is read by that index (its id type and documents), never as raw data."""
    extra = {}
    if f.path.lower().endswith(".npy"):
        dtype, offset, count = _npy_layout(f.path)
    elif index_path_for(f.path) is not None:
        layout = read_indexed_layout(f.path, f.size)
        dtype, offset, count = layout.dtype, 0, layout.count
        extra = {"documents": layout.documents, "ends_with_eot": documents_end_with(f.path, layout, tokenizer.eot_id)}
    else:
        dtype, offset, count = _bin_layout(f)
    if count == 0:
        raise ConfigError(f"{f.path} holds no tokens; remove it from the corpus")
    ids = np.memmap(f.path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    low = min(int(ids[i : i + SCAN_CHUNK].min()) for i in range(0, count, SCAN_CHUNK))
    high = max(int(ids[i : i + SCAN_CHUNK].max()) for i in range(0, count, SCAN_CHUNK))
    if low < 0 or high >= tokenizer.vocab_size:
        bad = low if low < 0 else high
        raise ConfigError(
            f"{f.path} holds token id {bad}, outside model.tokenizer '{tokenizer.name}' (ids "
            f"0..{tokenizer.vocab_size - 1}); "
            "tokenize it with the same tokenizer or set model.tokenizer to the one it was made with"
        )
    return {
        **f.as_record(),
        "fingerprint": fingerprint(f.path, f.size),
        "dtype": np.dtype(dtype).str,
        "offset": offset,
        "count": count,
        "max_id": high,
        **extra,
    }


def _bin_layout(f: SourceFile) -> tuple[np.dtype, int, int]:
    """An llm.c / modded-nanogpt shard (256 int32 header: magic, version, token count) or, without that
    header, nanoGPT's raw uint16 array."""
    with open(f.path, "rb") as handle:
        data = handle.read(LLMC_HEADER_INTS * 4)
    header = np.frombuffer(data[: len(data) // 4 * 4], dtype="<i4")
    magic = int(header[0]) if len(header) else 0
    if magic in LLMC_FORMATS:
        version, dtype = LLMC_FORMATS[magic]
        if len(header) < LLMC_HEADER_INTS or int(header[1]) != version:
            found = int(header[1]) if len(header) > 1 else "none"
            raise ConfigError(
                f"{f.path} has llm.c magic {magic} but version {found} (expected {version}); re-create the shard"
            )
        count, offset = int(header[2]), LLMC_HEADER_INTS * 4
        available = (f.size - offset) // np.dtype(dtype).itemsize
        if count > available:
            raise ConfigError(
                f"{f.path} is truncated: its header promises {count:,} tokens but the file holds {available:,}; "
                "re-create or remove it"
            )
        return np.dtype(dtype), offset, count
    if len(header) == LLMC_HEADER_INTS and int(header[1]) in (1, 7) and magic and not header[3:].any():
        known = " or ".join(f"{m} ({np.dtype(d).name})" for m, (_, d) in LLMC_FORMATS.items())
        raise ConfigError(
            f"{f.path} has an llm.c-style header with the unknown magic {magic} (expected {known}); re-create the shard"
        )
    if f.size % 2:
        raise ConfigError(
            f"{f.path} has no llm.c header and an odd size, so it is not a raw uint16 token array; re-create it"
        )
    return np.dtype(np.uint16), 0, f.size // 2


def _npy_layout(path: str) -> tuple[np.dtype, int, int]:
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable .npy file ({e}); re-create or remove it") from e
    if not isinstance(array, np.memmap) or array.dtype.kind not in "iu" or not array.flags.c_contiguous:
        raise ConfigError(
            f"{path} holds {array.dtype} values, not a contiguous array of integer token ids; re-create it"
        )
    return array.dtype, int(array.offset), int(array.size)
