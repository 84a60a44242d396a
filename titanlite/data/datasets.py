"""Corpora as one flat, cached array of token ids, and the fixed-length training windows over it.
Sources are the interpreter's own standard library, local .txt/.jsonl/.parquet files, or a Hub dataset."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError

# Bump when the cache file layout or document gathering changes, so old caches are not reused.
CACHE_FORMAT = "titanlite-tokens-v1"

# About 8 MiB of source code tokenises in a few seconds yet is plenty for smoke-test training.
STDLIB_CHAR_BUDGET = 8 * 2**20
STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
LOCAL_HINT = "a .txt, .jsonl or .parquet file, or a folder of them"

DOCS_PER_CHUNK = 512

Documents = Callable[[], Iterator[str]]


def load_tokens(dataset: str, dataset_path: str | None, tokenizer: Tokenizer, cache_dir: str | Path) -> np.ndarray:
    """All documents of `dataset` tokenised, each followed by the end-of-text id, as a read-only memmap.

    The array is built once per (tokenizer, source content) into `cache_dir` and reused afterwards;
    concurrent callers (one per rank) wait for a single builder instead of racing.
    """
    if dataset != "local" and dataset_path:
        raise ConfigError("training.dataset_path is only used with training.dataset = 'local'; unset it")
    dtype = token_dtype(tokenizer)
    if dataset == "stdlib":
        documents: Documents = _stdlib_documents
        key = _content_key(tokenizer, dtype, "stdlib", documents())
        label = "the standard library corpus"
    elif dataset == "local":
        files = _local_files(dataset_path)
        documents = functools.partial(_local_documents, files)
        key = _content_key(tokenizer, dtype, "local", documents())
        label = f"training.dataset_path='{dataset_path}'"
    else:
        documents = functools.partial(_hub_documents, dataset)
        key = _content_key(tokenizer, dtype, "hub", [dataset])
        label = f"training.dataset='{dataset}'"
    path = _cached_tokens(Path(cache_dir), key, tokenizer, dtype, documents, label)
    return np.memmap(path, dtype=dtype, mode="r")


def token_dtype(tokenizer: Tokenizer) -> type[np.unsignedinteger]:
    """The narrowest unsigned type that holds every id of `tokenizer`."""
    return np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32


class PackedWindows(Dataset):
    """Window i is tokens[i*seq_len : (i+1)*seq_len + 1] as int64.

    Consecutive windows share one boundary token, so inputs (window[:-1]) and labels (window[1:])
    together predict every token of the corpus after the first exactly once per epoch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"training.seq_len={seq_len} must be at least 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"the corpus has {len(tokens)} tokens, too few for training.seq_len={seq_len}; "
                "use a larger corpus or a smaller training.seq_len"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_windows:
            raise IndexError(f"window {index} out of range for {self.num_windows} windows")
        start = index * self.seq_len
        # np.array copies out of the read-only memmap, so the tensor owns writable memory.
        return torch.from_numpy(np.array(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))

    def __getstate__(self) -> dict:
        # Spawned data-loader workers would otherwise receive a full in-memory copy of the corpus.
        state = dict(self.__dict__)
        if _is_whole_memmap(self.tokens):
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str, self.tokens.offset, len(self.tokens))
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype, offset, length = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


def _is_whole_memmap(tokens: np.ndarray) -> bool:
    """True when `tokens` maps its file from `offset` to the end, so reopening it gives the same array."""
    if not isinstance(tokens, np.memmap) or tokens.filename is None or tokens.ndim != 1:
        return False
    return tokens.flags.c_contiguous and tokens.nbytes == os.path.getsize(tokens.filename) - tokens.offset


def _content_key(tokenizer: Tokenizer, dtype: type, kind: str, documents: Iterable[str]) -> str:
    """sha256 over the tokenizer and every document's text: any changed byte gives a new cache file."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{tokenizer.name}\0{np.dtype(dtype).str}\0{kind}\0".encode())
    for text in documents:
        # surrogatepass: JSON text may hold lone surrogates, which strict UTF-8 cannot encode.
        data = text.encode("utf-8", errors="surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _cached_tokens(
    cache_dir: Path, key: str, tokenizer: Tokenizer, dtype: type, documents: Documents, label: str
) -> Path:
    """Path of the finished token file for `key`, building it first if no process has yet."""
    final = cache_dir / f"{key}.bin"
    if final.exists():
        return final
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(cache_dir / f"{key}.lock"):
            # Another rank may have finished the file while this one waited for the lock.
            if not final.exists():
                _write_tokens(final, tokenizer, dtype, documents(), label)
    except OSError as e:
        reason = e.strerror or e
        raise ConfigError(f"cannot write the token cache in {cache_dir} ({reason}); use a writable cache folder") from e
    return final


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_tokens(final: Path, tokenizer: Tokenizer, dtype: type, documents: Iterator[str], label: str) -> None:
    # A temp file in the same folder plus os.replace: readers only ever see a complete file.
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f"{final.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            num_docs = 0
            while chunk := list(islice(documents, DOCS_PER_CHUNK)):
                out.write(_encode_chunk(tokenizer, chunk, dtype).tobytes())
                num_docs += len(chunk)
            if num_docs == 0:
                raise ConfigError(f"{label} has no documents; point it at data with some text")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _encode_chunk(tokenizer: Tokenizer, texts: list[str], dtype: type) -> np.ndarray:
    """The ids of `texts`, each document followed by the end-of-text id."""
    encoded = tokenizer.encode_batch(texts)
    out = np.empty(sum(len(ids) + 1 for ids in encoded), dtype=dtype)
    pos = 0
    for ids in encoded:
        out[pos : pos + len(ids)] = ids
        out[pos + len(ids)] = tokenizer.eot_id
        pos += len(ids) + 1
    return out


def _stdlib_documents() -> Iterator[str]:
    """The interpreter's standard-library sources, one per file, until about STDLIB_CHAR_BUDGET chars."""
    gathered = 0
    for path in _stdlib_files(Path(sysconfig.get_paths()["stdlib"])):
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        gathered += len(text)
        if gathered >= STDLIB_CHAR_BUDGET:
            return


