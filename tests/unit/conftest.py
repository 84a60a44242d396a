"""Fixtures the unit tests share."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def tp_mesh():
    """A tensor-parallel mesh of 2 ranks on the fake process group, this process rank 0: placements and plans
    without other processes."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dist.destroy_process_group()
