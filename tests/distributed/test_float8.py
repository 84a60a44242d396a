"""Float8 training (torchao) on the CPU: it runs under FSDP and TP, its losses track float32 within 1 %,
and without torchao the run is refused before it starts."""

import pytest

from tests.helpers import TINY, assert_close, metrics, run_train_sh, train_in_pool

pytestmark = pytest.mark.distributed

TEN_STEPS = [*TINY, "--training.steps", "10"]
FLOAT8 = ["--float8.enable", "true"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32")
    proc = train_in_pool(1, [*TEN_STEPS, "--training.local_batch_size", "8"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["loss"] for r in metrics(run_dir)]


@pytest.mark.parametrize(
    "layout, args, expect",
    [
        # Tensorwise under FSDP all-gathers the weights in float8 and precomputes their scales each step.
        ("fsdp2", ["--training.local_batch_size", "4"], "(tensorwise, FSDP all-gathers weights in float8)"),
        pytest.param(
            "tp2",
            ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"],
            "(tensorwise)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "tp2_rowwise",
            [
                "--training.local_batch_size",
                "8",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--float8.recipe",
                "rowwise",
            ],
            "(rowwise)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "cp2",
            ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"],
            "(tensorwise, FSDP all-gathers weights in float8)",  # FSDP shards over the cp ranks
            marks=pytest.mark.slow,
        ),
    ],
)
def test_float8_tracks_float32(tmp_path, fp32, layout, args, expect):
    proc = train_in_pool(2, [*TEN_STEPS, *args, *FLOAT8], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # 4 blocks x 6 linear layers; the output projection stays in high precision.
    assert f"float8: 24 linear layers in float8 {expect}" in proc.stdout
    assert "float8 on the CPU runs for correctness only and gives no speed-up" in proc.stdout
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 10
    assert losses != fp32  # float8 really ran: its rounding shows in the losses
    assert_close(losses, fp32, 0.01)


def test_float8_without_torchao_is_refused_up_front(tmp_path):
    # A sitecustomize that makes `import torchao` fail as if it were not installed.
    hide = tmp_path / "hide_torchao"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
    proc = run_train_sh([*TINY, *FLOAT8], tmp_path, ngpu=2, PYTHONPATH=str(hide))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "titanlite: error: float8.enable needs torchao, which is not installed; pip install '.[float8]' "
        "(or pip install torchao) in the environment that runs titanlite, or set float8.enable = false"
    ]
    assert not (tmp_path / "run").exists()  # refused before any worker started
