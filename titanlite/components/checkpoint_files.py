"""A checkpoint on disk: the step-<N>/ folders of a run, the marker that says one is complete, the SHA-256 of
every file it holds, and which of them can be loaded.

Each saving rank hashes the files it wrote itself (`__<rank>_*.distcp`; rank 0 also DCP's `.metadata`), in
parallel with the others, while they are still in the page cache, and leaves the result beside them; rank 0
merges those into checksums.json before it writes the marker and renames step-<N>.tmp/ to step-<N>/. A load
re-hashes every file, each rank a share of them, so a byte changed on disk (a same-size corruption, a bad
sector) is found before anything is loaded, not as a wrong loss later.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titanlite.base.errors import ConfigError

MARKER = "titanlite.json"
CHECKSUMS = "checksums.json"
METADATA = ".metadata"
RANK_CHECKSUMS = ".checksums-rank{rank}.json"
# How long rank 0 waits for another rank's checksums once its own part of a save is written.
CHECKSUM_WAIT_SECONDS = 600.0

logger = logging.getLogger(__name__)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step}"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete (renamed) checkpoint folder, newest first."""
    try:
        paths = list(run_dir.glob("step-*"))
    except OSError as e:  # an unreadable run folder
        raise ConfigError(f"cannot list the run folder {run_dir} ({e.strerror or e}); make it readable") from None
    steps = []
    for path in paths:
        suffix = path.name.removeprefix("step-")
        if suffix.isdigit() and path.is_dir():
            steps.append(int(suffix))
    return sorted(steps, reverse=True)


def read_marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


# ---- checksums at save ----------------------------------------------------------------------------


def sha256_of(path: Path, chunk: int = 16 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_rank_checksums(folder: Path, rank: int) -> None:
    """Hash the files this rank wrote into `folder` (rank 0: DCP's metadata too) and leave the result there."""
    names = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (folder / METADATA).is_file():
        names.append(METADATA)
    entries = {name: {"size": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)} for name in names}
    _write_json_atomically(folder / RANK_CHECKSUMS.format(rank=rank), entries)


def merge_checksums(folder: Path, world_size: int, timeout: float = CHECKSUM_WAIT_SECONDS) -> dict:
    """Rank 0: every rank's checksums, once each has written them, into checksums.json (the ranks' files removed)."""
    deadline = time.monotonic() + timeout
    merged: dict[str, dict] = {}
    for rank in range(world_size):
        path = folder / RANK_CHECKSUMS.format(rank=rank)
        while not path.is_file():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} left no checksums in {folder} within {timeout:.0f} s of the save")
            time.sleep(0.05)
        merged |= json.loads(path.read_text())
    _write_json_atomically(folder / CHECKSUMS, dict(sorted(merged.items())))
    for rank in range(world_size):
        (folder / RANK_CHECKSUMS.format(rank=rank)).unlink(missing_ok=True)
    return merged


def _write_json_atomically(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# ---- what can be loaded ---------------------------------------------------------------------------


def verify(path: Path, share: tuple[int, int] | None = None, contents: bool = True) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None. Every file DCP's metadata needs must be there
    in full; with `contents`, each file's SHA-256 must equal the one recorded at save (`share` = (rank, world)
    hashes only this rank's share of the files; the ranks then agree through `agreed_problem`).
    Checkpoints saved before titanlite recorded checksums are checked for presence and size only."""
    try:
        read_marker(path)
    except FileNotFoundError:
        return f"its marker {MARKER} is missing"
    except OSError as e:
        return f"its marker {MARKER} cannot be read ({e.strerror or e})"
    except ValueError:
        return f"its marker {MARKER} is damaged"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        return f"{METADATA} (DCP's index of its files) is missing"
    except Exception:  # a damaged .metadata fails to unpickle in any of many ways
        return f"{METADATA} (DCP's index of its files) is damaged"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size} of {size} bytes)"
    if not contents or not (path / CHECKSUMS).is_file():
        return None
    return _checksum_problem(path, share)


def _checksum_problem(path: Path, share: tuple[int, int] | None) -> str | None:
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())
        missing = sorted({p.name for p in path.glob("*.distcp")} - set(recorded))
        if missing:
            return f"{missing[0]} has no recorded checksum"
        names = sorted(recorded)
        rank, world = share or (0, 1)
        for name in names[rank::world]:
            file, want = path / name, recorded[name]
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != want["size"]:
                return f"{name} has {file.stat().st_size} bytes, not the {want['size']} it was saved with"
            if sha256_of(file) != want["sha256"]:
                return f"{name} does not match its checksum (its bytes changed after the save)"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {CHECKSUMS} is damaged, so its files cannot be checked"
    return None


def agreed_problem(path: Path, distributed: bool, contents: bool = True) -> str | None:
    """verify() with the work shared by every rank of the default process group, which all reach the same
    answer (so all load the same checkpoint); one process verifies everything itself."""
    if not (distributed and dist.is_initialized() and dist.get_world_size() > 1):
        return verify(path, contents=contents)
    share = (dist.get_rank(), dist.get_world_size())
    problems: list[str | None] = [None] * share[1]
    dist.all_gather_object(problems, verify(path, share, contents))
    return next((p for p in problems if p is not None), None)


def pick_checkpoint(
    run_dir: Path,
    load_step: int,
    *,
    distributed: bool = False,
    contents: bool = True,
    known: dict[int, str] | None = None,
    said: set[int] | None = None,
) -> Path | None:
    """checkpoint.load_step's folder (an error if it is not usable), or the newest usable one, skipping any that is
    incomplete or damaged with a warning that names it, why, and the checkpoint used instead; None when the folder
    has no checkpoint. Checkpoints exist but none is usable: an error listing each and why (the run would otherwise
    start over from step 0 without a word). `known`: steps already found unusable (a load that failed), with why;
    `said`: steps whose warning was given already (by an earlier call), added to."""
    steps, known, said = complete_steps(run_dir), known or {}, set() if said is None else said
    if load_step != -1:
        path = step_dir(run_dir, load_step)
        problem = "it does not exist" if load_step not in steps else agreed_problem(path, distributed, contents)
        if problem:
            raise ConfigError(f"checkpoint.load_step={load_step}: cannot load {path} ({problem})")
        return path
    skipped: dict[int, str] = {}
    for step in steps:
        path = step_dir(run_dir, step)
        problem = known.get(step) or agreed_problem(path, distributed, contents)
        if problem is None:
            for old, why in skipped.items():
                if old not in said:
                    logger.warning(
                        f"  checkpoint: WARNING skipping {step_dir(run_dir, old)}: {why}; resuming from {path.name} "
                        "instead"
                    )
                    said.add(old)
            return path
        skipped[step] = problem
    if skipped:
        listed = "; ".join(f"step-{step}: {problem}" for step, problem in skipped.items())
        raise ConfigError(
            f"no usable checkpoint in {run_dir}: {listed}; to train from step 0 anyway (later saves replace these), "
            "set checkpoint.start_from_scratch = true"
        )
    return None
