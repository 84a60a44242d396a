"""Where corpus text comes from: the built-in standard-library corpus, local files, folders, globs and Megatron
prefixes (listed here, read by titanlite/data/readers.py), and Hugging Face hub datasets (streamed).

A source's files are identified by path, size, mtime and a sampled fingerprint (a few KiB read, whatever
the file's size), so a store can tell that its sources changed without reading them.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import logging
import os
import re
import socket
import sysconfig
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.errors import ConfigError, resolved_against, short_reason, special_file
from titanlite.data.arrow_files import saved_dataset_files

TEXT_KINDS = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
TOKEN_KINDS = {".bin": "bin", ".npy": "npy"}
CODECS = {".gz": "gz", ".zst": "zst", ".zstd": "zst", ".bz2": "bz2", ".xz": "xz"}
STREAM_KINDS = ("txt", "jsonl")  # the kinds a compressed file may hold
LOCAL_HINT = (
    "a .txt, .jsonl/.json (JSON lines), .parquet or .arrow file (text; .txt and JSON lines also as .gz, .zst, "
    ".bz2 or .xz), a .bin/.npy token file or Megatron prefix, a datasets save_to_disk folder, a folder of "
    "such files or a glob"
)
# The files of a pre-tokenised folder whose names say they are for validation (nanoGPT's val.bin, llm.c's
# fineweb_val_000000.bin, ...): kept out of training and offered as its validation set.
VALIDATION_NAME = re.compile(r"(?:^|[^a-z])(?:val|valid|validation)(?:[^a-z]|$)")
# Above this many files, a training rank trusts a store whose watched folders are unchanged, without listing
# them or a stat per file (titanlite check, which every launch runs first, lists and compares each file).
STAT_EACH_FILE_UP_TO = 1000

# About 8 MiB of source code tokenises in a few seconds yet is plenty for smoke-test training.
STDLIB_BYTE_BUDGET = 8 * 2**20
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})

FINGERPRINT_SAMPLES = 16
FINGERPRINT_BLOCK = 4096
logger = logging.getLogger(__name__)

# Hub datasets are streamed in pieces of this many documents.
HUB_PIECE_DOCUMENTS = 20_000
# How long the one connection that tells whether the hub can be reached may take (`datasets` itself retries each
# request five times over half a minute, printing each retry).
HUB_PROBE_SECONDS = 5.0


@dataclass(frozen=True)
class Source:
    """One corpus: kind 'stdlib', 'local' (a file, folder, glob or Megatron prefix) or 'hub' (a dataset name);
    `label` names the config key that chose it, for messages. The options say which part and field of it:
    `text_field` (JSON field or column), `split` (a hub or datasets split; for a pre-tokenised folder with
    validation files, 'train' leaves them out and any other split takes only them), and for hub datasets
    `subset` (config name), `data_files`, `data_dir`. `skip_unsupported`: leave out files titanlite does not read."""

    kind: str
    location: str = ""
    label: str = ""
    text_field: str = "text"
    split: str = "train"
    subset: str = ""
    data_files: tuple[str, ...] = ()
    data_dir: str = ""
    skip_unsupported: bool = False

    @property
    def description(self) -> str:
        if self.kind == "stdlib":
            return "the standard-library corpus"
        if self.kind == "local":
            return self.location
        parts = [f"hub:{self.location}"] + [self.subset] * bool(self.subset) + [f"split {self.split}"]
        return " ".join(parts)

    def options_key(self) -> str:
        """What, beyond kind and location, changes this source's tokens ('' when all are the defaults)."""
        options = (self.text_field, self.split, self.subset, self.data_files, self.data_dir)
        return "" if options == ("text", "train", "", (), "") else repr(options)


def parse_source(text: str, label: str, **options) -> Source:
    """'stdlib', 'hub:NAME', or a local path (file, folder, glob or Megatron prefix)."""
    if text == "stdlib":
        return Source("stdlib", "", label)
    if text.startswith("hub:"):
        return Source("hub", text[4:], label, **options)
    return Source("local", text, label, **options)


