"""The prepared token store: a corpus tokenised once into shards of ids plus a small manifest, reopened by
memory-mapping the shards, at a cost that grows with the number of shards and never with the corpus bytes.

A store lives in `<cache>/store-<key>/`; the key names the tokenizer and the source, so a changed source
is rebuilt in place (its unchanged pieces kept). Building runs in worker processes, records each finished
shard in a journal, and so continues where an interrupted build stopped. Pre-tokenized files (llm.c /
modded-nanogpt `.bin`, nanoGPT's raw `.bin`, `.npy`) are memory-mapped in place, checked once.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np

from titanlite.base.command_line import usable_cores
from titanlite.base.errors import ConfigError, resolved_against
from titanlite.data.progress import Progress
from titanlite.data.readers import Span, plan_pieces, read_batches
from titanlite.data.sources import (
    HUB_PIECE_DOCUMENTS,
    STAT_EACH_FILE_UP_TO,
    Listing,
    Source,
    SourceFile,
    fingerprint,
    full_hash,
    hub_documents,
    local_listing,
    stdlib_files,
    watch_fingerprint,
)
from titanlite.data.token_files import inspect_token_file
from titanlite.data.tokenizer import Tokenizer

# Bump when the shard layout or the way documents are gathered changes, so old stores are not reused.
STORE_FORMAT = "titanlite-store-v3"
MANIFEST = "manifest.json"
SOURCES = "sources.json"  # each source file's size, mtime and hashes: read by check and prepare, not by ranks
JOURNAL = "progress.jsonl"  # the shards a build has finished, so that an interrupted one continues
LOCK = ".lock"  # held by the one process that builds the store
DEFAULT_SHARD_BYTES = 32 * 2**20
# How a store checks its sources before reuse: "stat" (size and mtime), "sample" (also a sampled
# fingerprint: a few KiB per file) or "full" (also the sha256 of every byte).
VERIFY_MODES = ("stat", "sample", "full")

logger = logging.getLogger(__name__)


def token_dtype(tokenizer: Tokenizer) -> type[np.unsignedinteger]:
    """The narrowest unsigned type that holds every id of `tokenizer`."""
    return np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32


class TokenStore:
    """Token ids of a corpus as one logical array over memory-mapped shards. `maps` describes each
    file-backed shard (path, dtype, byte offset, length) so pickling sends paths, not tokens."""

    def __init__(
        self,
        arrays: list[np.ndarray],
        label: str = "",
        maps: list[tuple | None] | None = None,
        documents: int | None = None,
        path: Path | None = None,
        summary: str = "",
        held_files: int = 0,
    ) -> None:
        self.arrays, self.label, self.documents, self.path = arrays, label, documents, path
        self.summary = summary  # what the start-up's data line says of its files, beyond the label
        self.held_files = held_files  # validation files its source held back (a pre-tokenised folder's val.bin)
        self.maps = maps or [None] * len(arrays)
        self.offsets = np.cumsum([0, *[len(a) for a in arrays]]).tolist()

    @classmethod
    def from_files(cls, maps: list[tuple], **kwargs) -> TokenStore:
        # An empty shard (a piece of blank lines) cannot be memory-mapped, and holds nothing to map.
        arrays = [
            np.memmap(path, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
            if length
            else np.empty(0, dtype=np.dtype(dtype))
            for path, dtype, offset, length in maps
        ]
        return cls(arrays, maps=list(maps), **kwargs)

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def num_shards(self) -> int:
        return len(self.arrays)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the whole corpus (a view when they lie in one shard)."""
        first = bisect.bisect_right(self.offsets, start) - 1
        pieces = []
        while start < stop:
            base = self.offsets[first]
            end = min(stop, self.offsets[first + 1])
            pieces.append(self.arrays[first][start - base : end - base])
            start, first = end, first + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if all(m is not None for m in self.maps):
            state["arrays"] = None  # reopened from the files on the other side
        return state

    def __setstate__(self, state: dict) -> None:
        if state["arrays"] is None:
            state["arrays"] = TokenStore.from_files(state["maps"]).arrays
        self.__dict__.update(state)


# ----------------------------------------------------------------------------------------------
# Opening


