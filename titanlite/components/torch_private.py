"""The torch internals titanlite reaches into where torch has no public way, kept in this one module, each function
saying why there is none: DCP's process-based saver (ending its writing process, telling whether DCP closed a
DefaultStager), every process group's timeout, a learning-rate schedule's last LRs, flattening DeviceMesh dimensions
into one, and a pipeline schedule read from CSV. tests/unit/test_torch_private.py checks every name against the
installed torch, so a release that renames one fails that test rather than passing unnoticed or failing a run."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:  # for the hints only: torch.distributed.pipelining imports torch._dynamo (seconds)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

# DCP's process-based saver keeps its writing process in this module's global _CHECKPOINT_PROCESS. No public
# module re-exports it; a torch that moves it leaves None here, and stop_process_saver then does nothing.
dcp_process: ModuleType | None
try:
    from torch.distributed.checkpoint import _async_process_executor as dcp_process
except ImportError:
    dcp_process = None

PROCESS_JOIN_SECONDS = 30  # how long the writing process gets to finish a save in flight before it is terminated


def stop_process_saver() -> None:
    """End DCP's writing process (dcp.async_save with AsyncCheckpointerType.PROCESS). DCP keeps it for the
    trainer's lifetime and ends it only in a finaliser, which titanlite's exit skips (os._exit,
    titanlite/commands/worker.py's shutdown): left alone, it would notice its parent gone and die with a traceback.
    torch has no public call for this. Reads torch's private names:
    _async_process_executor._CHECKPOINT_PROCESS (the process object, or None before the first save), its _send
    (the control pipe) and _save_process (the multiprocessing.Process), and
    _CheckpointSaveProcessControlOpts.TERMINATE (the message it stops on). Where one is missing, nothing is done."""
    if dcp_process is None:
        return
    process = getattr(dcp_process, "_CHECKPOINT_PROCESS", None)
    send, child = getattr(process, "_send", None), getattr(process, "_save_process", None)
    opts = getattr(dcp_process, "_CheckpointSaveProcessControlOpts", None)
    if send is None or child is None or opts is None or not child.is_alive():
        return
    send(opts.TERMINATE)
    child.join(timeout=PROCESS_JOIN_SECONDS)
    if child.is_alive():
        child.terminate()
    dcp_process._CHECKPOINT_PROCESS = None  # type: ignore[attr-defined]  # typed as a ModuleType, whose names are unknown


def stager_closed(stager) -> bool:
    """Whether DCP closed `stager` (a torch.distributed.checkpoint.staging.DefaultStager) while staging. Some torch
    releases (2.11 among them) close a DefaultStager's inner stager at the end of every stage, which empties its copy
    table: the next save then fails inside async_save with "KeyError: <class 'type'>", so the checkpointer replaces
    such a stager before the next save (its pinned buffers were released by that close anyway). It has no public
    "closed" state; this reads its private _state_dict_stager (the inner StateDictStager) and that one's
    _deepcopy_dispatch (the copy table, which its close() clears). Where a torch version lacks them, the stager
    counts as closed, and replacing it is always safe."""
    inner = getattr(stager, "_state_dict_stager", None)
    return not getattr(inner, "_deepcopy_dispatch", None)


def set_every_group_timeout(timeout: timedelta) -> None:
    """Make every process group this process holds (the default one, each DeviceMesh dimension's and flattened view's,
    and those torch.distributed.new_group made, such as the stop signal's) fail a collective that waits longer than
    `timeout`. torch lists a process's groups nowhere public: they are the keys of its private
    torch.distributed.distributed_c10d._world.pg_map. Each takes the timeout through the private
    distributed_c10d._set_pg_timeout, which sets it on the group's gloo or NCCL backends (a group with neither only
    warns); its public successor, torch.distributed.set_timeout, comes after 2.13."""
    c10d = dist.distributed_c10d
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timeout, group)


def set_last_lrs(scheduler: LRScheduler, lrs: list[float | torch.Tensor]) -> None:
    """Make `scheduler.get_last_lr()` (and its state_dict) report `lrs`, the LRs just set on its optimizer's groups
    outside a step (a resumed run's schedule with this run's peak LRs: titanlite/components/optim.py's
    LRSchedulers.resume). An LRScheduler recomputes its last LRs only inside step(), which would also advance its
    step count; it keeps them in its private _last_lr, which has no setter."""
    scheduler._last_lr = lrs


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh` (a slice of a root mesh, such as root[("dp_shard", "cp")]) as one dimension named `name`: a view of the
    root mesh over the same ranks, which DTensor finds by its ranks for a reduction over them. torch has this only as
    DeviceMesh's private _flatten: a DeviceMesh built anew from the same ranks would be a root of its own, with
    process groups of its own, not a view of the root."""
    return mesh._flatten(name)


def pipeline_schedule_from_csv(
    stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, scale_grads: bool, path: str
) -> PipelineScheduleMulti:
    """The pipeline schedule a CSV file writes out (one row of actions per pp rank, compute only: torch adds the
    sends and receives), over this rank's `stages`. torch runs such a file only through its private
    torch.distributed.pipelining.schedules._PipelineScheduleRuntime and that class's _load_csv; no public schedule
    takes one."""
    # start-up time: torch.distributed.pipelining imports torch._dynamo (seconds); only a pipelined run needs it
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule._load_csv(path)
    return schedule