def classify(name: str) -> tuple[str, str] | None:
    """(kind, codec) of a file name: ('jsonl', 'zst') for a.jsonl.zst, ('bin', '') for a token file; None for
    a file titanlite does not read."""
    stem, suffix = os.path.splitext(name.lower())
    codec = CODECS.get(suffix, "")
    if codec:
        stem, suffix = os.path.splitext(stem)
    kind = TEXT_KINDS.get(suffix) or TOKEN_KINDS.get(suffix)
    if kind is None or (codec and kind not in STREAM_KINDS):
        return None
    return kind, codec


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int
    mtime_ns: int
    kind: str = "txt"
    codec: str = ""

    @classmethod
    def stat(cls, path: Path | str, kind: str | None = None) -> SourceFile:
        info = os.stat(path)
        found = (kind, "") if kind else classify(str(path)) or ("txt", "")
        return cls(str(path), info.st_size, info.st_mtime_ns, *found)

    def as_record(self) -> dict:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns}


def fingerprint(path: str, size: int) -> str:
    """sha256 of FINGERPRINT_SAMPLES blocks spread evenly over the file (first and last included)."""
    digest = hashlib.sha256(str(size).encode())
    with open_file(path) as f:
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
    with open_file(path) as f:
        while block := f.read(2**24):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Listing files


@dataclass(frozen=True)
class Listing:
    """The files of a source in corpus order, found from directory listings alone (no stat per file), with
    `fingerprint` naming that listing (watch_fingerprint). What it leaves out, each said by `summary`:
    `left_out`, unsupported files skipped on request; `held`, validation files of a pre-tokenised folder kept
    out of this split; `hidden`, hidden files and folders (.name) of a folder; `folders`, folders a glob
    matched (it reads files)."""

    paths: tuple[str, ...]
    kinds: tuple[tuple[str, str], ...]
    fingerprint: str | None  # None when a watched path vanished while listing
    left_out: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    watched: tuple[str, ...] = ()  # the folders walked (or the lone file): what `fingerprint` is made of
    hidden: tuple[str, ...] = ()
    folders: tuple[str, ...] = ()

    def record(self) -> dict:
        """What a store keeps of its listing, so that a training rank can trust it without listing again."""
        return {
            "fingerprint": self.fingerprint,
            "watched": list(self.watched),
            "files": len(self.paths),
            "held": len(self.held),
            "summary": self.summary(),
        }

    @property
    def pretokenized(self) -> bool:
        return bool(self.kinds) and self.kinds[0][0] in TOKEN_KINDS.values()

    def files(self) -> list[SourceFile]:
        """Each file with its size and mtime (one stat per file)."""
        return [_stat_listed(p, kind, codec) for p, (kind, codec) in zip(self.paths, self.kinds)]

    def summary(self) -> str:
        """'3 files: 2 .jsonl.gz, 1 .txt; left out: ...' for the start-up's data line ('' for one plain file)."""
        counts: dict[str, int] = {}
        for path, (_, codec) in zip(self.paths, self.kinds):
            stem, suffix = os.path.splitext(path.lower())
            name = os.path.splitext(stem)[1] + suffix if codec else suffix
            counts[name] = counts.get(name, 0) + 1
        parts = (
            []
            if len(self.paths) == 1
            else [
                f"{len(self.paths):,} files: "
                + ", ".join(f"{n:,} {name}" for name, n in sorted(counts.items(), key=lambda item: -item[1]))
            ]
        )
        if self.held:
            parts.append(f"{len(self.held):,} validation file(s) kept out of training ({_names(self.held)})")
        if self.left_out:
            parts.append(f"{len(self.left_out):,} unsupported file(s) left out ({_names(self.left_out)})")
        if self.hidden:
            parts.append(f"{len(self.hidden):,} hidden file(s) or folder(s) left out ({_names(self.hidden)})")
        if self.folders:
            parts.append(f"{len(self.folders):,} folder(s) the pattern matched left out ({_names(self.folders)})")
        return "; ".join(parts)