def open_store(
    source: Source,
    tokenizer: Tokenizer,
    cache_dir: str | Path,
    *,
    verify: str = "stat",
    workers: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    rebuild: bool = False,
) -> TokenStore:
    """The tokens of `source`: its prepared store when that is current (checked by `verify`), else built
    first (one builder at a time; the others wait for it). Pre-tokenized files are opened in place."""
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify='{verify}' is unknown; use one of: {', '.join(VERIFY_MODES)}")
    cache_dir = Path(cache_dir)
    folder = store_folder(cache_dir, source, tokenizer)
    if source.kind == "local" and verify == "stat" and not rebuild:
        store = _open_trusted(folder, source)
        if store is not None:
            return store
    listing = local_listing(source) if source.kind == "local" else None
    if listing is not None and listing.pretokenized:
        return open_pretokenized(source, listing, tokenizer, folder, verify)
    if not rebuild:
        store = _open_if_current(folder, source, listing, verify)
        if store is not None:
            return store
    created = _first_missing(folder)
    try:
        with _exclusive_lock(folder / LOCK):
            try:
                # Another process may have finished the store while this one waited for the lock.
                store = None if rebuild else _open_if_current(folder, source, listing, verify)
                if rebuild:
                    _clear(folder)
                if store is None:
                    files = stdlib_files() if source.kind == "stdlib" else listing.files() if listing else []
                    build_store(folder, source, files, tokenizer, shard_bytes, workers, listing)
                    store = _open_if_current(folder, source, listing, "sample")
            except BaseException:
                _tidy_failed_build(folder, token_dtype(tokenizer), created)
                raise
            if store is None:
                raise ConfigError(f"{source.description} changed while it was being prepared; run the command again")
    except OSError as e:
        raise _store_error(e, cache_dir) from e
    return store


def _store_error(error: OSError, cache_dir: Path) -> ConfigError:
    """An OSError while building a store, blamed on what it names: the cache folder, or a source file."""
    name = os.fsdecode(error.filename) if error.filename is not None else ""
    where = Path(os.path.abspath(name)) if name else None
    if where is not None and Path(os.path.abspath(cache_dir)) not in (where, *where.parents):
        return ConfigError(f"cannot read {name} ({error.strerror or error}); restore it or remove it from the corpus")
    return ConfigError(
        f"cannot write the token store in {cache_dir}{resolved_against(cache_dir)} ({error.strerror or error}); set "
        "data.cache_dir to a writable folder"
    )


@dataclass(frozen=True)
class StoreOptions:
    """Where a run's prepared stores live, and how open_store checks (`verify`) and builds them."""

    cache_dir: Path
    verify: str = "stat"
    workers: int = 0
    shard_bytes: int = DEFAULT_SHARD_BYTES

    def open(self, source: Source, tokenizer: Tokenizer, rebuild: bool = False) -> TokenStore:
        return open_store(
            source,
            tokenizer,
            self.cache_dir,
            verify=self.verify,
            workers=self.workers,
            shard_bytes=self.shard_bytes,
            rebuild=rebuild,
        )


def store_folder(cache_dir: Path, source: Source, tokenizer: Tokenizer) -> Path:
    where = str(Path(source.location).expanduser().resolve()) if source.kind == "local" else source.location
    parts = [STORE_FORMAT, tokenizer.fingerprint, source.kind, where] + [source.options_key()] * bool(
        source.options_key()
    )
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return cache_dir / f"store-{key[:24]}"


def read_manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("format") == STORE_FORMAT else None


def _open_trusted(folder: Path, source: Source) -> TokenStore | None:
    """A training rank's way in to a source of many files: its store (or its token files' index) as recorded,
    when the folders its listing walked are unchanged; no listing, no stat per file."""
    manifest = read_manifest(folder)
    if manifest is not None and _trusts(manifest.get("listing"), source):
        return _store_from_manifest(folder, manifest, source, manifest["listing"]["summary"])
    index = _read_index(_index_path(folder))
    if index is not None and _trusts(index.get("listing"), source):
        return _pretokenized_store(source, index["files"], index["listing"])
    return None


def _trusts(record: dict | None, source: Source) -> bool:
    return (
        isinstance(record, dict)
        and record["files"] > STAT_EACH_FILE_UP_TO
        and watch_fingerprint(record["watched"], source.skip_unsupported) == record["fingerprint"]
    )


def _open_if_current(folder: Path, source: Source, listing: Listing | None, verify: str) -> TokenStore | None:
    manifest = read_manifest(folder)
    if manifest is None or not _sources_current(folder, source, listing, verify):
        return None
    return _store_from_manifest(folder, manifest, source, listing.summary() if listing else "")


