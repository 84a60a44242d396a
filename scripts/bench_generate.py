"""Generation speed on one GPU: titanlite's decode loop (titanlite generate) against transformers' generate on
the same random model, batch 1, greedy, in one process.

    python3 scripts/bench_generate.py [--shape llama3.2-1b] [--new-tokens 256] [--repeats 3]

The model is a random Llama of the named shape made with transformers and saved with save_pretrained; titanlite
reads that folder as `--model.flavor hf` does. Each variant runs once to warm up (kernels, cuBLAS handles), then
--repeats times; the median is printed. Tokens/s counts the new tokens over the whole call, prefill included,
as `titanlite generate` prints it. Variants:
  transformers   LlamaForCausalLM.generate, bfloat16 weights, its default (dynamic) cache
  titanlite      titanlite.commands.generate.generate as the command runs it (bf16 weights under bf16 autocast,
                 each step's kernels launched one by one)
  titanlite graphed the same with each single-token step a CUDA graph replay (generate --cuda-graph; the
                 capture is inside the timed call)
  titanlite fp32 the eager decode with float32 weights under bf16 autocast (the command before it cast its weights)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titanlite.commands.generate import inference_weights
from titanlite.components.hf_weights import load_hf_into
from titanlite.engine.decoding import generate
from titanlite.models.build import model_from_args
from titanlite.models.common.rope_args import Llama3RopeScaling
from titanlite.models.hf_config import folder_model_args, hf_config
from titanlite.models.registry import spec_named


def shape(name: str) -> LlamaConfig:
    """The transformers config of a named shape, from titanlite's own flavor (hf_config writes what convert
    to-hf writes), with the published vocabulary, context and RoPE scaling of the model it stands for."""
    if name != "llama3.2-1b":
        raise ValueError(f"unknown shape {name!r}; known: {SHAPES}")
    args = dataclasses.replace(
        spec_named("llama3").flavors["1B"],
        vocab_size=128256,
        max_seq_len=131072,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
    )
    return LlamaConfig.from_dict(hf_config(args))


SHAPES = ["llama3.2-1b"]


def timed(fn, repeats: int) -> tuple[float, list[int]]:
    fn()  # warm-up
    times, ids = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ids = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3.2-1b", choices=SHAPES)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="")
    a = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    prompt = torch.randint(0, 50000, (1, a.prompt_tokens)).tolist()[0]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(shape(a.shape)).save_pretrained(folder)
        held = {"hf": LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()}
        inputs = torch.tensor([prompt], device=device)

        def hf_generate():
            out = held["hf"].generate(
                inputs, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0
            )
            return out[0, len(prompt) :].tolist()

        with torch.inference_mode():
            results["transformers"] = timed(hf_generate, a.repeats)
        print(f"transformers: {a.new_tokens / results['transformers'][0]:.1f} tokens/s", flush=True)
        held.clear()
        torch.cuda.empty_cache()

        args = folder_model_args(Path(folder))
        for label, cast, graphed in (
            ("titanlite", True, False),
            ("titanlite graphed", True, True),
            ("titanlite fp32 weights, eager", False, False),
        ):
            model = model_from_args(args)
            load_hf_into([model], Path(folder))
            if cast:
                inference_weights(model, device)
            model.to(device).eval()

            def ours(model=model, graphed=graphed):
                with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                    return generate(model, prompt, a.new_tokens, args.vocab_size, cuda_graph=graphed).new_ids

            try:  # one variant failing (e.g. a capture error) must not lose the others' figures
                results[label] = timed(ours, a.repeats)
                print(f"{label}: {a.new_tokens / results[label][0]:.1f} tokens/s", flush=True)
            except Exception as error:  # reported; the table goes on without it
                print(f"{label}: failed: {type(error).__name__}: {error}", flush=True)
            del model
            torch.cuda.empty_cache()

    reference = results["transformers"][1]
    rows = []
    device_name = torch.cuda.get_device_name()
    print(f"{a.shape}, batch 1, greedy, {a.prompt_tokens}-token prompt, {a.new_tokens} new tokens, {device_name}")
    print("| variant | s | tokens/s | same greedy ids as transformers |")
    print("|---|---:|---:|---:|")
    for label, (seconds, ids) in results.items():
        same = next((i for i, (x, y) in enumerate(zip(ids, reference)) if x != y), len(ids))
        rows.append({"variant": label, "seconds": seconds, "tokens_per_s": a.new_tokens / seconds, "same_prefix": same})
        print(f"| {label} | {seconds:.3f} | {a.new_tokens / seconds:.1f} | first {same} of {len(ids)} |")
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
