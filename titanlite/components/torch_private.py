"""The torch internals titanlite reaches into where torch has no public way, kept in this one module: DCP's
process-based saver (async_with_pinned_mem) leaves two things without an API, ending its writing process and telling
whether DCP closed a DefaultStager. Each reads its names defensively (a torch that moved one gets the safe
fallback), and tests/unit/test_torch_private.py checks every name against the installed torch, so a release that
renames one fails that test rather than passing unnoticed."""

from __future__ import annotations

from types import ModuleType

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
