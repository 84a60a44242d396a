"""Sharded DCP checkpoints: atomic, checksummed, verified before loading, resumable on any layout, optionally async.

A checkpoint is written to step-<N>.tmp/ and renamed to step-<N>/ only once every rank's data, DCP's
metadata, the checksum of every file and our titanlite.json are on disk, so a folder named step-<N> is
complete by construction (titanlite/components/checkpoint_files.py). It records the config it was saved
under, so a resume can say what changed and refuse what would make the saved state wrong
(titanlite/components/resume.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.base.command_line import LAUNCH_ID_ENV
from titanlite.base.devices import uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.components.checkpoint_files import (
    CHECKSUMS,
    MARKER,
    agreed_problem,
    complete_steps,
    merge_checksums,
    pick_checkpoint,
    read_marker,
    step_dir,
    write_rank_checksums,
)
from titanlite.components.hf_weights import export_evaluation, load_hf_into
from titanlite.components.resume import CORPUS_KEYS, flat_config, resume_changes
from titanlite.components.torch_private import stager_closed, stop_process_saver
from titanlite.config import JobConfig, parse_config

logger = logging.getLogger(__name__)

# In one process DCP warns, at every save and load, that it assumes one process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
# Under pipeline parallelism the last stage holds a tied embedding's copy as output.weight; its
# optimizer state is saved and loaded under the embedding's name, the name it has without PP.
TIED_COPY, TIED_NAME = "output.weight", "tok_embeddings.weight"


class Checkpointer:
    """Saves and restores everything an exact continuation needs: model, optimizer, LR schedule, data
    position, step and token count, and the RNG state; with them the config and the run's facts (the
    model's shape, the tokenizer, the corpus size) that a resume is checked against."""

    def __init__(
        self,
        job: JobConfig,
        run_dir: Path,
        model_parts: list[nn.Module],
        optimizers,
        lr_schedulers,
        loader,
        *,
        tied_copy_parts: set[int],
        facts: dict,
    ):
        self.job, self.cfg, self.run_dir, self.facts = job, job.checkpoint, run_dir, facts
        self.initial_load_path = initial_weights_path(job)
        self.model_parts, self.optimizers, self.lr_schedulers, self.loader = (
            model_parts,
            optimizers,
            lr_schedulers,
            loader,
        )
        self.tied_copy_parts = tied_copy_parts  # indices of parts holding a tied embedding's copy (PP last stage)
        self.final_step = job.training.stop_after_step or job.training.steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # (future, tmp, final, meta, start) of an async save in flight
        self.pending: tuple[Future, Path, Path, dict, float] | None = None
        self.saved_step = -1
        # Which line of checkpoints this run continues (see lineage_of): a new one unless a checkpoint of the run
        # folder is loaded, whose lineage it then takes.
        self.lineage = launch_lineage()
        self.mode = self.cfg.async_mode if self.cfg.enable else "disabled"
        # A background save must not share a process group with training collectives (gloo mixes them up).
        self.async_group = dist.new_group(backend="gloo") if self.mode != "disabled" and dist.is_initialized() else None
        # Hashes this rank's files once its part of an async save is written, off the training thread.
        self.hasher = ThreadPoolExecutor(max_workers=1) if self.mode != "disabled" else None
        self.stager = None
        if self.mode == "async_with_pinned_mem":
            self.stager = process_saver_stager(pinned=uses_cuda())
            where = "pinned" if uses_cuda() else "shared (pinned memory needs CUDA)"
            logger.info(
                f"  checkpoint: async_with_pinned_mem: each save is copied to {where} host memory, then written "
                "by a background process"
            )

    # ---- what is saved -----------------------------------------------------------------------

    def model_state(self) -> dict:
        state: dict[str, Any] = {}
        for part in self.model_parts:
            state |= get_model_state_dict(part)
        return state

    def optimizer_state(self) -> dict:
        state: dict[str, Any] = {}
        for i, (part, optimizers) in enumerate(zip(self.model_parts, self.optimizers.by_part)):
            # A part's optimizers (AdamW, and Muon) as one: its state keyed by the part's parameter names.
            part_state = get_optimizer_state_dict(part, optimizers, options=OPTIM_OPTIONS)
            state |= rename_tied(part_state, TIED_COPY, TIED_NAME) if i in self.tied_copy_parts else part_state
        return state

    def full_state(self, train_state: dict) -> dict:
        state = {
            "model": self.model_state(),
            "optimizer": self.optimizer_state(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "dataloader": self.loader.state_dict(),
            "train_state": dict(train_state),
            "rng": {"cpu": torch.get_rng_state()},
        }
        if uses_cuda():
            state["rng"]["cuda"] = torch.cuda.get_rng_state().cpu()
        return state

    # ---- saving ------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether maybe_save(step) will save (without a forced save)."""
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == self.final_step)

    def maybe_save(self, step: int, train_state: dict, force: bool = False) -> bool:
        """Save on the interval, always at the final step (training.steps or stop_after_step), and when
        forced (preemption); a step already saved is not saved again. Returns whether step is saved now."""
        if not self.cfg.enable:
            return False
        last = step == self.final_step or force
        if force and self.saved_step == step:
            self.wait()
            return True
        if step % self.cfg.interval and not last:
            self.poll()
            return False
        if last and self.cfg.model_only:
            dtype = getattr(torch, self.cfg.export_dtype)
            self.save(step, {"model": {k: v.to(dtype) for k, v in self.model_state().items()}}, model_only=True)
        else:
            self.save(step, self.full_state(train_state), model_only=False)
        if last:
            self.wait()
        return True

    def save(self, step: int, state: dict, *, model_only: bool) -> None:
        self.wait()  # one save in flight at a time
        self.saved_step = step
        final, tmp = step_dir(self.run_dir, step), self.run_dir / f"step-{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a save that was interrupted
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()
        meta = {
            "step": step,
            "model_only": model_only,
            "world_size": self.world_size,
            "config": flat_config(self.job),
            "facts": self.facts,
            "lineage": self.lineage,
        }
        start = time.perf_counter()
        if self.mode == "disabled":
            with self.discarded_on_failure(tmp):
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
                write_rank_checksums(tmp, self.rank)
                self.finalize(tmp, final, meta, time.perf_counter() - start)
        else:
            kind = dcp.state_dict_saver.AsyncCheckpointerType
            response = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=self.async_group,
                async_checkpointer_type=kind.PROCESS if self.stager is not None else kind.THREAD,
                async_stager=self.stager,
            )
            if self.stager is not None and stager_closed(self.stager):
                self.stager = process_saver_stager(pinned=uses_cuda())
            # The upload's Future, from an AsyncSaveResponse or the Future async_save returned.
            written = cast(Future, getattr(response, "upload_completion", response))
            assert self.hasher is not None  # made when saves are async
            done = self.hasher.submit(self.checksum_when_written, written, tmp)
            self.pending = (done, tmp, final, meta, start)

    def checksum_when_written(self, written: Future, tmp: Path) -> None:
        """In the background: wait for this rank's part of an async save, then hash its files."""
        written.result()
        write_rank_checksums(tmp, self.rank)

    def poll(self) -> None:
        """Finish an async save that has completed, without waiting for one that has not."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, meta, start = self.pending
        self.pending = None
        with self.discarded_on_failure(tmp):
            future.result()
            self.finalize(tmp, final, meta, time.perf_counter() - start)

    @contextmanager
    def discarded_on_failure(self, tmp: Path) -> Iterator[None]:
        """A save that fails (a full disk, a DCP error) leaves no partial step-<N>.tmp/ behind to fill the disk:
        rank 0 removes it, then the failure goes on."""
        try:
            yield
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def finalize(self, tmp: Path, final: Path, meta: dict, seconds: float) -> None:
        """Mark the checkpoint complete (every rank's checksums merged, the marker, then an atomic rename) and
        apply the retention policy. Each rank leaves its checksums once its part is written; rank 0 waits for
        them, so the marker only goes on a checkpoint whose every file is written and hashed."""
        if self.rank != 0:
            return
        merge_checksums(tmp, self.world_size)
        (tmp / MARKER).write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        logger.info(f"  checkpoint: saved {final} in {seconds:.1f}s")
        self.apply_retention()

    def apply_retention(self) -> None:
        """keep_latest_k among the checkpoints of this run's lineage only: never one another run (a start from
        scratch in the same folder, an older titanlite's branch) saved."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        mine = [
            step for step in complete_steps(self.run_dir) if lineage_of(step_dir(self.run_dir, step)) == self.lineage
        ]
        for step in mine[k:]:
            shutil.rmtree(step_dir(self.run_dir, step), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.hasher is not None:
            self.hasher.shutdown()
        if self.stager is not None:
            self.stager.close()  # frees the pinned (or shared) staging buffers
            self.stager = None
            stop_process_saver()

    # ---- loading -----------------------------------------------------------------------------

    def load(self, train_state: dict) -> bool:
        """Restore the newest usable checkpoint of the run folder (or checkpoint.load_step); else the
        initial weights of checkpoint.initial_load_path (with initial_load_model_only false, a DCP checkpoint's
        whole state). Returns True when training state was restored."""
        if self.cfg.enable and self.cfg.start_from_scratch:
            own = [s for s in complete_steps(self.run_dir) if lineage_of(step_dir(self.run_dir, s)) == self.lineage]
            if own:  # an elastic restart of this same launch: what it saved since its start is its own to resume
                return self.load_dcp(step_dir(self.run_dir, own[0]), train_state, adopt=True)
            ignored = complete_steps(self.run_dir)
            if ignored:
                logger.info(
                    f"  checkpoint: starting from scratch (checkpoint.start_from_scratch); the run folder's "
                    f"step-{', step-'.join(map(str, ignored))} are not loaded, and saves at their steps replace them"
                )
        elif self.cfg.enable:
            failed: dict[int, str] = {}  # checkpoints whose files verified but DCP could not load
            said: set[int] = set()  # those whose skipping was said
            load_step = self.cfg.load_step
            while path := pick_checkpoint(self.run_dir, load_step, distributed=True, known=failed, said=said):
                refuse_overwriting_newer(self.job, path, read_marker(path))
                try:
                    return self.load_dcp(path, train_state, adopt=True)
                except UnloadableCheckpoint as e:
                    if load_step != -1:  # the one asked for: no other will do
                        raise
                    failed[int(path.name.removeprefix("step-"))] = e.plain
        if self.initial_load_path:
            if self.cfg.initial_load_model_only:
                self.load_initial(Path(self.initial_load_path))
            else:
                whole_state_marker(self.job, Path(self.initial_load_path))
                return self.load_dcp(Path(self.initial_load_path), train_state, adopt=False)
        return False

    def load_dcp(self, path: Path, train_state: dict, *, adopt: bool) -> bool:
        """Load what checkpoint.exclude_from_loading leaves in; `adopt`: a checkpoint of this run folder, whose
        lineage this run continues (a branch from another folder's starts its own)."""
        meta = read_marker(path)
        excluded = excluded_parts(self.cfg, meta)
        self.check_resume(path, meta, excluded)
        state = self.full_state(train_state)
        state = {key: value for key, value in state.items() if key not in excluded}
        available = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        if "rng" in state:  # only the devices the checkpoint has RNG states for
            state["rng"] = {d: t for d, t in state["rng"].items() if f"rng.{d}" in available}
        if "train_state" in state:
            state["train_state"], missing = saved_train_state(state["train_state"], available)
            if "elapsed_s" in missing:
                logger.info(
                    f"  checkpoint: {path.name} records no elapsed time (an older titanlite saved it); "
                    "elapsed_s counts from this start"
                )
            if "kept_grad_norms" in missing:
                logger.info(
                    f"  checkpoint: {path.name} records no skipped-step counts or spike-guard window (an older "
                    "titanlite saved it); they start from empty here"
                )
        dcp_load(state, path)
        self.apply(state)
        if "train_state" in state:
            train_state.update(state["train_state"])
        if adopt:
            self.lineage = meta.get("lineage", "")
        logger.info(f"  checkpoint: {resume_line(path, meta, excluded, self.cfg.exclude_from_loading)}")
        return "train_state" in state

    def check_resume(self, path: Path, meta: dict, excluded: set[str]) -> None:
        """Refuse what would make the saved state wrong; say what else changed since the save."""
        changes = changes_since(path, meta, self.job, self.facts, excluded)
        if changes:
            logger.info(
                f"  resume: changed since {path.name}, in effect from step {meta['step'] + 1}: " + ", ".join(changes)
            )

    def apply(self, state: dict) -> None:
        """Hand loaded values to their owners (DCP filled the tensors in place; this sets the rest). The
        optimizer's and the schedule's settings stay the config's: only their state is the checkpoint's."""
        settings = self.optimizers.settings()
        peak_lrs = self.lr_schedulers.peak_lrs()
        if "model" in state:
            for part in self.model_parts:
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if "optimizer" in state:
            for i, (part, optimizers) in enumerate(zip(self.model_parts, self.optimizers.by_part)):
                part_state = (
                    rename_tied(state["optimizer"], TIED_NAME, TIED_COPY)
                    if i in self.tied_copy_parts
                    else state["optimizer"]
                )
                set_optimizer_state_dict(part, optimizers, part_state, options=OPTIM_OPTIONS)
            self.optimizers.restore_settings(settings)
        if "lr_scheduler" in state:
            self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        self.lr_schedulers.resume(peak_lrs)
        if "dataloader" in state:
            self.loader.load_state_dict(state["dataloader"])
        if "rng" in state:
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and uses_cuda():
                torch.cuda.set_rng_state(state["rng"]["cuda"])

    def load_initial(self, path: Path) -> None:
        """Start from given weights: a DCP checkpoint folder, or a Hugging Face folder (config.json)."""
        load_weights(self.model_parts, path)
        kind = "the Hugging Face folder " if (path / "config.json").is_file() else ""
        logger.info(f"  checkpoint: initial weights from {kind}{path}")


def excluded_parts(cfg, meta: dict) -> set[str]:
    """The parts of a checkpoint a load leaves out: checkpoint.exclude_from_loading's, and all but the model of a
    model-only checkpoint."""
    excluded = set(cfg.exclude_from_loading)
    if meta["model_only"]:
        excluded |= {"optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    return excluded


def changes_since(path: Path, meta: dict, job: JobConfig, facts: dict, excluded: set[str]) -> list[str]:
    """resume_changes against the config a checkpoint was saved under (checkpoints saved without one cannot be
    checked: said once)."""
    if "config" not in meta:
        logger.warning(
            f"  checkpoint: {path} was saved without its config (by an earlier titanlite): changed settings cannot "
            "be checked against it"
        )
        return []
    return resume_changes(meta["config"], meta.get("facts", {}), job, facts, excluded, path.name)


def check_resume(job: JobConfig, facts: dict) -> None:
    """Before launch (`titanlite check`): the checkpoint a run would resume from exists and is complete, resuming
    from it overwrites nothing saved after it, and its config allows this one; its files' checksums are left to the
    workers, who share that work. The same for a whole state that checkpoint.initial_load_path branches from."""
    c = job.checkpoint
    if c.enable and not c.start_from_scratch:
        path = pick_checkpoint(Path(job.job.dump_folder) / job.job.name, c.load_step, contents=False)
        if path is not None:
            meta = read_marker(path)
            refuse_overwriting_newer(job, path, meta)
            changes_since(path, meta, job, facts, excluded_parts(c, meta))
            return
    if not c.initial_load_model_only:
        path = Path(initial_weights_path(job))
        meta = whole_state_marker(job, path)
        changes_since(path, meta, job, facts, excluded_parts(c, meta))


def launch_lineage() -> str:
    """A new lineage: the launcher's id for this job (the same in its elastic restarts), else a random one; rank
    0's on every rank."""
    mine = os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex[:16]
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        mine = box[0]
    return mine


def lineage_of(path: Path) -> str | None:
    """The lineage a checkpoint belongs to: the run that saved it and every run resumed from it in its folder
    share one ("" for those an older titanlite saved); None when its marker cannot be read. Retention deletes
    only its own lineage's checkpoints, and an elastic restart of a start from scratch finds its own."""
    try:
        return str(read_marker(path).get("lineage", ""))
    except (OSError, ValueError):
        return None


def refuse_overwriting_newer(job: JobConfig, path: Path, meta: dict) -> None:
    """A resume that would train steps the run folder already holds checkpoints of (checkpoint.load_step naming an
    older one, or a load that leaves out the step count) would overwrite them and their metrics: refused, naming
    both ways on (the newest, or a branch in a run folder of its own). Newer checkpoints that load_step -1 skipped
    as unusable are not counted: a damaged checkpoint is replaced by design."""
    c, run_dir, loaded = job.checkpoint, path.parent, int(meta["step"])
    excluded = excluded_parts(c, meta)
    start = 0 if "train_state" in excluded else loaded
    newer = sorted(s for s in complete_steps(run_dir) if s > start and (c.load_step != -1 or s <= loaded))
    if not newer:
        return
    if meta["model_only"]:
        why, on, whole = f"{path.name} holds model weights only, so this run would train from step 0", "", ""
    elif start == 0:
        why = "checkpoint.exclude_from_loading leaves out train_state, so this run would train from step 0"
        on, whole = "to go on from the newest, load train_state; ", " --checkpoint.initial_load_model_only false"
    else:
        why = f"checkpoint.load_step={c.load_step} would train on from step {start}"
        on, whole = (
            "to go on from the newest, set checkpoint.load_step = -1; ",
            " --checkpoint.initial_load_model_only false",
        )
    saved = ", ".join(f"step-{s}" for s in newer)
    raise ConfigError(
        f"{why} in {run_dir}, overwriting what the run saved after that ({saved} and its metrics from step "
        f"{start + 1}); {on}to branch from {path.name}, give the branch a run folder of its own: --job.name "
        f"{Path(job.job.name).name}-from-{loaded} --checkpoint.initial_load_path {path}{whole}"
    )


def whole_state_marker(job: JobConfig, path: Path) -> dict:
    """checkpoint.initial_load_model_only = false: the marker of the DCP checkpoint whose whole state a run starts
    from (a branch); refused in one line when there is none to take the whole state of."""
    if not job.checkpoint.initial_load_path:
        raise ConfigError(
            "checkpoint.initial_load_model_only = false starts from a checkpoint's whole state, but "
            "checkpoint.initial_load_path names none; set it to a step-N folder, or drop initial_load_model_only"
        )
    if (path / "config.json").is_file():
        raise ConfigError(
            f"checkpoint.initial_load_model_only = false starts from a DCP checkpoint's whole state, but {path} is a "
            "Hugging Face folder (weights only); set checkpoint.initial_load_model_only = true"
        )
    try:
        meta = read_marker(path)
    except (OSError, ValueError):
        raise ConfigError(
            f"checkpoint.initial_load_path='{path}' is not a complete titanlite checkpoint (its {MARKER} is missing or "
            "damaged), so it has no whole state to start from; name a step-N folder of a run"
        ) from None
    if meta.get("model_only"):
        raise ConfigError(
            f"{path} holds model weights only, so it has no whole state to start from; set "
            "checkpoint.initial_load_model_only = true to start from its weights"
        )
    return meta


# What leaving each part out of a load means, for the line that says what a resume loaded.
LEFT_OUT = {
    "model": "fresh weights",
    "optimizer": "fresh optimizer moments",
    "lr_scheduler": "the LR schedule from its start",
    "dataloader": "the data from its first sample",
    "train_state": "the step count from 0",
    "rng": "a fresh random state",
}


def resume_line(path: Path, meta: dict, excluded: set[str], asked: list[str]) -> str:
    """What a load took from a checkpoint and what it left out, and why (checkpoint.exclude_from_loading's parts,
    or a model-only checkpoint's missing ones)."""
    if meta["model_only"]:
        return f"resumed from {path} (model weights only): the optimizer, LR schedule, data and step count start afresh"
    head = f"resumed from {path} at step {meta['step']}"
    if "train_state" in excluded:
        head = f"loaded {path} (saved at step {meta['step']}), training from step 0"
    loaded = ", ".join(p for p in PARTS if p not in excluded)
    if not asked:
        return f"{head}: loaded {loaded}"
    left = ", ".join(f"{p} ({LEFT_OUT[p]})" for p in PARTS if p in excluded)
    return f"{head}: loaded {loaded}; not loaded (checkpoint.exclude_from_loading): {left}"


class UnloadableCheckpoint(ConfigError):
    """DCP could not load a checkpoint whose files looked whole (one saved without checksums, or of another model)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} cannot be loaded into this run: {reason}")
        self.reason = reason
        # In plain words, for the warning that skips it: its files hashed as saved (or it was saved without
        # checksums, by an earlier titanlite) and DCP still could not read them back.
        self.plain = (
            "DCP could not read its files back; saved without checksums, which file is damaged cannot be told"
            if not (path / CHECKSUMS).is_file()
            else "DCP could not read its files back into this run, though they match their checksums"
        )


def saved_train_state(train_state: dict, available: set[str]) -> tuple[dict, list[str]]:
    """The trainer-state fields a checkpoint holds (DCP refuses to load a key it lacks), and the names of those
    it lacks: fields added after an older titanlite saved it (elapsed_s), which keep this run's defaults."""
    missing = [k for k in train_state if f"train_state.{k}" not in available]
    return {k: v for k, v in train_state.items() if k not in missing}, missing


def dcp_load(state: dict, path: Path) -> None:
    """dcp.load, with its failures (a CheckpointException, which is a BaseException) as one ConfigError line. A
    failure is collective: every rank raises it, so every rank goes on to the same older checkpoint. Tensors it
    filled in part are all filled again by the next load."""
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except CheckpointException as e:
        raise UnloadableCheckpoint(path, checkpoint_failure(e)) from None


def checkpoint_failure(e: CheckpointException) -> str:
    """The first rank's underlying error of a DCP failure, as 'Type: first line'."""
    rank, (inner, _) = min(e.failures.items())
    message = str(inner).strip().splitlines()[0][:300] if str(inner).strip() else ""
    return f"{type(inner).__name__}{': ' + message if message else ''} (rank {rank})"


def load_weights(model_parts: list[nn.Module], path: Path, what: str = "checkpoint.initial_load_path") -> None:
    """Model weights only, from a DCP checkpoint folder (saved on any layout) or a Hugging Face folder,
    into this rank's (possibly sharded or pipelined) model parts."""
    if (path / "config.json").is_file():
        load_hf_into(model_parts, path)
        return
    problem = "it does not exist" if not path.is_dir() else agreed_problem(path, distributed=True)
    if problem:
        raise ConfigError(f"{what}='{path}' cannot be loaded ({problem})")
    state: dict[str, dict] = {"model": {}}
    for part in model_parts:
        state["model"] |= get_model_state_dict(part)
    refuse_unplaced_weights(path, set(state["model"]))
    dcp_load(state, path)
    for part in model_parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))


