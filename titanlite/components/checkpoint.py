"""Sharded DCP checkpoints: atomic, verified before loading, resumable on any layout, optionally async.

A checkpoint is written to step-<N>.tmp/ and renamed to step-<N>/ only once every rank's data, DCP's
metadata and our titanlite.json are on disk, so a folder named step-<N> is complete by construction.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlite.base.devices import uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.components.hf_weights import load_hf_into
from titanlite.config import Checkpoint as CheckpointConfig

# In one process DCP warns, at every save and load, that it assumes one process: that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MARKER = "titanlite.json"
OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# Under pipeline parallelism the last stage holds a tied embedding's copy as output.weight; its
# optimizer state is saved and loaded under the embedding's name, the name it has without PP.
TIED_COPY, TIED_NAME = "output.weight", "tok_embeddings.weight"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step}"


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete (renamed) checkpoint folder, newest first."""
    steps = []
    for path in run_dir.glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps, reverse=True)


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded, or None when every file it needs is there in full."""
    try:
        json.loads((path / MARKER).read_text())
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing or unreadable marker or .metadata: the folder is not usable
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'}"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < size:
            return f"{name} is truncated ({file.stat().st_size} of {size} bytes)"
    return None


class Checkpointer:
    """Saves and restores everything an exact continuation needs: model, optimizer, LR schedule, data
    position, step and token count, and the RNG state."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        model_parts: list[nn.Module],
        optimizers,
        lr_schedulers,
        loader,
        *,
        tied_copy_parts: set[int],
        final_step: int,
        initial_load_path: str = "",
        say=print,
    ):
        self.cfg, self.run_dir = cfg, run_dir
        self.initial_load_path = initial_load_path or cfg.initial_load_path
        self.model_parts, self.optimizers, self.lr_schedulers, self.loader = (
            model_parts,
            optimizers,
            lr_schedulers,
            loader,
        )
        self.tied_copy_parts = tied_copy_parts  # indices of parts holding a tied embedding's copy (PP last stage)
        self.final_step = final_step
        self.say = say
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending = None  # (future, step) of an async save in flight
        self.saved_step = -1
        self.mode = cfg.async_mode if cfg.enable else "disabled"
        # A background save must not share a process group with training collectives (gloo mixes them up).
        self.async_group = dist.new_group(backend="gloo") if self.mode != "disabled" and dist.is_initialized() else None
        self.stager = None
        if self.mode == "async_with_pinned_mem":
            self.stager = process_saver_stager(pinned=uses_cuda())
            where = "pinned" if uses_cuda() else "shared (pinned memory needs CUDA)"
            say(
                f"  checkpoint: async_with_pinned_mem: each save is copied to {where} host memory, then written "
                "by a background process"
            )

    # ---- what is saved -----------------------------------------------------------------------

    def model_state(self) -> dict:
        state = {}
        for part in self.model_parts:
            state |= get_model_state_dict(part)
        return state

    def optimizer_state(self) -> dict:
        state = {}
        for i, (part, optimizer) in enumerate(zip(self.model_parts, self.optimizers.optimizers)):
            part_state = get_optimizer_state_dict(part, optimizer, options=OPTIM_OPTIONS)
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

    def maybe_save(self, step: int, train_state: dict, force: bool = False) -> None:
        """Save on the interval, always at the final step (training.steps or stop_after_step), and when
        forced (preemption); a step already saved is not saved again."""
        if not self.cfg.enable:
            return
        last = step == self.final_step or force
        if force and self.saved_step == step:
            self.wait()
            return
        if step % self.cfg.interval and not last:
            self.poll()
            return
        if last and self.cfg.model_only:
            dtype = getattr(torch, self.cfg.export_dtype)
            self.save(step, {"model": {k: v.to(dtype) for k, v in self.model_state().items()}}, model_only=True)
        else:
            self.save(step, self.full_state(train_state), model_only=False)
        if last:
            self.wait()

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
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        }
        start = time.perf_counter()
        if self.mode == "disabled":
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
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
            future = getattr(response, "upload_completion", response)
            self.pending = (future, tmp, final, meta, start)

    def poll(self) -> None:
        """Finish an async save that has completed, without waiting for one that has not."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, meta, start = self.pending
        self.pending = None
        future.result()
        self.finalize(tmp, final, meta, time.perf_counter() - start)

    def finalize(self, tmp: Path, final: Path, meta: dict, seconds: float) -> None:
        """Mark the checkpoint complete (marker, then an atomic rename) and apply the retention policy.

        DCP's save returns on the coordinator only after every rank's data and the metadata are
        written, so rank 0 may mark it complete then."""
        if self.rank != 0:
            return
        (tmp / MARKER).write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.say(f"  checkpoint: saved {final} in {seconds:.1f}s")
        self.apply_retention()

    def apply_retention(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for step in complete_steps(self.run_dir)[k:]:
            shutil.rmtree(step_dir(self.run_dir, step), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()  # frees the pinned (or shared) staging buffers
            self.stager = None
            stop_process_saver()

    # ---- loading -----------------------------------------------------------------------------

    def load(self, train_state: dict) -> bool:
        """Restore the newest usable checkpoint of the run folder (or checkpoint.load_step); else the
        initial weights of checkpoint.initial_load_path. Returns True when training state was restored."""
        if self.cfg.enable:
            path = self.pick_checkpoint()
            if path is not None:
                return self.load_dcp(path, train_state)
        if self.initial_load_path:
            self.load_initial(Path(self.initial_load_path))
        return False

    def pick_checkpoint(self) -> Path | None:
        return pick_checkpoint(self.run_dir, self.cfg.load_step, self.say)

    def load_dcp(self, path: Path, train_state: dict) -> bool:
        meta = json.loads((path / MARKER).read_text())
        excluded = set(self.cfg.exclude_from_loading)
        if meta["model_only"]:
            excluded |= {"optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
        state = self.full_state(train_state)
        state = {key: value for key, value in state.items() if key not in excluded}
        available = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        if "rng" in state:  # only the devices the checkpoint has RNG states for
            state["rng"] = {d: t for d, t in state["rng"].items() if f"rng.{d}" in available}
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        self.apply(state)
        if "train_state" in state:
            train_state.update(state["train_state"])
        self.say(
            f"  checkpoint: resumed from {path}"
            + (" (model weights only)" if meta["model_only"] else f" at step {meta['step']}")
        )
        return "train_state" in state

    def apply(self, state: dict) -> None:
        """Hand loaded values to their owners (DCP filled the tensors in place; this sets the rest)."""
        if "model" in state:
            for part in self.model_parts:
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        if "optimizer" in state:
            for i, (part, optimizer) in enumerate(zip(self.model_parts, self.optimizers.optimizers)):
                part_state = (
                    rename_tied(state["optimizer"], TIED_NAME, TIED_COPY)
                    if i in self.tied_copy_parts
                    else state["optimizer"]
                )
                set_optimizer_state_dict(part, optimizer, part_state, options=OPTIM_OPTIONS)
        if "lr_scheduler" in state:
            self.lr_schedulers.load_state_dict(state["lr_scheduler"])
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
        self.say(f"  checkpoint: initial weights from {kind}{path}")


def load_weights(model_parts: list[nn.Module], path: Path, what: str = "checkpoint.initial_load_path") -> None:
    """Model weights only, from a DCP checkpoint folder (saved on any layout) or a Hugging Face folder,
    into this rank's (possibly sharded or pipelined) model parts."""
    if (path / "config.json").is_file():
        load_hf_into(model_parts, path)
        return
    problem = "it does not exist" if not path.is_dir() else verify(path)
    if problem:
        raise ConfigError(f"{what}='{path}' cannot be loaded ({problem})")
    state = {"model": {}}
    for part in model_parts:
        state["model"] |= get_model_state_dict(part)
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    for part in model_parts:
        set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))


