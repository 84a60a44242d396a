"""Host memory of importing a multi-shard quantized Hugging Face folder, measured: a random DeepSeek-V3-shaped model
(about 190 M parameters: 4 layers, 3 of them with 32 experts) written in FP8 blocks of 128 x 128, as published, over
shards of at most 64 MB; then imported the way a run imports it (model.flavor = "hf": build, then load_hf_into) on
one process and on EP x 2 (two processes, gloo, torchrun).

    .venv/bin/python scripts/bench_import_memory.py [--keep FOLDER]

Each process prints the bytes of the parameters it holds (float32) and what the import added to its resident memory
at the peak (Linux's VmHWM, reset just before the read, over VmRSS then). That counts the pages of the folder's files
the import read through their memory map (page cache, which the kernel can drop) with what it allocated itself. The
import reads one tensor at a time, dequantized to float32 as it is read, and copies it into the parameter (on EP,
only this rank's experts), so the growth stays near the folder's pages read plus the largest tensor built at a time,
never the model twice (docs/huggingface.md#quantized-folders).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1,
    first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_group=4, topk_group=2, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip
BLOCK = (128, 128)
MiB = 2**20


def write_folder(folder: Path) -> None:
    """The random model in FP8 blocks, in shards of at most 64 MB (model.safetensors.index.json)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from titanlite.components.hf_quantized import quantize_fp8

    torch.manual_seed(0)
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE))
    hf = hf.to_empty(device="cpu")
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hf.save_pretrained(folder, max_shard_size="64MB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, []).append(name)
    from safetensors import safe_open

    weight_map = {}
    for file, names in files.items():
        with safe_open(str(folder / file), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in names}
        out = {}
        for name, tensor in tensors.items():
            if tensor.dim() == 2 and name.endswith("_proj.weight") and "layernorm" not in name:
                out[name], out[name + "_scale_inv"] = quantize_fp8(tensor.float(), BLOCK)
            else:
                out[name] = tensor
        save_file(out, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, file)
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (folder / "config.json").write_text(json.dumps(config))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(folder: Path, expert_parallel: int) -> None:
    """One process's import of `folder` (under torchrun for EP), measured."""
    import torch

    from titanlite.builder.model import build_model
    from titanlite.builder.plan import plan_run
    from titanlite.builder.runtime import init_distributed
    from titanlite.components.hf_weights import load_hf_into
    from titanlite.config import parse_config

    world = int(os.environ.get("WORLD_SIZE", 1))
    argv = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
    argv += ["--training.seq_len", "64", "--parallelism.data_parallel_shard_degree", str(world)]
    argv += ["--parallelism.expert_parallel_degree", str(expert_parallel)]
    cfg = parse_config(argv)
    plan = plan_run(cfg, world)
    device = init_distributed(world, cfg.comm.init_timeout_seconds, one_rank_mesh=plan.dims.fsdp_single_rank)
    _, parts = build_model(cfg, plan, plan.dims.build_mesh(device.type), device)
    held = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for m in parts for p in m.parameters())
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    load_hf_into(parts, folder)
    grown = _status("VmHWM") - before
    rank = int(os.environ.get("RANK", 0))
    print(
        f"EP {expert_parallel} rank {rank}: parameters held {held / MiB:,.0f} MiB (float32); resident memory "
        f"{before / MiB:,.0f} MiB before the import, at its peak {grown / MiB:,.0f} MiB more ({grown / held:.2f} x "
        "the parameters held), the folder's pages it read included",
        flush=True,
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="write the folder here (and reuse it when it is there)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # a worker: measure this folder's import
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    options = parser.parse_args()
    os.environ.setdefault("TITANLITE_DEVICE", "cpu")
    if options.measure:
        measure(options.measure, options.ep)
        return
    with tempfile.TemporaryDirectory() as scratch:
        folder = options.keep or Path(scratch) / "fp8"
        if not (folder / "config.json").is_file():
            write_folder(folder)
        stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        shards = len(list(folder.glob("*.safetensors")))
        print(f"folder: {stored / MiB:,.0f} MiB of FP8 blocks ({BLOCK[0]} x {BLOCK[1]}) in {shards} shards")
        me = [sys.executable, str(Path(__file__).resolve()), "--measure", str(folder)]
        subprocess.run(me, cwd=REPO, check=True)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        subprocess.run([*torchrun, *me[1:], "--ep", "2"], cwd=REPO, check=True)


if __name__ == "__main__":
    main()