def refuse_unplaced_weights(path: Path, names: set[str]) -> None:
    """A checkpoint's model tensors that no part of the model being loaded has a place for (dcp.load reads only
    what it is asked for, so they would be left behind without a word: a bias-balanced MoE's routing biases in a
    model built without them) refused in one line. `names`: this rank's parts' tensors; the union over every rank
    of a process group is the whole model's (a pipeline stage holds its own blocks only). Collective."""
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(names))
        names = set().union(*every)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    unplaced = sorted(key.removeprefix("model.") for key in saved if key.startswith("model."))
    unplaced = [key for key in unplaced if key not in names]
    if unplaced:
        more = f" and {len(unplaced) - 1} more" if len(unplaced) > 1 else ""
        raise ConfigError(
            f"{path} holds model tensors that this model has no place for ({unplaced[0]}{more}): it was saved from "
            "another model; set the model.* and moe.* settings it was trained with (its titanlite.json records them)"
        )


def checkpoint_to_load(cfg, purpose: str, contents: bool = True) -> Path:
    """The weights a command reads (`titanlite eval`, `generate`): checkpoint.load_step's checkpoint of the
    run folder, or its newest usable one, else checkpoint.initial_load_path (a DCP or Hugging Face folder).
    Its files' checksums are checked too (`contents`), shared by the ranks of a process group."""
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    path = pick_checkpoint(run_dir, cfg.checkpoint.load_step, distributed=True, contents=contents)
    if path is not None:
        return path
    if initial := initial_weights_path(cfg):
        return Path(initial)
    raise ConfigError(
        f"no checkpoint to {purpose} in {run_dir}; train there with checkpoint.enable, or set "
        "checkpoint.initial_load_path to a DCP checkpoint or Hugging Face folder"
    )


