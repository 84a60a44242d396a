"""Reading corpus files in bounded pieces: .txt and JSON lines (plain or compressed with gzip, zstandard, bzip2
or xz), parquet and arrow columns, the standard library's sources; each piece becomes one shard of a store.

A piece is a list of spans (parts of files); a worker process reads its spans as batches of documents.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.errors import ConfigError, short_reason
from titanlite.data.arrow_files import arrow_batch_spans, arrow_texts
from titanlite.data.sources import SourceFile, open_file

# Text is handed to the tokenizer in batches of about this many characters, which bounds a reader's memory.
BATCH_CHARS = 2**20


@dataclass(frozen=True)
class Span:
    """Part of one file: bytes [start, stop) of a plain .txt/.jsonl/.py file, row groups (parquet) or record
    batches (arrow) [start, stop), or a whole compressed file (`codec`; start 0, stop its compressed size).
    `nbytes`: the source bytes it stands for; `ends_document`: a .txt span that reaches its file's end (the
    end-of-text id follows); `field`: the JSON field or column that holds the text."""

    path: str
    kind: str
    start: int
    stop: int
    nbytes: int
    ends_document: bool = True
    codec: str = ""
    field: str = "text"


def plan_pieces(files: list[SourceFile], piece_bytes: int, field: str = "text") -> list[list[Span]]:
    """Consecutive spans grouped into pieces of about `piece_bytes` source bytes: a large file is cut
    into several pieces (a compressed one cannot be: it is one piece), small files share one."""
    pieces, current, current_bytes = [], [], 0
    for entry in files:
        for span in _file_spans(entry, piece_bytes, field):
            current.append(span)
            current_bytes += span.nbytes
            if current_bytes >= piece_bytes:
                pieces.append(current)
                current, current_bytes = [], 0
    if current:
        pieces.append(current)
    return pieces


def _file_spans(entry: SourceFile, piece_bytes: int, field: str) -> Iterator[Span]:
    kind, codec = entry.kind, entry.codec
    if kind == "parquet":
        for start, stop, nbytes in _parquet_spans(entry.path, piece_bytes):
            yield Span(entry.path, kind, start, stop, nbytes, field=field)
        return
    if kind == "arrow":
        for start, stop, nbytes in arrow_batch_spans(entry.path, piece_bytes):
            yield Span(entry.path, kind, start, stop, nbytes, field=field)
        return
    if kind == "stdlib" or codec or entry.size <= piece_bytes:
        yield Span(entry.path, kind, 0, entry.size, entry.size, codec=codec, field=field)
        return
    start = 0
    with open_file(entry.path) as f:
        while start < entry.size:
            stop = _next_cut(f, start + piece_bytes, entry.size, kind)
            ends = kind != "txt" or stop == entry.size
            yield Span(entry.path, kind, start, stop, stop - start, ends_document=ends, field=field)
            start = stop


def _next_cut(f, target: int, size: int, kind: str) -> int:
    """The first safe cut at or after byte `target` (the file's size if there is none): after a line
    break for JSON lines; for .txt, after a line break between two non-space bytes, where the GPT-2 split
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


def _parquet_spans(path: str, piece_bytes: int) -> Iterator[tuple[int, int, int]]:
    meta = _parquet_file(path, None).metadata
    start, nbytes = 0, 0
    for group in range(meta.num_row_groups):
        nbytes += meta.row_group(group).total_byte_size
        if nbytes >= piece_bytes or group == meta.num_row_groups - 1:
            yield start, group + 1, nbytes
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
        for number, line in _jsonl_lines(span):
            yield _jsonl_text(span, number, line), True
    elif span.kind == "parquet":
        for text in _parquet_texts(span):
            yield text, True
    elif span.kind == "arrow":
        for text in arrow_texts(span.path, span.start, span.stop, span.field):
            yield text, True
    elif span.kind == "stdlib":
        try:
            yield Path(span.path).read_bytes().decode("utf-8"), True
        except (OSError, UnicodeDecodeError):
            return
    else:
        yield from _txt_fragments(span)


def _open_span(span: Span):
    """A binary stream at the span's first byte: the file itself, or its decompressed bytes from the start. A
    compressed stream that stops before its end (a file cut short, or empty) raises EOFError where it stops."""
    f = open_file(span.path)  # a file that cannot be read is one line naming it, compressed or not
    if not span.codec:
        f.seek(span.start)
        return f
    if os.fstat(f.fileno()).st_size == 0:  # gzip reads an empty file as empty text: it holds no stream at all
        f.close()
        raise EOFError("Compressed file ended before the end-of-stream marker was reached")
    if span.codec == "zst":
        return io.BufferedReader(_ZstdReader(f), buffer_size=2**20)
    f.close()  # the codec's own opener owns (and closes) the file it opens
    openers: dict[str, Callable[..., io.IOBase]] = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}
    return openers[span.codec](span.path, "rb")


