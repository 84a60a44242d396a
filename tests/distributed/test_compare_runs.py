"""`titanlite compare` on a real run and its FSDP x 2 twin: the same losses to 1e-5, and the PNG."""

import pytest

from tests.helpers import TINY, train_in_pool
from titanlite.commands.cli import main


@pytest.mark.slow
@pytest.mark.distributed
def test_compare_finds_an_fsdp_twin_within_1e5_of_its_single_process_run(tmp_path, capsys):
    single, twin = tmp_path / "single", tmp_path / "fsdp2"
    for folder, nproc, local_batch in ((single, 1, "8"), (twin, 2, "4")):  # the same global batch of 8
        proc = train_in_pool(nproc, [*TINY, "--training.local_batch_size", local_batch], folder)
        assert proc.returncode == 0, proc.stderr[-3000:]
    capsys.readouterr()
    png = tmp_path / "compare.png"
    args = ["compare", str(single / "run"), str(twin / "run"), "--output", str(png)]
    assert main([*args, "--metrics", "loss", "--max-diff", "1e-5"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  loss "))
    assert row[1:3] == ["5", "(1..5)"] and float(row[3]) < 1e-5
    assert png.stat().st_size > 0
