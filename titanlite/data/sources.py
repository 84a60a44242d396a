"""Where corpus text comes from, read in bounded pieces: the built-in standard-library corpus, local
.txt/.jsonl/.parquet files, pre-tokenized .bin/.npy shards, and Hugging Face hub datasets (streamed).

A source's files are identified by path, size, mtime and a sampled fingerprint (a few KiB read, whatever
the file's size), so a store can tell that its sources changed without reading them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKEN_SUFFIXES = (".bin", ".npy")
LOCAL_HINT = "a .txt, .jsonl, .parquet, .bin or .npy file, or a folder of them"

# About 8 MiB of source code tokenises in a few seconds yet is plenty for smoke-test training.
STDLIB_BYTE_BUDGET = 8 * 2**20
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})

FINGERPRINT_SAMPLES = 16
FINGERPRINT_BLOCK = 4096
# Text is handed to the tokenizer in batches of about this many characters, which bounds a reader's memory.
BATCH_CHARS = 2**20
# Hub datasets are streamed in pieces of this many documents.
HUB_PIECE_DOCUMENTS = 20_000


@dataclass(frozen=True)
class Source:
    """One corpus: kind 'stdlib', 'local' (a file or folder) or 'hub' (a dataset name); `label` names
    the config key that chose it, for messages."""

    kind: str
    location: str = ""
    label: str = ""

    @property
    def description(self) -> str:
        return {"stdlib": "the standard-library corpus", "local": self.location, "hub": f"hub:{self.location}"}[
            self.kind
        ]


def parse_source(text: str, label: str) -> Source:
    """'stdlib', 'hub:NAME', or a local path (file or folder)."""
    if text == "stdlib":
        return Source("stdlib", "", label)
    if text.startswith("hub:"):
        return Source("hub", text[4:], label)
    return Source("local", text, label)


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int
    mtime_ns: int

    @classmethod
    def stat(cls, path: Path) -> SourceFile:
        info = path.stat()
        return cls(str(path), info.st_size, info.st_mtime_ns)

    def as_record(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def fingerprint(path: str, size: int) -> str:
    """sha256 of FINGERPRINT_SAMPLES blocks spread evenly over the file (first and last included)."""
    digest = hashlib.sha256(str(size).encode())
    with _open(path) as f:
        if size <= FINGERPRINT_SAMPLES * FINGERPRINT_BLOCK:
            digest.update(f.read())
        else:
            step = (size - FINGERPRINT_BLOCK) / (FINGERPRINT_SAMPLES - 1)
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(int(i * step))
                digest.update(f.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()


def full_hash(path: str) -> str:
    digest = hashlib.sha256()
    with _open(path) as f:
        while block := f.read(2**24):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Listing files


def source_files(source: Source) -> list[SourceFile]:
    """The files that make up `source`, in corpus order, from directory listings and stat alone."""
    if source.kind == "stdlib":
        return stdlib_files()
    if source.kind == "local":
        return [SourceFile.stat(p) for p in local_files(source)]
    return []


def stdlib_files() -> list[SourceFile]:
    """The standard library's .py files, sorted by relative path, without tests and third-party code,
    until about STDLIB_BYTE_BUDGET bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_SKIP_DIRS]
        relative += [Path(folder, name).relative_to(root).as_posix() for name in names if name.endswith(".py")]
    files, gathered = [], 0
    for rel in sorted(relative):
        entry = SourceFile.stat(root / rel)
        files.append(entry)
        gathered += entry.size
        if gathered >= STDLIB_BYTE_BUDGET:
            break
    return files


def local_files(source: Source) -> list[Path]:
    """The usable files at a local source: the file itself, or a folder's files sorted by path, all of
    them text or all of them pre-tokenized."""
    if not source.location:
        raise ConfigError(f"{source.label} is empty; give {LOCAL_HINT}")
    root = Path(source.location).expanduser()
    suffixes = TEXT_SUFFIXES + TOKEN_SUFFIXES
    if root.is_file():
        if root.suffix.lower() not in suffixes:
            raise ConfigError(f"{source.label}='{source.location}' has an unsupported suffix; use {LOCAL_HINT}")
        return [root]
    if not root.is_dir():
        raise ConfigError(f"{source.label}='{source.location}' does not exist; use {LOCAL_HINT}")
    relative = []
    for folder, _, names in os.walk(root):
        usable = [name for name in names if Path(name).suffix.lower() in suffixes]
        relative += [Path(folder, name).relative_to(root).as_posix() for name in usable]
    files = [root / rel for rel in sorted(relative)]
    if not files:
        raise ConfigError(f"{source.label}='{source.location}' holds no usable files; use {LOCAL_HINT}")
    tokenized = {f.suffix.lower() in TOKEN_SUFFIXES for f in files}
    if len(tokenized) > 1:
        raise ConfigError(
            f"{source.label}='{source.location}' mixes text files with pre-tokenized .bin/.npy shards; "
            "put them in separate folders (a mixture can combine both)"
        )
    return files


