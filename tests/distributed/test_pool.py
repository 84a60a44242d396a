"""The pool of gloo ranks that the parity tests run in (tests/pool.py): a body that fails, dies or hangs on one rank
fails its own test with that rank's traceback (or stack) within its timeout, the next body gets a fresh pool, and
a training run in the pool gives a torchrun launch's losses, grad norms and validation losses bit for bit."""

import os
import time

import pytest

from tests.helpers import VALIDATED, metrics, train_in_pool
from tests.pool import PoolFailure, RankPool

pytestmark = pytest.mark.distributed


def rank() -> int:
    return int(os.environ["RANK"])


def sum_of_ranks() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([rank()])
    dist.all_reduce(total)
    return int(total)


def raise_on_rank_1() -> None:
    if rank() == 1:
        raise ValueError("planted on rank 1")


def die_on_rank_1() -> None:
    if rank() == 1:
        os._exit(7)


def hang_on_rank_1() -> None:
    if rank() == 1:
        time.sleep(3600)


@pytest.fixture(scope="module")
def bare_pool():
    """Two ranks of our own (not the shared pool the parity tests use), importing no body module of their own."""
    pool = RankPool(2, preload=None)
    yield pool
    pool.close()


def test_a_body_runs_on_every_rank_with_a_process_group(bare_pool):
    ran = bare_pool.run(sum_of_ranks)
    assert ran.values == [1, 1]
    assert bare_pool.run(sum_of_ranks).values == [1, 1]  # a second group in the same processes


def test_an_exception_on_one_rank_fails_with_its_traceback_and_the_pool_restarts(bare_pool):
    starts = bare_pool.starts
    with pytest.raises(PoolFailure) as failure:
        bare_pool.run(raise_on_rank_1)
    message = str(failure.value)
    assert "--- rank 1: ValueError: planted on rank 1" in message and "in raise_on_rank_1" in message
    assert "--- rank 0" not in message
    assert bare_pool.run(sum_of_ranks).values == [1, 1] and bare_pool.starts == starts + 1


def test_a_rank_that_dies_fails_the_test_and_the_pool_restarts(bare_pool):
    starts = bare_pool.starts
    with pytest.raises(PoolFailure, match=r"--- rank 1: rank 1 died \(exit code 7\)"):
        bare_pool.run(die_on_rank_1)
    assert bare_pool.run(sum_of_ranks).values == [1, 1] and bare_pool.starts == starts + 1


def test_a_hung_rank_fails_within_the_timeout_with_its_stack(bare_pool):
    began = time.monotonic()
    with pytest.raises(PoolFailure) as failure:
        bare_pool.run(hang_on_rank_1, timeout=3)
    assert time.monotonic() - began < 3 + 10
    message = str(failure.value)
    assert "rank(s) [1] did not finish within the timeout" in message
    assert "in hang_on_rank_1" in message  # the stack faulthandler dumped
    assert bare_pool.run(sum_of_ranks).values == [1, 1]


@pytest.mark.slow  # CI runs it (the launch is test_data_parallel.py's, in the default suite)
def test_a_run_in_the_pool_equals_a_torchrun_launch_bit_for_bit(tmp_path, zero3_launch):
    """FSDP x 2 (ZeRO-3): the trainer in processes that ran other tests' bodies before gives what the fresh workers of
    `NGPU=2 ./run_train.sh` (torchrun's) give; the launch is the one test_data_parallel.py compares with one process."""
    launched, launched_dir = zero3_launch
    pooled = train_in_pool(2, [*VALIDATED, "--training.local_batch_size", "4"], tmp_path)
    workers = launched.stdout.splitlines()  # check's lines first, then the workers' from their banner on
    banners = [i for i, line in enumerate(workers) if line.startswith("titanlite: run ")]
    assert banners, f"no 'titanlite: run' banner in the launch's output:\n{launched.stdout[-3000:]}"
    start = banners[0]
    assert pooled.stdout.splitlines()[:3] == workers[start : start + 3]  # the start-up lines
    figures = ("step", "loss", "grad_norm", "lr", "val_loss", "val_perplexity", "val_tokens")  # not the timings
    pooled_figures = [{k: r[k] for k in figures if k in r} for r in metrics(tmp_path)]
    assert pooled_figures == [{k: r[k] for k in figures if k in r} for r in metrics(launched_dir)]
    assert sum("val_loss" in r for r in pooled_figures) == 3