# How a model computes rather than what (the same numbers either way): each command's own choice, never taken from
# the checkpoint's record.
RUNTIME_CHOICES = ("model.attn_backend", "model.linear_attn_backend", "moe.experts_kernel")


def recorded_settings(path: Path) -> dict[str, Any]:
    """The settings that decide the model a titanlite checkpoint holds, from the config it was saved under: every
    model.* key (family, flavor, layers, tokenizer, masks), every moe.* key (the routing's balance: "bias" adds
    the routing biases the weights were trained with) and training.seq_len (RoPE tables, learned positions), but
    RUNTIME_CHOICES. {} for a Hugging Face folder (its config.json says it all) and for a checkpoint saved without
    its config (a seed checkpoint, or one of an earlier titanlite)."""
    if not (path / MARKER).is_file():
        return {}
    saved = read_marker(path).get("config", {})
    model = ("model.", "moe.")
    return {
        key: value
        for key, value in saved.items()
        if (key.startswith(model) or key == "training.seq_len") and key not in RUNTIME_CHOICES
    }


# Besides validation.*, the settings that decide which held-out windows a run's evaluation read and in which batches:
# its corpus (the held-out split is its tail), the window length and the batch validation.local_batch_size 0 takes.
# ... and how its downstream tasks were scored (but which tasks and how often: `eval --tasks` names its own)
EVALUATION_KEYS = (
    *CORPUS_KEYS,
    "training.local_batch_size",
    "training.seq_len",
    "downstream.include_path",
    "downstream.limit",
    "downstream.num_fewshot",
    "downstream.batch_size",
)


