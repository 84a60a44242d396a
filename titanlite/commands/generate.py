"""`titanlite generate`: continue a prompt with a trained model on one device, greedy or sampled, one token
per forward over a KV cache. The decoding policy lives here; the models only know how to use a cache.

On a CUDA GPU each single-token step replays as one CUDA graph by default: at batch 1 a step is hundreds of small
kernels, and launching them one by one from Python, not the GPU, set the pace (about 15 ms a token for a 1B Llama
on an H100; 3.3x the eager decode on an H200). `--no-cuda-graph` decodes eagerly. A model whose decode step has not
been captured on a GPU yet (mixture-of-experts layers, FlexAttention) decodes eagerly by default, with a line that
says so; `--cuda-graph` captures it anyway."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from titanlite.base.command_line import check_output_file, take_options, write_output
from titanlite.base.devices import uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.builder.model import plain_model
from titanlite.builder.plan import ModelPlan
from titanlite.components.checkpoint import checkpoint_to_load, load_weights, parse_run_config
from titanlite.components.hf_weights import load_hf_into
from titanlite.data.tokenizer import build_tokenizer
from titanlite.engine.decoding import CONTEXT_FULL, END_OF_TEXT, Generation, Sampling, generate
from titanlite.models.build import model_from_args
from titanlite.models.common.attention import FlexAttention
from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.moe.layer import MoE
from titanlite.models.hf_config import folder_model_args

OPTIONS = {
    "prompt": "",
    "max-new-tokens": 64,
    "temperature": 0.0,
    "top-k": 0,
    "seed": 0,
    "output": "",
    "cuda-graph": False,  # on a GPU: replay each decode step as one CUDA graph, whatever the model (graph_refusal)
    "no-cuda-graph": False,  # on a GPU: launch each decode step's kernels one by one (the eager decode)
}

# ---- the command ---------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    opts, rest = take_options(argv, OPTIONS, "generate")
    sampling = check_options(opts)
    check_output_file(opts["output"], "generate --output")
    cfg = parse_run_config(rest)  # the model the checkpoint was trained as, without its flags repeated
    tokenizer = build_tokenizer(cfg.model.tokenizer, cfg.model.hf_assets_path)
    # A tokenizer with a BOS id starts every training document with it (Llama 3, SmolLM): so does the prompt.
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt_ids = bos + tokenizer.encode(opts["prompt"])
    eot_id = getattr(tokenizer, "eot_id", None)
    device = torch.device("cuda", 0) if uses_cuda() else torch.device("cpu")
    if opts["cuda-graph"] and device.type != "cuda":
        raise ConfigError(f"generate --cuda-graph needs a CUDA GPU, and this run is on {device}; leave it out")
    model, source = load_model(cfg, tokenizer)
    check_prompt_fits(len(prompt_ids), model.args.max_seq_len)
    inference_weights(model, device)  # before the move: the GPU never holds the float32 copy
    model.to(device).eval()
    graphed, note = decode_with_graphs(model, device, opts)
    if note:
        print(f"titanlite: {note}", flush=True)
    how = f"{_precision(device)}{', CUDA graphs' if graphed else ''}"
    print(f"titanlite: generating from {source} on {device} ({how}), {sampling.describe()}", flush=True)
    with _autocast(device):
        result = generate(model, prompt_ids, opts["max-new-tokens"], tokenizer.vocab_size, sampling, eot_id, graphed)
    text = tokenizer.decode(i for i in result.new_ids if i != eot_id)
    print(opts["prompt"] + text)
    print(
        f"titanlite: {len(result.new_ids)} new tokens in {result.seconds:.2f} s ({result.tokens_per_s:.1f} tokens/s, "
        f"model load excluded); {_describe_stop(result.stop, opts['max-new-tokens'], model.args.max_seq_len)}"
    )
    if opts["output"]:
        write_record(Path(opts["output"]), opts["prompt"], prompt_ids, result, text)
    return 0


def write_record(path: Path, prompt: str, prompt_ids: list[int], result: Generation, text: str) -> None:
    """What --output F.json holds: the prompt, its ids, the new ids, their text, the speed and why it stopped."""
    record = {
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "new_ids": result.new_ids,
        "text": text,
        "tokens_per_s": result.tokens_per_s,
        "stop": result.stop,
    }
    write_output(path, json.dumps(record, indent=2) + "\n")


def decode_with_graphs(model: nn.Module, device: torch.device, opts: dict) -> tuple[bool, str | None]:
    """Whether the decode steps replay as a CUDA graph (on CUDA by default, unless --no-cuda-graph, or the model is
    one graph_refusal names and --cuda-graph does not insist), and the line that says why not where it is not. A
    model with a layer that says why no static cache can hold its state (its `static_cache_refusal`: DeepSeek-V4's
    compressed attention) decodes eagerly, and --cuda-graph is refused."""
    if device.type != "cuda" or opts["no-cuda-graph"]:
        return False, None
    never = next((why for m in model.modules() if (why := getattr(m, "static_cache_refusal", None))), None)
    if never and opts["cuda-graph"]:
        raise ConfigError(f"generate --cuda-graph cannot capture this model's decode step: {never}; leave it out")
    if never:
        return False, f"decoding eagerly: {never}"
    refusal = graph_refusal(model)
    if refusal and not opts["cuda-graph"]:
        return False, f"decoding eagerly: {refusal}; --cuda-graph captures it anyway"
    return True, None


def graph_refusal(model: nn.Module) -> str | None:
    """Why this model's decode step is not captured as a CUDA graph by default (None: it is). The captured step
    must make no host round trip; on a GPU (an H100, 2026-11-28) it was checked against the eager decode for the
    dense decoder with SDPA attention (tests/gpu/test_cuda.py), not yet for the expert loop's split by counts on
    the host, the grouped experts, or FlexAttention's block masks built per step."""
    if any(isinstance(m, MoE) for m in model.modules()):
        return "the decode step of a mixture-of-experts model has not been captured as a CUDA graph on a GPU yet"
    if any(isinstance(m, FlexAttention) for m in model.modules()):
        return "the decode step over FlexAttention has not been captured as a CUDA graph on a GPU yet"
    return None