def _stat_listed(path: str, kind: str, codec: str) -> SourceFile:
    """A listed file's size and mtime; one that went away or became unreadable since the listing is named."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise ConfigError(
            f"cannot read {path} ({e.strerror}); it changed while the corpus was listed: restore it or remove it, "
            "and run the command again"
        ) from e
    return SourceFile(path, info.st_size, info.st_mtime_ns, kind, codec)


def _names(paths: tuple[str, ...] | list[str], most: int = 3) -> str:
    shown = ", ".join(os.path.basename(p) for p in paths[:most])
    return shown + (f" and {len(paths) - most:,} more" if len(paths) > most else "")


def source_files(source: Source) -> list[SourceFile]:
    """The files that make up `source`, in corpus order, each with its size and mtime."""
    if source.kind == "stdlib":
        return stdlib_files()
    if source.kind == "local":
        return local_listing(source).files()
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
        entry = SourceFile.stat(root / rel, "stdlib")
        files.append(entry)
        gathered += entry.size
        if gathered >= STDLIB_BYTE_BUDGET:
            break
    return files


def local_listing(source: Source) -> Listing:
    """The usable files at a local source, all of them text or all of them token files: the file itself, a
    Megatron prefix's .bin, a datasets save_to_disk folder's arrow files (of source.split), or the files of
    a folder (sorted by path; hidden ones left out, symlinked folders followed) or of a glob (sorted). A
    Megatron .idx goes with its .bin."""
    where = f"{source.label}='{source.location}'{resolved_against(source.location)}"
    if not source.location:
        raise ConfigError(f"{source.label} is empty; give {LOCAL_HINT}")
    root = Path(source.location).expanduser()
    hidden: list[str] = []
    matched_folders: list[str] = []
    if glob.has_magic(source.location):
        paths, matched_folders = _glob(str(root), where, "**" in source.location)
        if not paths:
            raise ConfigError(f"{where} matches no file; fix the pattern")
        folders = sorted({os.path.dirname(p) for p in paths})
    elif os.path.islink(root) and not root.exists():
        raise _dangling(str(root), where, named=True)
    elif root.is_file():
        if classify(root.name) is None:
            raise ConfigError(f"{where} has an unsupported suffix; use {LOCAL_HINT}")
        paths, folders = [str(root)], []
    elif not root.exists() and os.path.isfile(f"{root}.bin") and os.path.isfile(f"{root}.idx"):
        paths, folders = [f"{root}.bin"], []  # a Megatron prefix
    elif kind := special_file(root):
        raise ConfigError(f"{where} is {kind}, not a file; use {LOCAL_HINT}")
    elif not root.is_dir():
        raise ConfigError(f"{where} does not exist; use {LOCAL_HINT}")
    elif (saved := saved_dataset_files(root, source.split, _split_key(source))) is not None:
        paths, folders = [str(p) for p in saved], [str(root)]
    else:
        paths, folders, hidden = _walk(str(root), where)
    listing = _listing(source, paths, folders)
    return dataclasses.replace(listing, hidden=tuple(hidden), folders=tuple(matched_folders))


def _walk(root: str, where: str) -> tuple[list[str], list[str], list[str]]:
    """A folder's files (sorted by path), the folders walked and the hidden entries (.name) left out. A symlinked
    folder is walked as a real one; a link back into its own path, a dangling link, a special file or a folder
    that cannot be listed is a ConfigError naming it. Plain strings and os.scandir (no stat for a plain entry):
    this runs on every rank, over every file."""
    found, folders, hidden = [], [], []
    stack: list[tuple[str, tuple[tuple[int, int], ...]]] = [(root, (_identity(root),))]
    while stack:
        folder, ancestors = stack.pop()  # ancestors: (device, inode) of each folder from the root to this one
        folders.append(folder)
        try:
            with os.scandir(folder) as scan:
                entries = list(scan)
        except OSError as e:
            raise ConfigError(
                f"{where}: cannot list its folder {folder} ({e.strerror}); fix its permissions or remove it"
            ) from e
        for entry in entries:
            if entry.name.startswith("."):
                hidden.append(entry.path)
            elif entry.is_symlink() and not os.path.exists(entry.path):
                raise _dangling(entry.path, where)
            elif entry.is_dir():  # a symlink to a folder too
                identity = _identity(entry.path)
                if identity in ancestors:
                    raise ConfigError(
                        f"{where}: {entry.path} is a symlink to {os.path.realpath(entry.path)}, a folder it is "
                        "inside of (a loop); remove the link or point it elsewhere"
                    )
                stack.append((entry.path, (*ancestors, identity)))
            elif entry.is_file():
                found.append(entry.path)
            else:
                raise ConfigError(f"{where}: {entry.path} is {_not_a_file(entry.path)}; remove it")
    return sorted(found), sorted(folders), sorted(hidden)


def _identity(folder: str) -> tuple[int, int]:
    info = os.stat(folder)
    return info.st_dev, info.st_ino


def _glob(pattern: str, where: str, recursive: bool) -> tuple[list[str], list[str]]:
    """The files a glob matches (sorted) and the folders it matched (left out, said; not with '**', which
    asks for folders' files). A dangling link or a special file among them is a ConfigError naming it."""
    files, folders = [], []
    for path in sorted(glob.glob(pattern, recursive=recursive)):
        if os.path.islink(path) and not os.path.exists(path):
            raise _dangling(path, where)
        if os.path.isdir(path):
            folders += [] if recursive else [path]
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ConfigError(f"{where} matches {path}, which is {_not_a_file(path)}; remove it")
    return files, folders


def _not_a_file(path: str) -> str:
    kind = special_file(path)
    return f"{kind}, not a file" if kind else "not a file"


def _dangling(path: str, where: str, named: bool = False) -> ConfigError:
    """A symlink whose target does not exist (or that leads back to itself), named with that target; `named`:
    the link is the path the key gives."""
    target = os.readlink(path)
    if not os.path.isabs(target):
        target += f" ({os.path.normpath(os.path.join(os.path.dirname(path), target))})"
    try:
        os.stat(path)
        loop = False
    except OSError as e:
        loop = e.errno == errno.ELOOP
    reason = f"it leads back to itself through {target}" if loop else f"its target {target} does not exist"
    if named:
        return ConfigError(f"{where} is a symlink, but {reason}; restore its target or point the key at the data")
    return ConfigError(f"{where}: {path} is a symlink, but {reason}; remove the link or restore its target")


def _listing(source: Source, paths: list[str], folders: list[str]) -> Listing:
    where = f"{source.label}='{source.location}'{resolved_against(source.location)}"
    bins = {p[:-4] for p in paths if p.endswith(".bin")}
    usable, kinds, unsupported = [], [], []
    for path in paths:
        if path.endswith(".idx") and path[:-4] in bins:
            continue  # a Megatron index, read with its .bin
        kind = classify(os.path.basename(path))
        if kind is None:
            unsupported.append(path)
        else:
            usable.append(path)
            kinds.append(kind)
    if unsupported and not source.skip_unsupported:
        raise ConfigError(
            f"{where} holds {len(unsupported):,} file(s) titanlite does not read ({_names(unsupported)}); remove "
            "them, or set data.skip_unsupported_files = true to leave them out"
        )
    if not usable:
        raise ConfigError(f"{where} holds no usable files; use {LOCAL_HINT}")
    if len({kind in TOKEN_KINDS.values() for kind, _ in kinds}) > 1:
        raise ConfigError(
            f"{where} mixes text files with pre-tokenized .bin/.npy shards; "
            "put them in separate folders (a mixture can combine both)"
        )
    held: list[str] = []
    if kinds[0][0] in TOKEN_KINDS.values() and len(usable) > 1:
        usable, kinds, held = _split_validation_files(source, usable, kinds)
    watched = tuple(folders) or tuple(usable)
    fingerprint = watch_fingerprint(watched, source.skip_unsupported)
    return Listing(tuple(usable), tuple(kinds), fingerprint, tuple(unsupported), tuple(held), watched)


def watch_fingerprint(watched: tuple[str, ...] | list[str], skip_unsupported: bool) -> str | None:
    """What says a listing is unchanged without listing again: the mtime of each folder it walked (which
    changes when a file is added to, removed from or renamed in it), or the size and mtime of a lone file.
    None when one of them is gone."""
    digest = hashlib.sha256(f"{skip_unsupported}".encode())
    for path in watched:
        try:
            info = os.stat(path)
        except OSError:
            return None
        digest.update(f"\0{path}\0{info.st_mtime_ns}\0{info.st_size if not os.path.isdir(path) else 0}".encode())
    return digest.hexdigest()


def _split_validation_files(source: Source, paths: list[str], kinds: list) -> tuple[list, list, list]:
    """Training (split 'train') takes a pre-tokenised folder's files but those named for validation; any
    other split takes only those. A folder without such files is all training data, whatever the split."""
    root = source.location
    is_val = [bool(VALIDATION_NAME.search(os.path.relpath(p, root).lower())) for p in paths]
    if not any(is_val):
        return paths, kinds, []
    want = source.split != "train"
    chosen = [(p, k) for p, k, v in zip(paths, kinds, is_val) if v == want]
    other = [p for p, v in zip(paths, is_val) if v != want]
    if not chosen:
        raise ConfigError(
            f"{source.label}='{source.location}'{resolved_against(source.location)} holds only validation files "
            f"({_names(other)}); name the training files instead"
        )
    return [p for p, _ in chosen], [k for _, k in chosen], other


def _split_key(source: Source) -> str:
    return source.label.rpartition(".")[0] + ".dataset_split"


def open_file(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror}); fix its permissions or remove it from the corpus") from e


