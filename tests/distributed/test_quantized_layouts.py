"""Quantized folders as published on expert parallelism (gloo, fp32): a DeepSeek-V3 folder in FP8 blocks and a gpt-oss
folder with MXFP4 experts import on EP x 2 with the logits of their dequantized weights (transformers' model of them)
to 1e-5, and each rank reads and dequantizes only the experts it keeps (tests/unit/test_quantized_folders.py: the same
folders on one process)."""

import re

import pytest
import torch

from tests.distributed.hf_logits_worker import layout_logits_and_reads_on_rank
from tests.distributed.test_hf_layouts import LAYOUTS
from tests.pool import pool
from tests.unit.test_quantized_folders import fp8, mxfp4  # noqa: F401 (fixtures)

pytestmark = pytest.mark.distributed


def ep2(folder, tokens, fsdp: int = 1) -> tuple[torch.Tensor, list[list]]:
    """The logits of `folder` imported on EP x 2 (of FSDP x 2 x `fsdp` ranks), and each rank's reads."""
    argv = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
    argv += ["--training.seq_len", str(tokens.shape[1]), "--training.loss_chunk_tokens", "0", *LAYOUTS["ep2"]]
    argv += ["--parallelism.data_parallel_shard_degree", str(2 * fsdp)]
    results = pool(2 * fsdp).run(layout_logits_and_reads_on_rank, tokens, argv).values
    return results[0][0], [reads for _, reads in results]


# EP x 2 of 4 ranks (FSDP 2 within each expert group: the experts' first dimension sharded twice) is slow; CI runs it.
@pytest.mark.parametrize("fsdp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_an_fp8_deepseek_folder_on_ep2_reads_only_each_ranks_experts(fp8, fsdp):  # noqa: F811
    folder, reference, stored = fp8
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    logits, reads = ep2(folder, tokens, fsdp)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    n_experts = len({m.group(1) for k in stored if (m := re.search(r"experts\.(\d+)\.", k))})
    share = n_experts // (2 * fsdp)  # the experts each rank keeps (each of its group's, sharded again by FSDP)
    for rank, names in enumerate(reads):
        experts = {int(m.group(1)) for name, _ in names if (m := re.search(r"experts\.(\d+)\.", name))}
        assert len(experts) == share and (fsdp > 1 or experts == set(range(rank * share, (rank + 1) * share))), (
            rank,
            sorted(experts),
        )


@pytest.mark.slow  # the FP8 case stays in the default suite; CI runs this one
def test_an_mxfp4_gpt_oss_folder_on_ep2_reads_only_each_ranks_experts(mxfp4):  # noqa: F811
    folder, reference = mxfp4
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    logits, reads = ep2(folder, tokens)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    n_experts = reference.config.num_local_experts
    for rank, names in enumerate(reads):
        expert_reads = {rows for name, rows in names if ".mlp.experts." in name}
        half = n_experts // 2
        assert expert_reads == {(rank * half, (rank + 1) * half)}, (rank, expert_reads)


@pytest.mark.slow  # the DeepSeek-V3 case keeps the partial reads in the default suite; CI runs this one
def test_a_glm4_5_fp8_folder_on_ep2_reads_only_each_ranks_experts(tmp_path):
    """GLM-4.5-FP8's layout (attention, dense MLP, experts and shared expert in 128 x 128 blocks, the edges partial)
    on EP x 2: the logits of its dequantized copy, each rank reading its 4 of the 8 experts."""
    from tests.unit.test_glm4_moe import random_glm
    from tests.unit.test_quantized_folders import fp8_folders

    shape = dict(hidden_size=160, intermediate_size=192, moe_intermediate_size=48, head_dim=40, num_hidden_layers=2)
    folder, _, reference = fp8_folders(
        random_glm(**shape), tmp_path, lambda name: name.endswith("_proj.weight"), [128, 128]
    )
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
    logits, reads = ep2(folder, tokens)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    for rank, names in enumerate(reads):
        experts = {int(m.group(1)) for name, _ in names if (m := re.search(r"experts\.(\d+)\.", name))}
        assert experts == set(range(rank * 4, (rank + 1) * 4)), (rank, sorted(experts))
