"""A Hugging Face model of an unusual shape (model.flavor = "hf") on real layouts: imported into FSDP x 2 and
TP x 2 through titanlite's build and load path, its logits equal transformers' to 1e-5 (fp32, gloo)."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, env
from tests.unit.test_hf_shapes import assert_logits_match, perturb, unusual_gpt2, unusual_llama

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    "ep2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
}
CASES = [
    pytest.param("llama", "fsdp2", id="llama-fsdp2"),
    pytest.param("llama", "tp2", id="llama-tp2"),
    pytest.param("gpt2", "fsdp2", id="gpt2-fsdp2", marks=pytest.mark.slow),  # llama-fsdp2 and gpt2-tp2 stay
    pytest.param("gpt2", "tp2", id="gpt2-tp2"),
]


def layout_logits(tmp_path, folder, tokens: torch.Tensor, layout: str) -> torch.Tensor:
    torch.save(tokens, tmp_path / "tokens.pt")
    out = tmp_path / "logits.pt"
    cmd = [
        sys.executable,
        "-m",
        "titanlite.commands.launch",
        "--standalone",
        "--nproc-per-node=2",
        f"--log-dir={tmp_path / 'logs'}",
        str(REPO / "tests" / "distributed" / "hf_logits_worker.py"),
        str(out),
        str(tmp_path / "tokens.pt"),
        "--model.flavor",
        "hf",
        "--model.hf_assets_path",
        str(folder),
        "--model.tokenizer",
        "byte",
        "--training.seq_len",
        str(tokens.shape[1]),
        "--training.loss_chunk_tokens",
        "0",
        *LAYOUTS[layout],
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("family,layout", CASES)
def test_layout_imports_with_transformers_logits(tmp_path, family, layout):
    hf = perturb(unusual_llama() if family == "llama" else unusual_gpt2())
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded: read tensor by tensor on each rank
    tokens = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path, tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)
