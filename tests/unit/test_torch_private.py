"""The torch internals titanlite/components/torch_private.py reads (no public way exists) are where it reads them in
the installed torch: a release that renames one fails here, not silently at the end of a run."""

import inspect
from types import SimpleNamespace

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from titanlite.components import torch_private
from titanlite.components.torch_private import stager_closed, stop_process_saver


def test_dcp_keeps_its_writing_process_where_stop_process_saver_looks():
    executor = torch_private.dcp_process
    assert executor is not None, "torch.distributed.checkpoint._async_process_executor is gone"
    assert hasattr(executor, "_CHECKPOINT_PROCESS"), "DCP no longer keeps its process in _CHECKPOINT_PROCESS"
    # The process-based executor is what sets that global (async_save with AsyncCheckpointerType.PROCESS).
    save = inspect.getsource(executor._ProcessBasedAsyncCheckpointExecutor._execute_save_impl)
    assert "global _CHECKPOINT_PROCESS" in save
    process = executor._AsyncCheckpointProcess
    assert callable(process._send)
    assert "_save_process" in process.__init__.__code__.co_names  # the multiprocessing.Process, set in __init__
    assert executor._CheckpointSaveProcessControlOpts.TERMINATE.value == "terminate"


class FakeChild:
    def __init__(self, stays_alive: bool) -> None:
        self.alive, self.stays_alive, self.calls = True, stays_alive, []

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float) -> None:
        self.calls.append(("join", timeout))
        self.alive = self.stays_alive

    def terminate(self) -> None:
        self.calls.append(("terminate",))
        self.alive = False


def test_stop_process_saver_asks_the_process_to_end_then_forgets_it(monkeypatch):
    executor = torch_private.dcp_process
    for stays_alive, calls in ((False, [("join", 30)]), (True, [("join", 30), ("terminate",)])):
        sent: list = []
        child = FakeChild(stays_alive)
        monkeypatch.setattr(executor, "_CHECKPOINT_PROCESS", SimpleNamespace(_send=sent.append, _save_process=child))
        stop_process_saver()
        assert sent == [executor._CheckpointSaveProcessControlOpts.TERMINATE]
        assert child.calls == calls and not child.alive
        assert executor._CHECKPOINT_PROCESS is None
    stop_process_saver()  # none running: nothing to do


def test_a_default_stager_reads_as_closed_once_closed():
    options = StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
    )
    stager = DefaultStager(options)
    assert not stager_closed(stager), "DefaultStager._state_dict_stager._deepcopy_dispatch is gone"
    assert torch.equal(stager.stage({"w": torch.arange(3.0)})["w"], torch.arange(3.0))
    assert not stager_closed(stager)
    stager.close()
    assert stager_closed(stager)