# ----------------------------------------------------------------------------------------------
# Hub datasets


def hub_documents(source: Source, skip: int = 0) -> Iterator[str]:
    """The text field of a hub dataset's split (subset, data_files and data_dir as the source names them),
    streamed (never loaded whole), from document `skip` on. Needs network (or a local dataset folder)."""
    where = f"{source.label}='{source.location}'"
    section = source.label.rpartition(".")[0]
    options = {"data_files": list(source.data_files) or None, "data_dir": source.data_dir or None}
    unreachable = ""
    try:
        import datasets  # seconds to import: only for hub sources
        import huggingface_hub.constants  # datasets' own dependency: its offline switch

        offline = getattr(datasets.config, "HF_HUB_OFFLINE", False) or datasets.config.HF_DATASETS_OFFLINE
        if not offline and not os.path.exists(source.location):
            unreachable = hub_unreachable()
        if unreachable:  # offline mode: what is in this machine's cache is read, at once; the rest is refused below
            os.environ["HF_HUB_OFFLINE"] = "1"
            datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
            huggingface_hub.constants.HF_HUB_OFFLINE = True
        data = datasets.load_dataset(
            source.location, source.subset or None, split=source.split, streaming=True, **options
        )
        if skip:
            data = data.skip(skip)
        rows = iter(data)
        first = next(rows, None)
    except Exception as e:
        if unreachable:
            raise ConfigError(
                f"{where} is not in this machine's Hugging Face cache, and {unreachable}; connect this machine to the "
                "hub (or set HF_ENDPOINT or HTTPS_PROXY), or use dataset = 'local' with dataset_path"
            ) from e
        raise ConfigError(
            f"{where} could not be loaded from the Hugging Face hub ({short_reason(e)}); {_hub_advice(e, section)}"
        ) from e
    if unreachable:
        logger.warning(f"titanlite: note: {unreachable}; {where} is read from this machine's Hugging Face cache")
    if first is None:
        return
    field = source.text_field
    if not isinstance(first.get(field), str):
        raise ConfigError(
            f"{where} has no '{field}' text column (columns: {', '.join(first)}); set "
            "training.dataset_text_field to the column that holds the text"
        )
    yield first[field]
    count = 1
    try:
        for row in rows:
            yield row[field]
            count += 1
    except Exception as e:
        raise ConfigError(
            f"the stream of {where} broke after {skip + count} documents ({short_reason(e)}); "
            "run the same command again to continue from the last finished shard"
        ) from e


