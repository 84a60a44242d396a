"""Arrow files as text sources: the folders Hugging Face `datasets` writes with save_to_disk (a Dataset, or a
DatasetDict of them, split by split) and single .arrow files, memory-mapped and read a record batch at a time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from titanlite.base.errors import ConfigError, short_reason

# What save_to_disk writes: a Dataset folder lists its data files in order in state.json ("_data_files");
# a DatasetDict folder names its splits in dataset_dict.json and holds one Dataset folder per split.
STATE_JSON = "state.json"
DATASET_DICT_JSON = "dataset_dict.json"
# An Arrow IPC file (Feather v2) starts with this; a stream (what save_to_disk writes) does not.
FILE_MAGIC = b"ARROW1"
# Rows turned into Python strings at a time, which bounds memory in a file of few, large record batches.
ROWS_PER_READ = 1024
RESAVE = "save it again with save_to_disk or remove it from the corpus"


def saved_dataset_files(root: Path, split: str, label: str) -> list[Path] | None:
    """The .arrow files of a save_to_disk folder, in the dataset's order: a Dataset's, or the `split` of a
    DatasetDict (ConfigError naming the config key `label` when it has no such split). None when `root` is
    not such a folder."""
    if (root / STATE_JSON).is_file():
        return _state_files(root)
    if not (root / DATASET_DICT_JSON).is_file():
        return None
    splits = _read_json(root / DATASET_DICT_JSON).get("splits")
    if not isinstance(splits, list):
        raise ConfigError(f"{root / DATASET_DICT_JSON} lists no splits; {RESAVE}")
    if split not in splits:
        raise ConfigError(
            f"{root} has no split '{split}' (splits: {', '.join(map(str, splits))}); set {label} to one of them"
        )
    return _state_files(root / split)


def is_arrow_file(path: str | Path) -> bool:
    """Whether `path` names an Arrow IPC file or stream (by its suffix, as corpus files are chosen)."""
    return Path(path).suffix.lower() == ".arrow"


def arrow_batch_spans(path: str, piece_bytes: int) -> list[tuple[int, int, int]]:
    """Consecutive ranges of record batches, (start, stop, nbytes) with about `piece_bytes` bytes of Arrow
    buffers each. The batches' buffers are mapped, not read (an uncompressed file's data is never touched)."""
    spans, start, nbytes, count = [], 0, 0, 0
    with _reader(path) as reader:
        for index, batch in _batches(reader, 0, None):
            count = index + 1
            nbytes += batch.get_total_buffer_size()
            if nbytes >= piece_bytes:
                spans.append((start, count, nbytes))
                start, nbytes = count, 0
    if count > start:
        spans.append((start, count, nbytes))
    return spans


def arrow_texts(path: str, start: int, stop: int, field: str) -> Iterator[str]:
    """The strings of column `field` in record batches [start, stop), one document per row; only that
    column is read. ConfigError (naming the file) for a missing column or a value that is not a string."""
    with _reader(path) as reader:
        names = reader.schema.names
    if field not in names:
        raise ConfigError(
            f"{path} has no '{field}' column (columns: {', '.join(names)}); set training.dataset_text_field"
        )
    with _reader(path, fields=[names.index(field)]) as reader:
        for index, batch in _batches(reader, start, stop):
            column = batch.column(0)
            if not _is_text(column.type) or column.null_count:
                kind = "a null" if _is_text(column.type) else f"{column.type} values"
                raise ConfigError(
                    f"{path} has {kind} in its '{field}' column (record batch {index}), not strings; make every "
                    f"'{field}' value a string"
                )
            for offset in range(0, len(column), ROWS_PER_READ):
                yield from column.slice(offset, ROWS_PER_READ).to_pylist()


@contextlib.contextmanager
def _reader(path: str, fields: list[int] | None = None):
    """A record batch reader of an Arrow IPC file or stream over a memory map of `path`, reading only the
    columns `fields` (all when None); ConfigError when it is not readable Arrow data."""
    import pyarrow as pa  # only for Arrow sources (it comes with datasets)

    try:
        with pa.memory_map(path) as source:
            options = pa.ipc.IpcReadOptions(included_fields=fields) if fields else None
            is_file = source.read(len(FILE_MAGIC)) == FILE_MAGIC
            source.seek(0)
            open_reader = pa.ipc.open_file if is_file else pa.ipc.open_stream
            yield open_reader(source, options=options)
    except (OSError, pa.ArrowException) as e:
        raise ConfigError(f"{path} is not a readable Arrow file ({short_reason(e)}); {RESAVE}") from e


def _batches(reader, start: int, stop: int | None) -> Iterator[tuple[int, Any]]:
    """Record batches [start, stop) of `reader` (pyarrow's, untyped), each with its index. A stream is read from its
    start, which costs only each skipped batch's metadata: its buffers are slices of the memory map."""
    if hasattr(reader, "get_batch"):
        stop = reader.num_record_batches if stop is None else min(stop, reader.num_record_batches)
        yield from ((index, reader.get_batch(index)) for index in range(start, stop))
        return
    for index, batch in enumerate(reader):
        if stop is not None and index >= stop:
            return
        if index >= start:
            yield index, batch


def _is_text(kind) -> bool:
    import pyarrow as pa  # only for Arrow sources

    checks = ("is_string", "is_large_string", "is_string_view")  # string_view: pyarrow 16 and later
    return any(getattr(pa.types, check, lambda _: False)(kind) for check in checks)


def _state_files(folder: Path) -> list[Path]:
    """The data files a save_to_disk Dataset folder lists in its state.json, each checked to exist."""
    state = folder / STATE_JSON
    entries = _read_json(state).get("_data_files")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise ConfigError(f'{state} lists no data files ("_data_files"); {RESAVE}')
    files = [folder / entry["filename"] for entry in entries]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"{state} lists {', '.join(missing)}, missing from {folder}; {RESAVE}")
    return files


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({short_reason(e)}); {RESAVE}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object; {RESAVE}")
    return data
