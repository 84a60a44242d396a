"""Tokenizers that turn corpus text into token ids, all usable with no network access.
`build_tokenizer` picks one by the name in `model.tokenizer`: the GPT-2 BPE, raw UTF-8 bytes, or a Hugging
Face tokenizer.json from the folder in `model.hf_assets_path`."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import tiktoken

from titanlite.base.errors import ConfigError, short_reason

GPT2_RANKS_PATH = Path(__file__).parent / "assets" / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = "<|endoftext|>"

# The GPT-2 split pattern as tiktoken ships it (tiktoken_ext/openai_public.py, r50k_pat_str);
# copied because tiktoken_ext's registry would try to download the ranks.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
# Where a folder may name its special token ids when tokenizer_config.json does not, in this order.
HF_ID_FILES = ("generation_config.json", "config.json")
# End-of-sequence tokens recognised by name when no config file names one, in this order.
HF_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
HF_ASSETS_HINT = (
    "model.tokenizer='hf' reads tokenizer.json from model.hf_assets_path; "
    "set model.hf_assets_path to a folder that has one"
)


class Tokenizer(ABC):
    """Text to ids and back; `vocab_size` counts real ids (before any padding of the embedding).

    A prepared store holds each document as its ids then `eot_id`, preceded by `bos_id` when that is not
    None (tokenizers trained to begin every sequence with a BOS token)."""

    name: str
    vocab_size: int
    eot_id: int
    bos_id: int | None = None

    @property
    def decodes(self) -> bool:
        """Whether decode turns ids back into the text they came from (a tokenizer.json without a decoder does not)."""
        return True

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
        self._encoding = gpt2_encoding()

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


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer read from <folder>/tokenizer.json, offline. Its end-of-sequence
    id (and beginning-of-sequence id, if it has one) come from the folder's config files, as transformers
    reads them: tokenizer_config.json, then generation_config.json / config.json."""

    name = "hf"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        data = _read_tokenizer_json(self.folder / HF_TOKENIZER_FILE)
        self._backend = _parse_tokenizer_json(self.folder / HF_TOKENIZER_FILE, data)
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        config = _read_json_object(self.folder / HF_TOKENIZER_CONFIG) or {}
        self.eot_id = _eos_id(self.folder, self._backend, config)
        self.declared_bos_id = _declared_bos_id(self.folder, self._backend, config)
        self.bos_id = _used_bos_id(self.declared_bos_id, self.eot_id, config)
        ids = f"\0bos={self.bos_id}\0eos={self.eot_id}".encode()
        self._fingerprint = "hf-" + hashlib.sha256(data + ids).hexdigest()

    def __reduce__(self):
        # Worker processes of `prepare` re-read the folder rather than unpickle the Rust tables.
        return (
            _unpickle_hf,
            (str(self.folder), self._fingerprint, self.vocab_size, self.eot_id, self.bos_id, self.declared_bos_id),
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def backend(self):
        """The `tokenizers.Tokenizer`; an unpickled copy reads the folder at first use and refuses a changed one."""
        if self._backend is None:
            fresh = HFTokenizer(self.folder)
            if fresh.fingerprint != self._fingerprint:
                raise ConfigError(
                    f"{self.folder / HF_TOKENIZER_FILE} or its config files changed while in use; run the command again"
                )
            self._backend = fresh._backend
        return self._backend

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._encodings(texts)]

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.array(encoding.ids, dtype=np.uint32) for encoding in self._encodings(texts)]

    def _encodings(self, texts: list[str]) -> list:
        # add_special_tokens=False: no template BOS/EOS, titanlite adds the document boundaries itself. The
        # library's own batching (its threads, as TOKENIZERS_PARALLELISM allows); encode_batch_fast, where the
        # installed version has it, skips the character offsets: about 30% faster for the same ids.
        backend = self.backend
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        try:
            return encode(texts, add_special_tokens=False)
        except TypeError:
            # The library refuses a lone surrogate (legal in JSON strings); it becomes U+FFFD, as in GPT2Tokenizer.
            return encode([_replace_surrogates(text) for text in texts], add_special_tokens=False)

    @property
    def decodes(self) -> bool:
        return self.backend.decoder is not None

    def decode(self, ids: Iterable[int]) -> str:
        # Byte-level and byte-fallback decoders turn a cut UTF-8 sequence into U+FFFD; unknown ids are dropped.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def _unpickle_hf(
    folder: str, fingerprint: str, vocab_size: int, eot_id: int, bos_id: int | None, declared_bos_id: int | None
) -> HFTokenizer:
    """An HFTokenizer whose folder is read at first use, not here: an error raised while a multiprocessing.Pool
    worker unpickles its task kills the worker and loses the task (the pool then waits forever), whereas
    an error at first use fails that task and reaches the caller."""
    tokenizer = HFTokenizer.__new__(HFTokenizer)
    tokenizer.folder, tokenizer._fingerprint, tokenizer._backend = Path(folder), fingerprint, None
    tokenizer.vocab_size, tokenizer.eot_id, tokenizer.bos_id, tokenizer.declared_bos_id = (
        vocab_size,
        eot_id,
        bos_id,
        declared_bos_id,
    )
    return tokenizer