def hub_unreachable(endpoint: str = "") -> str:
    """'' when one connection to the Hugging Face hub (`endpoint`, default HF_ENDPOINT's or huggingface.co; through
    the proxy the environment names for it, if any) opens within HUB_PROBE_SECONDS, else why not: 'ENDPOINT cannot
    be reached (REASON)'."""
    if not endpoint:
        import huggingface_hub.constants  # a dependency of datasets, which hub sources import anyway

        endpoint = huggingface_hub.constants.ENDPOINT
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy, through = urllib.request.getproxies().get(url.scheme, ""), ""
    if proxy and not urllib.request.proxy_bypass(host):
        via = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port, through = via.hostname or "", via.port or 80, f"through the proxy {proxy}: "
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
        return ""
    except OSError as e:
        return f"{endpoint} cannot be reached ({through}{short_reason(e)})"


def _hub_advice(error: Exception, section: str) -> str:
    """Which key to set, with the choices `datasets` named."""
    text = str(error)
    choices = re.search(r"(?:configs|splits): (\[[^\]]*\])", text)
    among = f" (one of {choices.group(1)})" if choices else ""
    if "Config name is missing" in text or "BuilderConfig" in text:
        return f"set {section}.dataset_subset{among}"
    if "split" in text.lower():
        return f"set {section}.dataset_split{among}"
    return f"check {section}.dataset and its keys, or use dataset = 'stdlib' or 'local' with dataset_path"