def is_pretokenized(files: list[SourceFile]) -> bool:
    return bool(files) and Path(files[0].path).suffix.lower() in TOKEN_SUFFIXES


# ----------------------------------------------------------------------------------------------
# Cutting text files into pieces


@dataclass(frozen=True)
class Span:
    """Part of one file: bytes [start, stop) of a .txt/.jsonl/.py file, or row groups [start, stop) of a
    .parquet file (`nbytes`: their uncompressed size). `ends_document`: a .txt span that reaches its
    file's end (the end-of-text id follows)."""

    path: str
    kind: str
    start: int
    stop: int
    nbytes: int
    ends_document: bool = True


def file_kind(path: str, stdlib: bool) -> str:
    return "stdlib" if stdlib else Path(path).suffix.lower().lstrip(".")


def plan_pieces(files: list[SourceFile], piece_bytes: int, stdlib: bool = False) -> list[list[Span]]:
    """Consecutive spans grouped into pieces of about `piece_bytes` source bytes: a large file is cut
    into several pieces, small files share one. Each piece becomes one shard of the store."""
    pieces, current, current_bytes = [], [], 0
    for entry in files:
        for span in _file_spans(entry, file_kind(entry.path, stdlib), piece_bytes):
            current.append(span)
            current_bytes += span.nbytes
            if current_bytes >= piece_bytes:
                pieces.append(current)
                current, current_bytes = [], 0
    if current:
        pieces.append(current)
    return pieces


def _file_spans(entry: SourceFile, kind: str, piece_bytes: int) -> Iterator[Span]:
    if kind == "parquet":
        yield from _parquet_spans(entry.path, piece_bytes)
        return
    if kind == "stdlib" or entry.size <= piece_bytes:
        yield Span(entry.path, kind, 0, entry.size, entry.size)
        return
    start = 0
    with _open(entry.path) as f:
        while start < entry.size:
            stop = _next_cut(f, start + piece_bytes, entry.size, kind)
            yield Span(entry.path, kind, start, stop, stop - start, ends_document=kind != "txt" or stop == entry.size)
            start = stop


def _next_cut(f, target: int, size: int, kind: str) -> int:
    """The first safe cut at or after byte `target` (the file's size if there is none): after a line
    break for .jsonl; for .txt, after a line break between two non-space bytes, where the GPT-2 split
    pattern cuts too, so the pieces tokenise like the whole file."""
    if target >= size:
        return size
    f.seek(target - 1)
    data = f.read(2**20 + 2)
    cut = _safe_cut(data, kind)  # data[0] precedes the target, so a cut lands at or after it
    return size if cut is None else min(size, target - 1 + cut)


def _safe_cut(data: bytes, kind: str, begin: int = 1) -> int | None:
    """Offset just after the first safe line break at or after `begin` in `data`, or None."""
    if kind == "jsonl":
        pos = data.find(b"\n", max(begin - 1, 0))
        return None if pos < 0 else pos + 1
    pos = data.find(b"\n", max(begin, 1))
    while 0 <= pos < len(data) - 1:
        if not data[pos - 1 : pos].isspace() and not data[pos + 1 : pos + 2].isspace():
            return pos + 1
        pos = data.find(b"\n", pos + 1)
    return None


def _parquet_spans(path: str, piece_bytes: int) -> Iterator[Span]:
    meta = _parquet_file(path).metadata
    start, nbytes = 0, 0
    for group in range(meta.num_row_groups):
        nbytes += meta.row_group(group).total_byte_size
        if nbytes >= piece_bytes or group == meta.num_row_groups - 1:
            yield Span(path, "parquet", start, group + 1, nbytes)
            start, nbytes = group + 1, 0


# ----------------------------------------------------------------------------------------------
# Reading pieces


def read_batches(spans: list[Span]) -> Iterator[list[tuple[str, bool]]]:
    """The pieces' documents as batches of (text, ends_document), about BATCH_CHARS characters each."""
    batch, chars = [], 0
    for span in spans:
        for text, ends in _read_span(span):
            batch.append((text, ends))
            chars += len(text)
            if chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _read_span(span: Span) -> Iterator[tuple[str, bool]]:
    if span.kind == "jsonl":
        for index, line in _jsonl_lines(span):
            yield _jsonl_text(span, index, line), True
    elif span.kind == "parquet":
        for text in _parquet_texts(span):
            yield text, True
    elif span.kind == "stdlib":
        try:
            yield Path(span.path).read_bytes().decode("utf-8"), True
        except (OSError, UnicodeDecodeError):
            return
    else:
        yield from _txt_fragments(span)


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); fix its permissions or remove it from the corpus") from e


