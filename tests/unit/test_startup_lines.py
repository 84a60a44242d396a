"""The start-up banner describes the model that trains: the config file's description only for the file's own
model, and for every run the attention kernel each layer runs (windows, softcap, sinks) and the experts' kernel."""

import pytest
import torch

from titanlite.builder.model import plain_model
from titanlite.builder.plan import plan_model
from titanlite.builder.run import describe_attention, describe_experts
from titanlite.config import parse_config

BYTES = ["--model.tokenizer", "byte"]


def lines(*args: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[str, str | None]:
    cfg = parse_config([*BYTES, *args])
    with torch.device("meta"):
        model = plain_model(cfg, plan_model(cfg))
    return describe_attention(cfg, 1, model, device), describe_experts(cfg, model, torch.device(device), dtype)


def test_a_model_chosen_on_the_command_line_drops_the_config_files_description():
    assert parse_config(["--config", "train_configs/debug_model.toml"]).job.description == "tiny GPT-2"
    for choice in (["--model.name", "llama3"], ["--model.flavor", "124M"]):
        assert parse_config(["--config", "train_configs/debug_model.toml", *choice]).job.description == ""
    told = ["--config", "train_configs/debug_model.toml", "--model.name", "llama3", "--job.description", "mine"]
    assert parse_config(told).job.description == "mine"


@pytest.mark.parametrize(
    "args, attention",
    [
        ([], "  attention: causal; sdpa's fused causal kernel"),
        (
            ["--model.attn_mask_type", "block_causal"],
            "  attention: block-causal (a token sees earlier tokens of its own document only); "
            "sdpa with a dense T x S mask",
        ),
        (["--model.attn_backend", "flex"], "  attention: causal; FlexAttention's blockwise CPU path"),
        (
            ["--model.name", "gpt_oss", "--model.flavor", "debug"],
            "  attention: causal; sdpa's explicit [B, H, T, S] scores (window 8, sinks) in 2 of 4 layers, "
            "sdpa's explicit [B, H, T, S] scores (sinks) in 2 of 4 layers",
        ),
    ],
)
def test_the_attention_line_names_each_layers_kernel(args, attention):
    assert lines(*args)[0] == attention


def test_the_attention_line_names_gemma3s_windows():
    assert lines("--model.name", "gemma3", "--model.flavor", "debug")[0] == (
        "  attention: causal; sdpa with a dense T x S mask (window 16) in 2 of 4 layers, sdpa's fused causal kernel "
        "in 2 of 4 layers"
    )


def test_the_experts_line_names_the_kernel_and_why_it_loops():
    moe = ["--model.name", "qwen3_moe", "--model.flavor", "debug"]
    assert lines()[1] is None  # a dense model has no experts line
    grouped = "  experts: 3 blocks of 8 experts, torch._grouped_mm (one kernel for every expert of a block)"
    assert lines(*moe)[1] == grouped
    assert lines(*moe, "--moe.experts_kernel", "loop")[1].endswith("a loop over the experts (moe.experts_kernel loop)")
    compiled = lines(*moe, "--compile.enable")[1]
    assert compiled.endswith("(torch.compile's grouped_mm takes bfloat16, not torch.float32)"), compiled


def test_the_experts_line_says_whether_tp_splits_each_expert_or_runs_it_whole():
    moe = ["--model.name", "qwen3_moe", "--model.flavor", "debug", "--parallelism.tensor_parallel_degree", "2"]
    assert lines(*moe)[1] == (
        "  experts: 3 blocks of 8 experts, whole on each of the 2 tensor-parallel ranks "
        "(parallelism.expert_tensor_parallel_degree = 2 splits them), torch._grouped_mm (one kernel for every "
        "expert of a block)"
    )
    split = lines(*moe, "--parallelism.expert_tensor_parallel_degree", "2")[1]
    assert split.startswith("  experts: 3 blocks of 8 experts, each split over the 2 tensor-parallel ranks, ")


@pytest.mark.parametrize(
    "config, says",
    [
        ("qwen3_5_debug", "  linear attention: gated delta rule in 3 of 4 layers, by the chunked PyTorch path"),
        ("nemotron_h_debug", "  linear attention: SSD scan in 3 of 6 layers, by the chunked PyTorch path"),
    ],
)
def test_the_linear_attention_line_counts_each_layer_once_under_context_parallelism(config, says):
    """Context parallelism wraps each layer's delta rule (Mamba-2's scan) in one that is a DeltaRule (a StateScan)
    too: still 3 of 4 layers (3 of 6)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.builder.run import describe_linear_attention
    from titanlite.parallel.context_parallel import apply_cp

    cfg = parse_config([*BYTES, "--config", f"train_configs/{config}.toml"])
    with torch.device("meta"):
        model = plain_model(cfg, plan_model(cfg))
    before = describe_linear_attention(cfg, model, "cpu")
    assert before is not None and before.startswith(says), before
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_cp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
        assert describe_linear_attention(cfg, model, "cpu") == before
    finally:
        dist.destroy_process_group()