class _ZstdReader(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; a last frame left incomplete (a file cut short) is an
    EOFError at its end, as gzip, bz2 and lzma raise. zstandard's stream_reader just stops there, and a cut file
    read as the text before the cut (or as none) is silently wrong."""

    READ = 2**14  # compressed bytes per step: their text, usually some 100 KiB, is what this holds at once

    def __init__(self, f) -> None:
        import zstandard  # a declared dependency, imported only where a .zst file is read

        self._file = f
        self._new_frame = zstandard.ZstdDecompressor().decompressobj
        self._frame = self._new_frame()
        self._inside = False  # whether the current frame has been fed bytes (and not yet ended)
        self._pending = memoryview(b"")  # decompressed, not yet read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            data = self._file.read(self.READ)
            if not data:
                if self._inside:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                return 0
            self._pending = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._pending))
        memoryview(buffer).cast("B")[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        """The text of `data`, a frame's end starting the next frame with the bytes after it."""
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._inside = True
            if not self._frame.eof:
                break
            data = self._frame.unused_data
            self._frame, self._inside = self._new_frame(), False
        return b"".join(out)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


@contextlib.contextmanager
def _stream_errors(span: Span) -> Iterator[None]:
    """A damaged compressed file is one line naming it, not the codec's traceback; one cut short (every codec
    raises EOFError where its stream stops early) says so."""
    try:
        yield
    except Exception as e:
        codec_error = isinstance(e, (OSError, EOFError, lzma.LZMAError, zlib.error)) or type(e).__name__ == "ZstdError"
        if not span.codec or not codec_error or isinstance(e, ConfigError):
            raise
        if isinstance(e, EOFError):
            raise ConfigError(
                f"{span.path} is truncated: its .{span.codec} stream ends after {span.stop:,} bytes, before its end "
                "marker (an interrupted download or copy); download or compress it again, or remove it from the corpus"
            ) from e
        raise ConfigError(
            f"{span.path} is not a readable .{span.codec} file ({short_reason(e)}); re-create or remove it"
        ) from e


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
    text with no such place for 4 x BATCH_CHARS bytes, at a character boundary). A compressed file is read
    to its end."""
    stop = float("inf") if span.codec else span.stop
    with _stream_errors(span), _open_span(span) as f:
        pos, carry = span.start, b""  # carry: read, not yet yielded; it starts at byte pos - len(carry)
        while pos < stop:
            block = f.read(int(min(BATCH_CHARS, stop - pos)))
            if not block:
                break
            pos += len(block)
            data = carry + block
            cut = _safe_cut(data, "txt", len(data) // 2) if pos < stop else None
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
    """Non-blank lines of a JSON-lines span, each with its index within the span (1-based)."""
    stop = float("inf") if span.codec else span.stop
    with _stream_errors(span), _open_span(span) as f:
        pos, index = span.start, 0
        while pos < stop:
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


def _jsonl_text(span: Span, number: int, line: bytes) -> str:
    path = span.path
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        # An array that continues on the next lines (the file is one JSON array) ends its first line unfinished; a bad
        # row that merely starts with '[' fails before its end.
        unfinished = isinstance(e, json.JSONDecodeError) and e.pos >= len(line.rstrip())
        if number == 1 and span.start == 0 and line.lstrip().startswith(b"[") and unfinished:
            raise _not_json_lines(path) from e
        where = f"{path} line {_line_number(span, number)} is not valid JSON ({reason})"
        if not line.endswith(b"\n"):  # only a file's last line ends without a line break: text that stops mid-row
            raise ConfigError(
                f"{where}, and it is the file's last line, with no line break after it: the file looks cut short; "
                "download or compress it again, or fix or remove that line"
            ) from e
        raise ConfigError(f"{where}; fix or remove that line") from e
    if isinstance(record, list) and number == 1 and span.start == 0 and not span.codec and _only_line(path, line):
        raise _not_json_lines(path)
    if isinstance(record, list):
        raise ConfigError(
            f'{path} line {_line_number(span, number)} is a JSON list, not an object with a "{span.field}" string; '
            "JSON lines hold one object per line (a file that is one JSON array must be converted)"
        )
    text = record.get(span.field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        fields = ", ".join(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}, no fields"
        raise ConfigError(
            f'{path} line {_line_number(span, number)} has no "{span.field}" string (it has: {fields}); '
            "set training.dataset_text_field to the field that holds the text"
        )
    return text


def _only_line(path: str, line: bytes) -> bool:
    """Whether `line`, the file's first, is all it holds (but blanks): a file that is one JSON array on one line."""
    with open(path, "rb") as f:
        f.seek(len(line))
        return not f.read(4096).strip()


def _not_json_lines(path: str) -> ConfigError:
    return ConfigError(f"{path} is one JSON array, not JSON lines (one object per line); convert it")


def _parquet_file(path: str, field: str | None):
    import pyarrow as pa  # only for parquet sources (it comes with datasets)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{path} is not a readable parquet file ({short_reason(e)}); fix or remove it") from e
    names = pf.schema_arrow.names
    if field is not None and field not in names:
        raise ConfigError(
            f"{path} has no '{field}' column (columns: {', '.join(names)}); set training.dataset_text_field "
            "to the column that holds the text"
        )
    return pf


def _parquet_texts(span: Span) -> Iterator[str]:
    """The text column's values of a parquet span's row groups, a record batch at a time."""
    for batch in _parquet_file(span.path, span.field).iter_batches(
        batch_size=1024, row_groups=range(span.start, span.stop), columns=[span.field]
    ):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                kind = type(text).__name__
                raise ConfigError(
                    f"{span.path} has a non-string '{span.field}' value ({kind}) in row group {span.start} or "
                    f"later; make every '{span.field}' a string"
                )
            yield text