def check_options(opts: dict) -> Sampling:
    """The options' sampling settings, after rejecting values that cannot work (before anything is loaded)."""
    if opts["cuda-graph"] and opts["no-cuda-graph"]:
        raise ConfigError("generate takes --cuda-graph or --no-cuda-graph, not both; leave one out")
    if not opts["prompt"]:
        raise ConfigError("generate needs a non-empty --prompt TEXT")
    if opts["max-new-tokens"] < 1:
        raise ConfigError(f"generate --max-new-tokens={opts['max-new-tokens']} must be at least 1")
    if opts["temperature"] < 0:
        raise ConfigError(f"generate --temperature={opts['temperature']:g} must be 0 (greedy) or positive")
    if opts["top-k"] < 0:
        raise ConfigError(f"generate --top-k={opts['top-k']} must be 0 (all ids) or positive")
    return Sampling(opts["temperature"], opts["top-k"], opts["seed"])


def check_prompt_fits(n_tokens: int, context: int) -> None:
    if n_tokens >= context:
        raise ConfigError(
            f"generate --prompt is {n_tokens} tokens but the model's context is {context} (max_seq_len), with "
            f"room for at least one new token; use a prompt of at most {context - 1} tokens"
        )


def load_model(cfg, tokenizer, path: Path | None = None) -> tuple[DecoderModule, str]:
    """The model on the CPU with its weights, and where they came from: `path`, the checkpoint or Hugging Face folder
    a command chose already (`titanlite logits`), else checkpoint.checkpoint_to_load's."""
    path = path or checkpoint_to_load(cfg, "generate from")
    if (path / "config.json").is_file():
        return _load_hf_folder(path, tokenizer.vocab_size), f"the Hugging Face folder {path}"
    # DCP checkpoints saved on any parallel layout load into the plain model, planned for the tokenizer built above
    model = plain_model(cfg, ModelPlan.of(cfg, tokenizer))
    load_weights([model], path)  # one line if the folder is missing or damaged
    return model, str(path)


def _load_hf_folder(folder: Path, vocab_size: int) -> DecoderModule:
    """A model of the folder's own shape and weights (model.name and flavor play no part). Its vocabulary is
    taken as is, padded or not (GPT-2's 50257): it only has to cover the tokenizer's ids."""
    args = folder_model_args(folder)
    if args.vocab_size < vocab_size:
        raise ConfigError(
            f"checkpoint.initial_load_path='{folder}' has {args.vocab_size} token ids, fewer than model.tokenizer's "
            f"{vocab_size}; set model.tokenizer to the tokenizer the model was trained with"
        )
    model = model_from_args(args)
    load_hf_into([model], folder)
    return model


def inference_weights(model: nn.Module, device: torch.device) -> None:
    """On a GPU, the weights in bfloat16, as the matmuls read them: at batch 1 each new token reads every
    weight once, and float32 weights under autocast would be read in full and cast again for every token.
    Buffers (the RoPE tables) stay float32. On the CPU everything stays float32."""
    if device.type == "cuda":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)


def _precision(device: torch.device) -> str:
    return "bfloat16 weights and autocast" if device.type == "cuda" else "float32"


def _autocast(device: torch.device):
    """bfloat16 matmuls on a GPU (RoPE tables and the sampling math stay float32); plain float32 on the CPU.
    No cast cache: the weights are bfloat16 already, and a CUDA graph must not capture a cache's tensors."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def _describe_stop(stop: str, max_new_tokens: int, context: int) -> str:
    if stop == END_OF_TEXT:
        return "stopped at the end-of-text token"
    if stop == CONTEXT_FULL:
        return f"stopped: the context is full ({context} tokens, the model's max_seq_len)"
    return f"stopped at --max-new-tokens {max_new_tokens}"