def _store_from_manifest(folder: Path, manifest: dict, source: Source, summary: str) -> TokenStore | None:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    maps = [(str(folder / s["file"]), manifest["dtype"], 0, s["tokens"]) for s in manifest["shards"]]
    if any(not os.path.isfile(m[0]) or os.path.getsize(m[0]) != m[3] * itemsize for m in maps):
        return None  # a shard was removed or cut short: rebuild it
    return TokenStore.from_files(
        maps, label=source.description, documents=manifest["documents"], path=folder, summary=summary
    )


def _sources_current(folder: Path, source: Source, listing: Listing | None, verify: str) -> bool:
    """Whether the store's sources are as recorded, file by file: size and mtime, plus the sampled
    fingerprint or the full hash."""
    if source.kind == "hub":
        return True
    try:
        recorded = json.loads((folder / SOURCES).read_text())
    except (OSError, ValueError):
        return False
    files = listing.files() if listing is not None else stdlib_files()
    return _sources_match(recorded, files, verify)


def _sources_match(recorded: list[dict], files: list[SourceFile], verify: str) -> bool:
    if [(r["path"], r["size"], r["mtime_ns"]) for r in recorded] != [(f.path, f.size, f.mtime_ns) for f in files]:
        return False
    if verify in ("sample", "full") and any(
        r["fingerprint"] != fingerprint(f.path, f.size) for r, f in zip(recorded, files)
    ):
        return False
    return verify != "full" or all(r["sha256"] == full_hash(f.path) for r, f in zip(recorded, files))


# ----------------------------------------------------------------------------------------------
# Building


def build_store(
    folder: Path,
    source: Source,
    files: list[SourceFile],
    tokenizer: Tokenizer,
    shard_bytes: int,
    workers: int,
    listing: Listing | None = None,
) -> dict:
    """Tokenise `source` into `folder`, reusing every shard an earlier (possibly interrupted) build
    finished for unchanged input, then write the manifest and drop what it no longer lists."""
    dtype = np.dtype(token_dtype(tokenizer)).str
    for stale in folder.glob("*.tmp"):
        stale.unlink(missing_ok=True)
    done = _finished_shards(folder, dtype)
    if source.kind == "hub":
        shards = _build_hub(folder, source, tokenizer, dtype, done)
        recorded = []
    else:
        # The full hash (about a second per GB) lets data.verify_sources tell a same-size, same-mtime edit.
        recorded = [
            {**f.as_record(), "fingerprint": fingerprint(f.path, f.size), "sha256": full_hash(f.path)} for f in files
        ]
        shards = _build_pieces(folder, source, files, recorded, tokenizer, dtype, shard_bytes, workers, done)
    documents = sum(s["documents"] for s in shards)
    if documents == 0:
        raise ConfigError(
            f"{source.label}='{source.location or source.kind}'"
            f"{resolved_against(source.location) if source.kind == 'local' else ''} has no documents"
            f"{_empty_files(source, files)}; point it at data with some text"
        )
    manifest = {
        "format": STORE_FORMAT,
        "tokenizer": tokenizer.fingerprint,
        "dtype": dtype,
        "source": source.description,
        "tokens": sum(s["tokens"] for s in shards),
        "documents": documents,
        "shard_bytes": shard_bytes,
        "files": len(recorded),
        "listing": listing.record() if listing else None,
        "shards": shards,
    }
    _write_atomically(folder / SOURCES, json.dumps(recorded).encode())
    _write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    listed = {s["file"] for s in shards}
    for path in folder.glob("*.bin"):
        if path.name not in listed:
            path.unlink(missing_ok=True)
    (folder / JOURNAL).unlink(missing_ok=True)
    return manifest


def _empty_files(source: Source, files: list[SourceFile]) -> str:
    """' (its 2 files hold no text: a.txt, b.jsonl.gz)': which files a local folder or glob without documents
    holds ('' for a lone file, which the source names, and for the other kinds)."""
    if source.kind != "local" or len(files) < 2:
        return ""
    names = ", ".join(os.path.basename(f.path) for f in files[:3])
    more = f" and {len(files) - 3:,} more" if len(files) > 3 else ""
    return f" (its {len(files):,} files hold no text: {names}{more})"