def recorded_evaluation(path: Path) -> dict[str, Any]:
    """The settings of a titanlite checkpoint's run that decide what its evaluation measured (validation.* but
    whether and how often, and EVALUATION_KEYS): `titanlite eval` takes them where it is told nothing, so it covers
    the run's windows; {} where no config is recorded."""
    if not (path / MARKER).is_file():
        return export_evaluation(path)  # a titanlite export keeps its run's
    saved = read_marker(path).get("config", {})
    return {
        key: value
        for key, value in saved.items()
        if key in EVALUATION_KEYS
        or (key.startswith("validation.") and key not in ("validation.enable", "validation.freq"))
    }


def parse_run_config(argv: list[str], evaluation: bool = False) -> JobConfig:
    """parse_config(argv) for a command that reads a run's checkpoint (`eval`, `convert to-hf`, `generate`): the
    settings the checkpoint it would read was trained under (recorded_settings) are taken where the command line
    and --config set nothing, so no flag of the training run needs repeating; one that contradicts them is refused
    in one line. `evaluation` (`eval`): the run's evaluation settings too (recorded_evaluation), which the command
    line may change. Which checkpoint that is follows checkpoint_to_load (its warnings are left to the command's
    load). Settings of features that are off are taken as they are (parse_config's `training`): the command
    trains nothing."""
    cfg = parse_config(argv, training=False)
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    quiet = set(complete_steps(run_dir))  # as if already said: the command's own checkpoint_to_load says them
    path = pick_checkpoint(run_dir, cfg.checkpoint.load_step, contents=False, said=quiet)
    if path is None and (initial := initial_weights_path(cfg)):
        path = Path(initial)
    recorded = recorded_settings(path) if path is not None else {}
    measured = recorded_evaluation(path) if path is not None and evaluation else {}
    if not (recorded or measured):
        return cfg
    return parse_config(argv, recorded=(str(path), recorded), defaults=(str(path), measured), training=False)


