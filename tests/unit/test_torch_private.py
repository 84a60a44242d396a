"""The torch internals titanlite/components/torch_private.py reads (no public way exists) are where it reads them in
the installed torch: a release that renames one fails here, not silently at the end of a run."""

import inspect
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlite.components import torch_private
from titanlite.components.torch_private import (
    flatten_mesh,
    pipeline_schedule_from_csv,
    set_every_group_timeout,
    set_last_lrs,
    stager_closed,
    stop_process_saver,
)

REPO = Path(__file__).resolve().parents[2]


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


def test_every_process_group_takes_the_timeout(tmp_path):
    c10d = dist.distributed_c10d
    assert hasattr(c10d, "_world") and hasattr(c10d._world, "pg_map"), "distributed_c10d._world.pg_map is gone"
    assert "group" in inspect.signature(c10d._set_pg_timeout).parameters, "distributed_c10d._set_pg_timeout changed"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        own = dist.new_group(backend="gloo")  # as the stop signal's and the checkpoint saver's groups are made
        groups = list(c10d._world.pg_map)
        assert c10d._get_default_group() in groups and own in groups
        set_every_group_timeout(timedelta(seconds=7))
        # (the gloo backend's options hold the timeout each collective of the group takes)
        assert [g._get_backend(torch.device("cpu")).options._timeout for g in groups] == [timedelta(seconds=7)] * 2
    finally:
        dist.destroy_process_group()


def test_set_last_lrs_is_what_the_schedule_reports_and_saves():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert "_last_lr" in vars(scheduler), "LRScheduler no longer keeps its last LRs in _last_lr"
    set_last_lrs(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25] and scheduler.state_dict()["_last_lr"] == [0.25]


def test_flatten_mesh_makes_one_dimension_of_several():
    assert hasattr(torch.distributed.device_mesh.DeviceMesh, "_flatten"), "DeviceMesh._flatten is gone"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        flat = flatten_mesh(root[("a", "b")], "ab")
        assert flat.mesh_dim_names == ("ab",) and flat.mesh.tolist() == [0, 1, 2, 3]
    finally:
        dist.destroy_process_group()


def test_a_csv_schedule_loads_and_gains_its_communication():
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    assert runtime is not None, "torch.distributed.pipelining.schedules._PipelineScheduleRuntime is gone"
    assert issubclass(runtime, schedules.PipelineScheduleMulti)
    assert "filename" in inspect.signature(runtime._load_csv).parameters, "_PipelineScheduleRuntime._load_csv changed"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cpu = torch.device("cpu")
        stages = [PipelineStage(nn.Linear(4, 4), i, 4, cpu, group=dist.group.WORLD) for i in (0, 2)]  # pp rank 0's
        csv = REPO / "train_configs/schedules/looped_gpipe_pp2_v2_m4.csv"
        schedule = pipeline_schedule_from_csv(stages, 4, lambda out, target: out.sum(), scale_grads=True, path=str(csv))
        actions = [str(a) for a in schedule.pipeline_order_with_comms[0]]
        assert actions[actions.index("0F0") + 1] == "0SEND_F0"  # the file's compute, and the sends torch added
    finally:
        dist.destroy_process_group()
