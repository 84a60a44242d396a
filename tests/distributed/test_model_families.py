"""The Llama decoder's families on real layouts (gloo, fp32): Qwen3 (per-head Q/K norms, head_dim 32 of dim 64 /
4 heads) trains with the single-process losses, grad norms and validation losses on FSDP x 2, TP x 2 and PP x 2;
Hugging Face folders of each family import with transformers' logits on FSDP x 2 and TP x 2."""

import math

import pytest
import torch

from tests.distributed.conftest import CONFIGS
from tests.distributed.test_hf_layouts import layout_logits
from tests.helpers import REPO, VALIDATED, assert_matches, metrics, train_in_pool
from titanlite.config import parse_config

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
    "pp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
}
# What a run's banner says of each layout ("layout: ... on 2 cpu process(es)": titanlite/builder/run.py), with those of
# EP x 2 and CP x 2 (tests/distributed/test_expert_parallel.py, test_context_parallel.py cp(2)).
BANNERS = {
    "fsdp2": "dp_shard 2",
    "tp2": "tp 2",
    "pp2": "pp 2",
    "ep2": "dp_shard 2 x ep 2 (of shard x cp)",
    "cp2": "cp 2",
}


# All slow (CI runs them): the default suite runs qwen3 on TP x 2 with transformers' logits (below).
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) for name in ("fsdp2", "tp2", "pp2")])
def test_qwen3_on_a_layout_matches_one_process(tmp_path, reference, layout):
    nproc, args = LAYOUTS[layout]
    proc = train_in_pool(nproc, ["--config", CONFIGS["qwen3"], *VALIDATED, *args], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "model qwen3 debug" in proc.stdout
    assert_matches(metrics(tmp_path), reference("qwen3"))


SLOW = pytest.mark.slow
CASES = [
    pytest.param("qwen3", "tp2", id="qwen3-tp2"),
    pytest.param("olmo2", "fsdp2", id="olmo2-fsdp2"),
    pytest.param("qwen3", "fsdp2", id="qwen3-fsdp2", marks=SLOW),
    pytest.param("qwen2", "tp2", id="qwen2-tp2", marks=SLOW),
    pytest.param("smollm3", "tp2", id="smollm3-tp2", marks=SLOW),
    pytest.param("mistral", "fsdp2", id="mistral-fsdp2", marks=SLOW),
    pytest.param("qwen3-tied-bias", "tp2", id="qwen3-tied-bias-tp2", marks=SLOW),
    # Each family on both layouts (OLMo2's whole-projection Q/K norms sharded with the heads: WholeProjectionNorm)
    pytest.param("olmo2", "tp2", id="olmo2-tp2", marks=SLOW),
    pytest.param("qwen2", "fsdp2", id="qwen2-fsdp2", marks=SLOW),
    pytest.param("smollm3", "fsdp2", id="smollm3-fsdp2", marks=SLOW),
    pytest.param("mistral", "tp2", id="mistral-tp2", marks=SLOW),
    pytest.param("qwen3-tied-bias", "fsdp2", id="qwen3-tied-bias-fsdp2", marks=SLOW),
    pytest.param("llama-biases", "fsdp2", id="llama-biases-fsdp2", marks=SLOW),
    pytest.param("llama-biases", "tp2", id="llama-biases-tp2", marks=SLOW),
]


@pytest.mark.parametrize("case, layout", CASES)
def test_a_family_imports_on_a_layout_with_transformers_logits(tmp_path, case, layout):
    from tests.unit.test_hf_families import VOCAB, assert_logits_match, random_model

    hf = random_model(case)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded: read tensor by tensor on each rank
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)


DEBUG_CONFIGS = sorted(p.name for p in (REPO / "train_configs").glob("*.toml") if "debug" in p.name)


@pytest.mark.parametrize("config", DEBUG_CONFIGS)
def test_every_debug_config_trains_as_shipped(tmp_path, config):
    """Each family's debug config (docs/running.md's table), as shipped but for its length: two steps of four
    sequences (the shipped eight cost most of the time in the output head and loss of the large vocabularies, and
    prove nothing more here; the layout tests run them whole), the loss finite and falling, its banner naming the
    config's model."""
    short = ["--training.steps", "2", "--training.local_batch_size", "4", "--metrics.log_freq", "1"]
    proc = train_in_pool(1, ["--config", f"train_configs/{config}", *short], tmp_path)
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0], losses
    assert f"  model {parse_config(['--config', f'train_configs/{config}']).model.name} debug:" in proc.stdout