def process_saver_stager(pinned: bool):
    """How async_with_pinned_mem stages a save before DCP's background process writes it: into host
    buffers that are kept from save to save, pinned on CUDA (fast device-to-host copies), shared with the
    writing process (no pickling of tensors). The copy is made before async_save returns, so training may
    change the weights right after; the writing runs beside the next steps."""
    # Imported here: plan_run refuses async_with_pinned_mem up front on a torch without it (check_async_mode).
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=pinned
        )
    )


def needs_process_group(cfg) -> bool:
    """DCP's process-based saver (async_with_pinned_mem) sets up its writer's process group from the
    trainer's, so even a one-process run gets a (one-rank, gloo) process group."""
    return cfg.checkpoint.enable and cfg.checkpoint.async_mode == "async_with_pinned_mem"


def initial_weights_path(cfg) -> str:
    """Where a run with no checkpoint of its own starts: checkpoint.initial_load_path, else, with
    model.flavor = "hf", the Hugging Face folder model.hf_assets_path; "" for freshly initialised weights."""
    if cfg.checkpoint.initial_load_path:
        return cfg.checkpoint.initial_load_path
    return cfg.model.hf_assets_path if cfg.model.flavor == "hf" else ""


def save_model_only(run_dir: Path, step: int, model_state: dict) -> Path:
    """Write a complete model-only checkpoint from one process (seed checkpoints)."""
    tmp, final = run_dir / f"step-{step}.tmp", step_dir(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": model_state}, checkpoint_id=str(tmp), no_dist=True)
    write_rank_checksums(tmp, 0)
    merge_checksums(tmp, 1)
    (tmp / MARKER).write_text(json.dumps({"step": step, "model_only": True, "world_size": 1}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_model_only(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's model weights into a plain model in one process (exports)."""
    state = {"model": get_model_state_dict(model)}
    refuse_unplaced_weights(path, set(state["model"]))
    dcp_load(state, path)
    set_model_state_dict(model, state["model"])


def rename_tied(state: dict, old: str, new: str) -> dict:
    """Flattened optimizer state with parameter name `old` replaced by `new` in every key."""
    renamed = {}
    for key, value in state.items():
        for prefix in ("state.", "param_groups."):
            if key.startswith(prefix + old + "."):
                key = prefix + new + key[len(prefix + old) :]
        renamed[key] = value
    return renamed