def pick_checkpoint(run_dir: Path, load_step: int, say=print) -> Path | None:
    """checkpoint.load_step's folder (an error if it is not usable), or the newest usable one, skipping
    (with a warning naming it) any whose files are missing or truncated; None when there is none."""
    steps = complete_steps(run_dir)
    if load_step != -1:
        path = step_dir(run_dir, load_step)
        problem = "it does not exist" if load_step not in steps else verify(path)
        if problem:
            raise ConfigError(f"checkpoint.load_step={load_step}: cannot load {path} ({problem})")
        return path
    for step in steps:
        path = step_dir(run_dir, step)
        problem = verify(path)
        if problem is None:
            return path
        say(f"  checkpoint: WARNING skipping {path}: {problem}")
    return None


def checkpoint_to_load(cfg, purpose: str) -> Path:
    """The weights a command reads (`titanlite eval`, `generate`): checkpoint.load_step's checkpoint of the
    run folder, or its newest usable one, else checkpoint.initial_load_path (a DCP or Hugging Face folder)."""
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    path = pick_checkpoint(run_dir, cfg.checkpoint.load_step)
    if path is not None:
        return path
    if initial := initial_weights_path(cfg):
        return Path(initial)
    raise ConfigError(
        f"no checkpoint to {purpose} in {run_dir}; train there with checkpoint.enable, or set "
        "checkpoint.initial_load_path to a DCP checkpoint or Hugging Face folder"
    )


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


def stop_process_saver() -> None:
    """End DCP's writing process. DCP keeps it for the trainer's lifetime and ends it only in a finaliser,
    which titanlite's exit skips (os._exit, titanlite/commands/worker.py's shutdown): left alone, it would notice its
    parent gone and die with a traceback. Private names: if a torch version moves them, nothing is done."""
    # Imported here: a private module, which a torch version may move (then nothing is done).
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = getattr(executor, "_CHECKPOINT_PROCESS", None)
    send, child = getattr(process, "_send", None), getattr(process, "_save_process", None)
    if send is None or child is None or not child.is_alive():
        return
    send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
    child.join(timeout=30)
    if child.is_alive():
        child.terminate()
    executor._CHECKPOINT_PROCESS = None


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
    (tmp / MARKER).write_text(json.dumps({"step": step, "model_only": True, "world_size": 1}))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_model_only(path: Path, model: nn.Module) -> None:
    """Load a checkpoint's model weights into a plain model in one process (exports)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
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
