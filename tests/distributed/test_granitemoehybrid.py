"""Granite 4.0 H on real layouts (gloo, fp32, block-causal short documents, so every window crosses documents and
documents cross the ranks' chunks): its debug model (Mamba-2 and attention layers, each with 8 experts beside a
shared MLP, Granite's multipliers) gives one process's losses, grad norms and validation losses on TP x 2 (the Mamba
layers split by heads and groups: projections, convolution, A_log, D, dt_bias, the gated norm's slices; attention by
heads; the mixtures of experts whole on every rank), FSDP x 2 and CP x 2 (the Mamba layers' chunk states and
convolution halos handed between the ranks, the attention's keys gathered), EP x 2 (the experts split over dp_shard
2) and TP x 2 with the experts split over it (ETP 2), expert loads and load-balancing terms included; PP x 2 those of
one process accumulating the same micro-batches. TP x 2 runs in the default suite, the others are slow."""

import pytest

from tests.distributed.test_context_parallel import (
    cp,
    short_documents,  # noqa: F401 (the fixture `documents` asks for)
)
from tests.distributed.test_expert_parallel import EP2, assert_same_run
from tests.distributed.test_expert_parallel import LAYOUTS as EP_LAYOUTS
from tests.distributed.test_model_families import LAYOUTS
from tests.helpers import metrics, train_in_pool

pytestmark = pytest.mark.distributed

CONFIG = ["--config", "train_configs/granitemoehybrid_debug.toml"]
ONE = ["--training.local_batch_size", "8"]  # the global batch of 8 on one process
GRANITE_LAYOUTS = {"tp2": LAYOUTS["tp2"], "fsdp2": LAYOUTS["fsdp2"], "cp2": (2, cp(2)), "ep2": EP2,
                   "tp2_etp2": EP_LAYOUTS["tp2_etp2"]}  # fmt: skip


@pytest.fixture(scope="module")
def whole(one_process, short_documents) -> list[dict]:  # noqa: F811
    """One process over the global batch of 8, block-causal short documents (once per pytest run)."""
    return one_process([*CONFIG, *short_documents, *ONE])


@pytest.mark.parametrize(
    "layout",
    ["tp2", *(pytest.param(layout, marks=pytest.mark.slow) for layout in ("fsdp2", "cp2", "ep2", "tp2_etp2"))],
)
def test_granitemoehybrid_on_a_layout_matches_one_process(tmp_path, whole, short_documents, layout):  # noqa: F811
    nproc, args = GRANITE_LAYOUTS[layout]
    proc = train_in_pool(nproc, [*CONFIG, *short_documents, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "model granitemoehybrid debug" in proc.stdout
    assert_same_run(metrics(tmp_path), whole)  # expert loads and load-balancing terms too


@pytest.mark.slow
def test_granitemoehybrid_on_pp2_matches_one_process_with_the_same_micro_batches(
    tmp_path,
    one_process,
    short_documents,  # noqa: F811
):
    """PP x 2: each pipeline micro-batch (one sequence) forms its own pooled load-balancing term, so the reference is
    one process accumulating the same micro-batches (tests/distributed/test_moe_pipeline.py): losses, grad norms,
    validation losses, expert loads and load-balancing terms."""
    micro = ["--training.local_batch_size", "1", "--training.global_batch_size", "8"]
    reference = one_process([*CONFIG, *short_documents, *micro])
    nproc, args = LAYOUTS["pp2"]
    proc = train_in_pool(nproc, [*CONFIG, *short_documents, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert_same_run(metrics(tmp_path), reference)