def _stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py files, sorted by relative path, without tests and third-party code."""
    relative = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_SKIP_DIRS]
        relative += [Path(folder, name).relative_to(root).as_posix() for name in names if name.endswith(".py")]
    return [root / rel for rel in sorted(relative)]


def _local_files(dataset_path: str | None) -> list[Path]:
    """The usable files at `dataset_path`: the file itself, or a folder's files sorted by path."""
    if not dataset_path:
        raise ConfigError(f"training.dataset = 'local' needs training.dataset_path: {LOCAL_HINT}")
    root = Path(dataset_path).expanduser()
    if root.is_file():
        if root.suffix.lower() not in LOCAL_SUFFIXES:
            raise ConfigError(f"training.dataset_path='{dataset_path}' has an unsupported suffix; use {LOCAL_HINT}")
        return [root]
    if root.is_dir():
        files = _files_with_suffixes(root, LOCAL_SUFFIXES)
        if not files:
            raise ConfigError(f"training.dataset_path='{dataset_path}' holds no usable files; use {LOCAL_HINT}")
        return files
    raise ConfigError(f"training.dataset_path='{dataset_path}' does not exist; use {LOCAL_HINT}")


def _files_with_suffixes(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    relative = []
    for folder, _, names in os.walk(root):
        usable = [name for name in names if Path(name).suffix.lower() in suffixes]
        relative += [Path(folder, name).relative_to(root).as_posix() for name in usable]
    return [root / rel for rel in sorted(relative)]


def _local_documents(files: list[Path]) -> Iterator[str]:
    readers = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}
    for path in files:
        yield from readers[path.suffix.lower()](path)


def _txt_documents(path: Path) -> Iterator[str]:
    """The whole file as one document."""
    yield _read_utf8(path)


def _jsonl_documents(path: Path) -> Iterator[str]:
    """One document per non-blank line: that line's "text" string."""
    for number, line in enumerate(_read_utf8(path).split("\n"), start=1):
        if line.strip():
            yield _jsonl_text(path, number, line)


def _read_utf8(path: Path) -> str:
    # Decoding bytes (not read_text) keeps the text byte for byte: no newline translation.
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); fix its permissions or remove it from the corpus") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (bad byte at offset {e.start}); convert it or remove it") from e


def _jsonl_text(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} line {number} is not valid JSON ({e.msg}); fix or remove that line") from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(f'{path} line {number} has no "text" string; give every line a "text" field')
    return record["text"]


def _parquet_documents(path: Path) -> Iterator[str]:
    """One document per row: the row's "text" value."""
    for row, text in enumerate(_parquet_texts(path)):
        if not isinstance(text, str):
            kind = type(text).__name__
            raise ConfigError(f"{path} row {row} has a non-string 'text' value ({kind}); make every 'text' a string")
        yield text


def _parquet_texts(path: Path) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    unreadable = (OSError, pa.ArrowException)
    try:
        names = pq.read_schema(path).names
        if "text" in names:
            return pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except unreadable as e:
        raise ConfigError(f"{path} is not a readable parquet file ({_short_reason(e)}); fix or remove it") from e
    columns = ", ".join(names)
    raise ConfigError(f"{path} has no 'text' column (columns: {columns}); store the documents in a 'text' column")


def _hub_documents(name: str) -> Iterator[str]:
    """The "text" column of the Hub dataset `name`'s train split; needs network on first use."""
    try:
        import datasets

        data = datasets.load_dataset(name, split="train")
    except Exception as e:  # noqa: BLE001 - the hub client raises many unrelated types
        raise ConfigError(
            f"training.dataset='{name}' could not be loaded from the Hugging Face hub ({_short_reason(e)}); "
            "use training.dataset = 'stdlib' or 'local' with training.dataset_path"
        ) from e
    if "text" not in data.column_names:
        raise ConfigError(f"training.dataset='{name}' has no 'text' column; use a dataset that has one")
    for batch in data.iter(batch_size=1000):
        yield from batch["text"]


def _short_reason(error: BaseException, limit: int = 120) -> str:
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