def _decode(data: bytes, path: str, offset: int) -> str:
    # Decoding bytes (not text mode) keeps the text byte for byte: no newline translation.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (bad byte at offset {offset + e.start}); convert it or remove it"
        ) from e


def _txt_fragments(span: Span) -> Iterator[tuple[str, bool]]:
    """A .txt span in fragments of about BATCH_CHARS bytes, cut where tokenisation is unaffected (or, in
    text with no such place for 4 x BATCH_CHARS bytes, at a character boundary)."""
    with _open(span.path) as f:
        f.seek(span.start)
        pos, carry = span.start, b""  # carry: read, not yet yielded; it starts at byte pos - len(carry)
        while pos < span.stop:
            block = f.read(min(BATCH_CHARS, span.stop - pos))
            if not block:
                break
            pos += len(block)
            data = carry + block
            cut = _safe_cut(data, "txt", len(data) // 2) if pos < span.stop else None
            if cut is None and len(data) >= 4 * BATCH_CHARS:
                cut = next(i for i in range(len(data) - 1, 0, -1) if data[i] & 0xC0 != 0x80)
            if cut is None:
                carry = data
                continue
            yield _decode(data[:cut], span.path, pos - len(data)), False
            carry = data[cut:]
        if carry:
            yield _decode(carry, span.path, pos - len(carry)), span.ends_document


def _jsonl_lines(span: Span) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines of a .jsonl byte range, each with its index within the span (1-based)."""
    with _open(span.path) as f:
        f.seek(span.start)
        pos, index = span.start, 0
        while pos < span.stop:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            index += 1
            if line.strip():
                yield index, line


def _line_number(span: Span, index: int) -> int:
    """1-based line number of the index-th line of `span` (reads the file up to the span: errors only)."""
    with open(span.path, "rb") as f:
        before = f.read(span.start).count(b"\n")
    return before + index


def _jsonl_text(span: Span, index: int, line: bytes) -> str:
    path = span.path
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise ConfigError(
            f"{path} line {_line_number(span, index)} is not valid JSON ({reason}); fix or remove that line"
        ) from e
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(
            f'{path} line {_line_number(span, index)} has no "text" string; give every line a "text" field'
        )
    return record["text"]


def _parquet_file(path: str):
    import pyarrow as pa  # only for parquet sources (it comes with datasets)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{path} is not a readable parquet file ({short_reason(e)}); fix or remove it") from e
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ConfigError(
            f"{path} has no 'text' column (columns: {', '.join(names)}); store the documents in a 'text' column"
        )
    return pf


def _parquet_texts(span: Span) -> Iterator[str]:
    """The 'text' values of a parquet span's row groups, a record batch at a time."""
    for batch in _parquet_file(span.path).iter_batches(
        batch_size=1024, row_groups=range(span.start, span.stop), columns=["text"]
    ):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                kind = type(text).__name__
                raise ConfigError(
                    f"{span.path} has a non-string 'text' value ({kind}) in row group {span.start} or later; make "
                    "every 'text' a string"
                )
            yield text


# ----------------------------------------------------------------------------------------------
# Hub datasets


def hub_documents(name: str, skip: int = 0) -> Iterator[str]:
    """The "text" column of the hub dataset `name`'s train split, streamed (never loaded whole), from
    document `skip` on. Needs network."""
    try:
        import datasets  # seconds to import: only for hub sources

        data = datasets.load_dataset(name, split="train", streaming=True)
        if skip:
            data = data.skip(skip)
        rows = iter(data)
        first = next(rows, None)
    except Exception as e:
        raise ConfigError(
            f"training.dataset='{name}' could not be loaded from the Hugging Face hub ({short_reason(e)}); "
            "use training.dataset = 'stdlib' or 'local' with training.dataset_path"
        ) from e
    if first is None:
        return
    if "text" not in first:
        raise ConfigError(f"training.dataset='{name}' has no 'text' column; use a dataset that has one")
    yield first["text"]
    count = 1
    try:
        for row in rows:
            yield row["text"]
            count += 1
    except Exception as e:
        raise ConfigError(
            f"the stream of training.dataset='{name}' broke after {skip + count} documents ({short_reason(e)}); "
            "run the same command again to continue from the last finished shard"
        ) from e


def short_reason(error: BaseException, limit: int = 120) -> str:
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
