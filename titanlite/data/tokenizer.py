"""Tokenizers that turn corpus text into token ids, all usable with no network access.
`build_tokenizer` picks one by the name in `model.tokenizer`: the GPT-2 BPE or raw UTF-8 bytes."""

from __future__ import annotations

import base64
import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tiktoken

from titanlite.errors import ConfigError

GPT2_RANKS_PATH = Path(__file__).parent / "assets" / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = "<|endoftext|>"

# The GPT-2 split pattern as tiktoken ships it (tiktoken_ext/openai_public.py, r50k_pat_str);
# copied because tiktoken_ext's registry would try to download the ranks.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class Tokenizer(ABC):
    """Text to ids and back; `vocab_size` counts real ids (before any padding of the embedding)."""

    name: str
    vocab_size: int
    eot_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without an end-of-text id appended."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; undecodable bytes become U+FFFD rather than raising."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of several documents; subclasses override this when batching is faster."""
        return [self.encode(text) for text in texts]

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """encode_batch's ids as uint32 arrays; subclasses override this when they can skip the Python lists."""
        return [np.array(ids, dtype=np.uint32) for ids in self.encode_batch(texts)]

    @property
    def fingerprint(self) -> str:
        """What identifies this tokenizer's ids: prepared token stores are keyed on it."""
        return self.name


class GPT2Tokenizer(Tokenizer):
    """The GPT-2 byte-pair encoding (50257 ids, end-of-text 50256) from the bundled rank file."""

    name = "gpt2"
    vocab_size = 50257
    eot_id = 50256

    def __init__(self) -> None:
        self._encoding = _gpt2_encoding()

    def __reduce__(self):
        # Worker processes rebuild the encoding from the shipped file rather than unpickle its tables.
        return (GPT2Tokenizer, ())

    def encode(self, text: str) -> list[int]:
        # encode_ordinary treats "<|endoftext|>" in the corpus as plain text instead of raising.
        return self._encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: `prepare` already runs one worker process per core (more threads oversubscribe them).
        return self._encoding.encode_ordinary_batch(texts, num_threads=1)

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # Straight from tiktoken's buffer (tiktoken >= 0.9): in `prepare`, building lists of Python ints
        # and converting them cost about as much as the encoding itself (`titanlite bench data`). With no
        # special token allowed, the ids are encode_ordinary's ("<|endoftext|>" in the text stays text).
        if not hasattr(self._encoding, "encode_to_numpy"):
            return super().encode_batch_arrays(texts)
        return [self._encode_array(text) for text in texts]

    def _encode_array(self, text: str) -> np.ndarray:
        try:
            return self._encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates become U+FFFD, as encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self._encoding.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        # tiktoken's Rust side only accepts Python ints, not numpy or torch scalars.
        return self._encoding.decode([int(i) for i in ids])


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 plus end-of-text 256: no vocabulary file, any text encodes."""

    name = "byte"
    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:
            # Lone surrogates (legal in JSON strings) become U+FFFD, as tiktoken does for GPT-2.
            return list(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i for i in (int(i) for i in ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}


def build_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called `name` ("byte" or "gpt2")."""
    if name not in TOKENIZERS:
        raise ConfigError(f"model.tokenizer={name!r} is unknown; use one of: {', '.join(sorted(TOKENIZERS))}")
    return TOKENIZERS[name]()


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=_read_ranks(GPT2_RANKS_PATH),
        special_tokens={GPT2_EOT: GPT2Tokenizer.eot_id},
        explicit_n_vocab=GPT2Tokenizer.vocab_size,
    )


def _read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a .tiktoken rank file ("<base64 token> <rank>" per line).

    tiktoken.load.load_tiktoken_bpe is not used: even for a local path it copies the file into
    $TIKTOKEN_CACHE_DIR (or /tmp/data-gym-cache) and later prefers that copy, unchecked.
    """
    try:
        contents = path.read_bytes()
    except OSError as e:
        reason = e.strerror
        raise ConfigError(f"cannot read {path} ({reason}); reinstall titanlite or use model.tokenizer = 'byte'") from e
    if hashlib.sha256(contents).hexdigest() != GPT2_RANKS_SHA256:
        raise ConfigError(f"{path} is damaged (sha256 mismatch); reinstall titanlite or use model.tokenizer = 'byte'")
    ranks = {}
    for line in contents.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks
