"""A model family defined entirely under tests/ (tests/families/relu2: its spec, module and TP plan, registered
through model.custom_import) trains on FSDP x 2 and TP x 2 with one process's losses, also across a resume from
its checkpoint, and `titanlite plan` estimates it: adding a family needs no edit in titanlite/. Its debug_aux
flavor adds an auxiliary loss term, which FSDP x 2 adds, reduces and logs as one process does; its hybrid flavor
mixes a mixer kind of its own with attention per layer on the shared decoder, on FSDP, TP and PP."""

import subprocess
import sys

import pytest

from tests.distributed.test_model_families import LAYOUTS as FAMILY_LAYOUTS
from tests.helpers import REPO, TINY, assert_matches, env, metrics, train_in_pool

pytestmark = pytest.mark.distributed

FAMILY = ["--model.custom_import", "tests.families.relu2", "--model.name", "relu2", "--model.flavor", "debug"]
LAYOUTS = {"single": (1, ["--training.local_batch_size", "8"]), **FAMILY_LAYOUTS}
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
LAYOUTS["pp2"] = (2, ["--training.local_batch_size", "8", "--parallelism.data_parallel_shard_degree", "1", *PP2])


def run(layout: str, run_dir, *extra: str):
    nproc, args = LAYOUTS[layout]
    proc = train_in_pool(nproc, [*FAMILY, *TINY, *args, *extra], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    flavor = extra[extra.index("--model.flavor") + 1] if "--model.flavor" in extra else "debug"
    assert f"model relu2 {flavor}" in proc.stdout, proc.stdout[-2000:]
    return proc


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("relu2_single")
    run("single", run_dir)
    return metrics(run_dir)


@pytest.mark.slow  # five runs: CI runs it; the plan test below stays in the default suite
def test_a_family_defined_outside_titanlite_trains_on_fsdp_and_tp_and_resumes(tmp_path, single):
    run("fsdp2", tmp_path / "fsdp2", "--checkpoint.enable", "--training.stop_after_step", "3")
    proc = run("fsdp2", tmp_path / "fsdp2", "--checkpoint.enable")
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed = metrics(tmp_path / "fsdp2")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert_matches(resumed, single)
    run("tp2", tmp_path / "tp2")
    assert_matches(metrics(tmp_path / "tp2"), single)


@pytest.mark.slow  # three runs (about 25 s): CI runs it; the terms' unit tests (test_auxiliary, test_qwen3_moe) stay
def test_auxiliary_loss_terms_are_added_reduced_and_logged_like_the_loss(tmp_path):
    # relu2's debug_aux flavor adds act_l2 * mean(h^2) per block: FSDP x 2 and PP x 2 (each stage adds its blocks'
    # terms, with no loss of its own) must give one process's losses and terms.
    aux = ["--model.flavor", "debug_aux"]
    proc = run("single", tmp_path / "single", *aux)
    assert " aux_act_l2 " in proc.stdout, proc.stdout[-2000:]
    one = metrics(tmp_path / "single")
    assert all(r["aux_act_l2"] > 0 for r in one)
    for layout in ("fsdp2", "pp2"):
        run(layout, tmp_path / layout, *aux)
        two = metrics(tmp_path / layout)
        assert_matches(two, one)
        for a, b in zip(two, one):
            assert abs(a["aux_act_l2"] - b["aux_act_l2"]) <= 1e-5 * b["aux_act_l2"], (layout, a, b)


def test_a_family_mixes_its_own_mixer_with_attention_on_fsdp_tp_and_pp(tmp_path):
    # relu2's hybrid flavor: its own toy mixer ("shift", tests/families/relu2/model.py) and attention alternating
    # per layer on the shared decoder (layer_types), with no edit in titanlite/: FSDP x 2, TP x 2 and PP x 2 give
    # one process's losses. Packed documents (block-causal) reach the shift layers too.
    hybrid = ["--model.flavor", "hybrid", "--model.attn_mask_type", "block_causal"]
    run("single", tmp_path / "single", *hybrid)
    one = metrics(tmp_path / "single")
    for layout in ("fsdp2", "tp2", "pp2"):
        run(layout, tmp_path / layout, *hybrid)
        assert_matches(metrics(tmp_path / layout), one)


def test_plan_estimates_a_family_defined_outside_titanlite():
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "plan", *FAMILY, "--ngpu", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "titanlite plan: relu2 debug, 6,603,200 parameters" in proc.stdout
    assert "TP 2 " in proc.stdout and "recommended:" in proc.stdout