def _replace_surrogates(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _read_tokenizer_json(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(
            f"cannot read {path} ({e.strerror}); set model.hf_assets_path to a folder with a readable tokenizer.json"
        ) from e


_PARSED: dict[str, object] = {}


def _parse_tokenizer_json(path: Path, data: bytes):
    """The tokenizers.Tokenizer of `data`, parsed once per process and content (workers meet it once per shard)."""
    digest = hashlib.sha256(data).hexdigest()
    if digest not in _PARSED:
        tokenizers = _import_tokenizers()
        try:
            backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:
            raise ConfigError(
                f"{path} is not a tokenizer.json the tokenizers library can read ({short_reason(e)}); replace it"
            ) from e
        # Special-token text inside the corpus ("</s>" in a web page) stays text, as GPT2Tokenizer.encode does.
        backend.encode_special_tokens = True
        _PARSED[digest] = backend
    return _PARSED[digest]


def _import_tokenizers():
    try:
        import tokenizers  # optional dependency (the [hf] extra)
    except ImportError as e:
        raise ConfigError(
            "model.tokenizer='hf' needs the tokenizers package; pip install tokenizers (or use 'gpt2' / 'byte')"
        ) from e
    return tokenizers


def _read_json_object(path: Path) -> dict | None:
    """A JSON object file of a tokenizer folder; None when the file does not exist."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path} ({short_reason(e)}); fix or remove it") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{path} holds a JSON {type(value).__name__}, not an object; fix or remove it")
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or a dict with its "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured_id(folder: Path, backend, config: dict, key: str) -> int | None:
    """The id of the `key` token ("eos"/"bos") the folder names: tokenizer_config.json's `<key>_token`, else
    generation_config.json's or config.json's `<key>_token_id` (the first of a list); None if none does."""
    text = _token_text(config.get(f"{key}_token"))
    if text is not None:
        found = backend.token_to_id(text)
        if found is None:
            raise ConfigError(
                f"{folder / HF_TOKENIZER_CONFIG} names {key}_token {text!r}, which tokenizer.json lacks; fix "
                f"{key}_token"
            )
        return found
    for name in HF_ID_FILES:
        value = (_read_json_object(folder / name) or {}).get(f"{key}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < backend.get_vocab_size(with_added_tokens=True):
                raise ConfigError(
                    f"{folder / name} gives {key}_token_id={value}, outside tokenizer.json's ids; fix {key}_token_id"
                )
            return value
    return None


def _eos_id(folder: Path, backend, config: dict) -> int:
    """The end-of-sequence id: as the config files name it, else the first added token called like one."""
    found = _configured_id(folder, backend, config, "eos")
    if found is not None:
        return found
    added = {token.content: i for i, token in backend.get_added_tokens_decoder().items()}
    for text in HF_EOS_NAMES:
        if text in added:
            return added[text]
    raise ConfigError(f"{folder} names no end-of-sequence token; add an eos_token to {folder / HF_TOKENIZER_CONFIG}")


def _declared_bos_id(folder: Path, backend, config: dict) -> int | None:
    """The beginning-of-sequence id the config files name (never guessed from token names)."""
    return _configured_id(folder, backend, config, "bos")


def _used_bos_id(declared: int | None, eot_id: int, config: dict) -> int | None:
    """The BOS titanlite puts before each document: none when it is the end-of-sequence token too (GPT-2's
    <|endoftext|> already separates documents) or when tokenizer_config.json says add_bos_token: false."""
    if declared == eot_id or config.get("add_bos_token") is False:
        return None
    return declared


TOKENIZERS: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer, "hf": HFTokenizer}


def build_tokenizer(name: str, assets_path: str = "") -> Tokenizer:
    """The tokenizer called `name` ("byte", "gpt2", or "hf": the tokenizer.json in the folder `assets_path`)."""
    if name not in TOKENIZERS:
        raise ConfigError(f"model.tokenizer={name!r} is unknown; use one of: {', '.join(sorted(TOKENIZERS))}")
    if name == "hf":
        return _hf_tokenizer(assets_path)
    return TOKENIZERS[name]()


def _hf_tokenizer(assets_path: str) -> HFTokenizer:
    if not assets_path:
        raise ConfigError(HF_ASSETS_HINT)
    folder = Path(assets_path).expanduser()
    if not (folder / HF_TOKENIZER_FILE).is_file():
        raise ConfigError(f"{HF_ASSETS_HINT} ({folder} has no {HF_TOKENIZER_FILE})")
    return HFTokenizer(folder)


@functools.lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=read_ranks(GPT2_RANKS_PATH),
        special_tokens={GPT2_EOT: GPT2Tokenizer.eot_id},
        explicit_n_vocab=GPT2Tokenizer.vocab_size,
    )


def read_ranks(path: Path) -> dict[bytes, int]:
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