def _tidy_failed_build(folder: Path, dtype: type[np.unsignedinteger], created: Path | None) -> None:
    """After a build that failed (bad input, Ctrl-C): keep only what the next build continues from, the shards it
    finished and the journal that lists them (said in a line), and remove the rest: half-written and unlisted
    shard files, an empty journal, and the store folder (with the folders above it that this build made) when
    nothing is left in it but its lock. A kill leaves what it leaves; the next build tidies it."""
    with contextlib.suppress(OSError):
        kept = {r["file"] for r in _finished_shards(folder, np.dtype(dtype).str).values()}
        for path in [*folder.glob("*.tmp"), *folder.glob("*.bin")]:
            if path.suffix == ".tmp" or path.name not in kept:
                path.unlink(missing_ok=True)
        new = kept - {r["file"] for r in (read_manifest(folder) or {}).get("shards", [])}
        if new:
            logger.info(
                f"titanlite: kept {len(new)} finished shard(s) of this corpus in {folder} (listed in {JOURNAL}): "
                "the next prepare continues from them"
            )
        else:
            (folder / JOURNAL).unlink(missing_ok=True)
        if [p.name for p in folder.iterdir()] == [LOCK]:
            (folder / LOCK).unlink()  # a waiter holding a lock on the deleted file tries again (_exclusive_lock)
            _remove_empty(folder, created or folder)


def _first_missing(folder: Path) -> Path | None:
    """The outermost of `folder` and its parents that does not exist yet (what making it creates), or None."""
    missing = None
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing = path
    return missing


def _remove_empty(folder: Path, up_to: Path) -> None:
    """Remove `folder`, then each parent up to `up_to` (the outermost that this process made) left empty."""
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == up_to:
            return


def _clear(folder: Path) -> None:
    """Forget a store's shards, so the next build tokenises everything again."""
    for path in [folder / MANIFEST, folder / SOURCES, folder / JOURNAL, *folder.glob("*.bin")]:
        path.unlink(missing_ok=True)


def _finished_shards(folder: Path, dtype: str) -> dict[str, dict]:
    """Shards finished earlier (listed by the old manifest or the journal, with their file intact), by key."""
    records = list((read_manifest(folder) or {}).get("shards", []))
    with contextlib.suppress(OSError):
        records += [json.loads(line) for line in (folder / JOURNAL).read_text().splitlines() if line.endswith("}")]
    itemsize = np.dtype(dtype).itemsize
    return {
        r["key"]: r
        for r in records
        if (folder / r["file"]).is_file() and (folder / r["file"]).stat().st_size == r["tokens"] * itemsize
    }


def _piece_key(tokenizer: Tokenizer, dtype: str, spans: list[Span], recorded: dict[str, dict]) -> str:
    """Names a shard by everything its tokens depend on: tokenizer, byte ranges and each file's content
    (not its mtime: a touched file is hashed again, not tokenised again)."""
    parts = [STORE_FORMAT, tokenizer.fingerprint, dtype]
    for s in spans:
        r = recorded[s.path]
        parts += [s.path, s.kind, str(s.start), str(s.stop), str(s.ends_document), str(r["size"]), r["sha256"]]
        parts += [s.field] * (s.field != "text")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _build_pieces(folder, source, files, recorded, tokenizer, dtype, shard_bytes, workers, done) -> list[dict]:
    by_path = {r["path"]: r for r in recorded}
    pieces = plan_pieces(files, shard_bytes, field=source.text_field)
    keys = [_piece_key(tokenizer, dtype, spans, by_path) for spans in pieces]
    shards = {k: done[k] for k in keys if k in done}
    todo = [(folder, key, spans, tokenizer, dtype) for key, spans in zip(keys, pieces) if key not in shards]
    progress = Progress(
        source.description,
        total_bytes=sum(s.nbytes for spans in pieces for s in spans),
        done_bytes=sum(shards[k]["bytes"] for k in shards),
    )
    if shards and todo:
        progress.note(f"continuing: {len(shards)} of {len(pieces)} shards already built")
    workers = min(workers or usable_cores(), len(todo))
    with _results(todo, workers) as results, open(folder / JOURNAL, "a") as journal:
        for shard in results:
            journal.write(json.dumps(shard) + "\n")
            journal.flush()
            shards[shard["key"]] = shard
            progress.update(shard["bytes"], shard["tokens"], shard["documents"])
    progress.finish()
    return [shards[k] for k in keys]


