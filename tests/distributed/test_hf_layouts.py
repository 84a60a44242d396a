"""A Hugging Face model of an unusual shape (model.flavor = "hf") on real layouts: imported into FSDP x 2 and
TP x 2 through titanlite's build and load path, its logits equal transformers' to 1e-5 (fp32, gloo)."""

import pytest
import torch

from tests.distributed.hf_logits_worker import layout_logits_on_rank
from tests.pool import pool
from tests.unit.test_hf_shapes import assert_logits_match, perturb, unusual_gpt2, unusual_llama

pytestmark = pytest.mark.distributed

TP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": TP2,
    "ep2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
    "tp2_etp2": [*TP2, "--parallelism.expert_tensor_parallel_degree", "2"],
}
CASES = [
    pytest.param("llama", "fsdp2", id="llama-fsdp2"),
    pytest.param("llama", "tp2", id="llama-tp2"),
    pytest.param("gpt2", "fsdp2", id="gpt2-fsdp2", marks=pytest.mark.slow),  # llama-fsdp2 and gpt2-tp2 stay
    pytest.param("gpt2", "tp2", id="gpt2-tp2"),
]


def layout_logits(folder, tokens: torch.Tensor, layout: str) -> torch.Tensor:
    """The logits of the Hugging Face `folder` imported on 2 ranks of the pool in `layout`."""
    argv = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
    argv += ["--training.seq_len", str(tokens.shape[1]), "--training.loss_chunk_tokens", "0", *LAYOUTS[layout]]
    return pool(2).run(layout_logits_on_rank, tokens, argv).values[0]


@pytest.mark.parametrize("family,layout", CASES)
def test_layout_imports_with_transformers_logits(tmp_path, family, layout):
    hf = perturb(unusual_llama() if family == "llama" else unusual_gpt2())
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded: read tensor by tensor on each rank
    tokens = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(4))
    ours = layout_logits(tmp_path / "hf", tokens, layout)
    with torch.no_grad():
        assert_logits_match(ours, hf(tokens).logits)