@contextlib.contextmanager
def _results(todo: list[tuple], workers: int) -> Iterator[Iterator[dict]]:
    """tokenize_piece over `todo`, in worker processes when there is more than one to run, in the order they finish.

    concurrent.futures rather than multiprocessing.Pool: after a failure (a bad line in one piece) it cancels the
    pieces not started and waits for the few running, where Pool.terminate can wait forever on its own task thread
    (it did, about once in forty failed builds); and a worker that dies (the kernel's out-of-memory killer) is an
    error here, where Pool waits for its result forever. The platform's default start method (fork on Linux, as
    DataLoader workers): spawn would re-import the caller's main module, which fails for scripts without a
    __main__ guard."""
    if workers <= 1:
        yield (tokenize_piece(task) for task in todo)
        return
    pool = ProcessPoolExecutor(workers, initializer=_default_signals)
    try:
        futures = [pool.submit(tokenize_piece, task) for task in todo]
        yield (_result(future, workers) for future in as_completed(futures))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _default_signals() -> None:
    """A tokenising process ends on SIGTERM/SIGHUP, whatever handler the process that forked it had (a training
    run's only asks for a stop): the pool terminates its processes with SIGTERM when one of them dies."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _result(future: Future, workers: int) -> dict:
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise RuntimeError(
            f"a tokenising process died ({e}); if the machine ran out of memory, use fewer of them "
            f"(data.prepare_workers, or titanlite prepare --workers; it was {workers})"
        ) from e


def tokenize_piece(task: tuple) -> dict:
    """Tokenise one piece into its shard file; runs in a worker process."""
    folder, key, spans, tokenizer, dtype = task
    return _write_shard(
        folder,
        key,
        read_batches(spans),
        tokenizer,
        dtype,
        sum(s.nbytes for s in spans),
        starts_document=not _continues_document(spans[0]),
    )


def _continues_document(span: Span) -> bool:
    """Whether `span` carries on a document begun in an earlier piece: only a .txt file is cut inside a
    document (plan_pieces ends a piece at each such cut, so it is always the next piece's first span);
    .jsonl, .parquet and stdlib spans hold whole documents."""
    return span.kind == "txt" and span.start > 0


def _write_shard(
    folder: Path,
    key: str,
    batches: Iterator[list[tuple[str, bool]]],
    tokenizer: Tokenizer,
    dtype: str,
    nbytes: int,
    starts_document: bool = True,
) -> dict:
    """Encode batches of (text, ends_document) into folder/<key>.bin; each document is followed by the
    end-of-text id (and preceded by the tokenizer's BOS id, if any). `starts_document`: whether the first
    text begins a document. The file appears under its name only once complete."""
    name = f"{key[:24]}.bin"
    tokens = documents = 0
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for batch in batches:
                ids = encode_documents(tokenizer, batch, dtype, starts_document)
                out.write(ids.tobytes())
                tokens += len(ids)
                documents += sum(ends for _, ends in batch)
                starts_document = batch[-1][1]
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return {"key": key, "file": name, "tokens": tokens, "documents": documents, "bytes": nbytes}


def encode_documents(
    tokenizer: Tokenizer, batch: list[tuple[str, bool]], dtype: str, starts_document: bool = True
) -> np.ndarray:
    """Ids of the batch's texts, the end-of-text id after each one that ends a document and, for a tokenizer
    with a BOS id, that id before each one that begins a document: the first text when `starts_document`
    (False: it continues a document from the previous batch or piece), and every text after one that ends a
    document. The texts come as arrays (Tokenizer.encode_batch_arrays), not lists of Python ints, which
    cost as much as the encoding."""
    eot = np.array([tokenizer.eot_id], dtype=np.uint32)
    encoded = tokenizer.encode_batch_arrays([text for text, _ in batch])
    if tokenizer.bos_id is None:
        parts = [part for ids, (_, ends) in zip(encoded, batch) for part in ((ids, eot) if ends else (ids,))]
    else:
        parts = _with_bos(encoded, batch, np.array([tokenizer.bos_id], dtype=np.uint32), eot, starts_document)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)


def _with_bos(
    encoded: list[np.ndarray], batch: list[tuple[str, bool]], bos: np.ndarray, eot: np.ndarray, starts: bool
) -> list[np.ndarray]:
    """[bos] + ids + [eot] per document, a document cut into several texts getting its BOS only once."""
    parts = []
    for ids, (_, ends) in zip(encoded, batch):
        parts += [bos, ids] if starts else [ids]
        if ends:
            parts.append(eot)
        starts = ends
    return parts


def _build_hub(folder: Path, source: Source, tokenizer: Tokenizer, dtype: str, done: dict[str, dict]) -> list[dict]:
    """Stream a hub dataset into shards of HUB_PIECE_DOCUMENTS documents; a rerun skips finished shards."""
    name = source.location

    def key(index: int) -> str:
        parts = ["hub", name, source.options_key(), tokenizer.fingerprint, str(HUB_PIECE_DOCUMENTS), str(index)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    shards: list[dict] = []
    while key(len(shards)) in done:
        shards.append(done[key(len(shards))])
    progress = Progress(source.description, total_bytes=0)
    documents = hub_documents(source, skip=sum(s["documents"] for s in shards))
    with open(folder / JOURNAL, "a") as journal:
        while chunk := list(islice(documents, HUB_PIECE_DOCUMENTS)):
            nbytes = sum(len(text) for text in chunk)
            batches = ([(text, True) for text in chunk[i : i + 1000]] for i in range(0, len(chunk), 1000))
            shard = _write_shard(folder, key(len(shards)), batches, tokenizer, dtype, nbytes)
            journal.write(json.dumps(shard) + "\n")
            journal.flush()
            shards.append(shard)
            progress.update(nbytes, shard["tokens"], shard["documents"])
    progress.finish()
    return shards


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`, made with its folder if missing. Its holder may delete the file (and the
    folder) before it lets go (a failed build leaves nothing): a waiter that then holds a lock on a file no
    longer at `path` tries again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle = open(path, "a")
        except FileNotFoundError:  # the folder was removed between the two calls
            continue
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            ours, now = os.fstat(handle.fileno()), os.stat(path)
            if (ours.st_dev, ours.st_ino) == (now.st_dev, now.st_ino):
                break
        except FileNotFoundError:
            pass
        handle.close()
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Pre-tokenized files


def open_pretokenized(
    source: Source, listing: Listing, tokenizer: Tokenizer, folder: Path, verify: str = "stat"
) -> TokenStore:
    """Memory-map .bin/.npy token files (and Megatron .bin/.idx pairs) in place. Each is checked once
    (header, size, every id inside the tokenizer's vocabulary) and the result cached, beside the store
    `folder` a text source would have, by path, size, mtime and fingerprint."""
    index_path = _index_path(folder)
    cached = _read_index(index_path) or {"files": []}
    by_path = {r["path"]: r for r in cached["files"]}
    records = [_checked_token_file(f, by_path.get(f.path), tokenizer, verify) for f in listing.files()]
    index = {"listing": listing.record(), "files": records}
    if index != cached:
        with contextlib.suppress(OSError):  # the check is only a cache: an unwritable cache costs time, not correctness
            index_path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(index_path, json.dumps(index).encode())
    return _pretokenized_store(source, records, listing.record())


def _index_path(folder: Path) -> Path:
    return folder.parent / f"pretokenized-{folder.name.removeprefix('store-')}.json"


def _read_index(path: Path) -> dict | None:
    try:
        index = json.loads(path.read_text())
        return index if isinstance(index, dict) and isinstance(index.get("files"), list) else None
    except (OSError, ValueError):
        return None


def _pretokenized_store(source: Source, records: list[dict], listing: dict) -> TokenStore:
    maps = [(r["path"], r["dtype"], r["offset"], r["count"]) for r in records]
    summary = listing["summary"]
    documents = [r.get("documents") for r in records]
    if any(r.get("ends_with_eot") is False for r in records):
        summary += ("; " if summary else "") + (
            "its Megatron documents are not followed by the end-of-text id (made without --append-eod), so "
            "windows run them together"
        )
    return TokenStore.from_files(
        maps,
        label=source.description,
        documents=None if None in documents else sum(documents),
        summary=summary,
        held_files=listing["held"],
    )


def _checked_token_file(f: SourceFile, record: dict | None, tokenizer: Tokenizer, verify: str) -> dict:
    if verify == "full" or record is None or not _sources_match([record], [f], verify):
        return inspect_token_file(f, tokenizer)
    return record


def describe(store: TokenStore) -> str:
    shards = f"{store.num_shards} shard" + ("s" if store.num_shards != 1 else "")
    docs = f"{store.documents:,} documents, " if store.documents is not None else ""
    summary = f" ({store.summary})" if store.summary else ""
    return f"{store.label}{summary}: {docs}{len(store):,} tokens in {shards}"
