"""Decoding: continue token ids with a model over a KV cache, greedy or sampled, one token per forward (`titanlite
generate` and lm-eval's generate_until requests both decode here). The decoding policy lives here; the models only
know how to use a cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titanlite.models.common.interface import DecoderModule
from titanlite.models.common.kv_cache import KVCache, StaticKVCache

# Why generation stopped, as --output records it.
MAX_NEW_TOKENS, END_OF_TEXT, CONTEXT_FULL = "max-new-tokens", "end-of-text", "context-full"
STOP_SEQUENCE = "stop-sequence"  # `until` said so (lm-eval's stop strings)


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: the most likely one at temperature 0, else one drawn from
    softmax(logits / temperature) over the top_k most likely ids (0: all), by a generator seeded with seed."""

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def describe(self) -> str:
        if self.temperature == 0:
            return "greedy"
        top_k = f", top-k {self.top_k}" if self.top_k else ""
        return f"sampling at temperature {self.temperature:g}{top_k}, seed {self.seed}"


@dataclass
class Generation:
    new_ids: list[int]
    stop: str  # MAX_NEW_TOKENS, END_OF_TEXT, CONTEXT_FULL or STOP_SEQUENCE
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_ids) / self.seconds if self.seconds > 0 else float("inf")


def next_token(logits: torch.Tensor, vocab_size: int, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next id [B] from the last position's logits [B, V].

    Only ids below vocab_size (the tokenizer's) can come out: the columns past it are the padding of the
    embedding to a multiple of 64, untrained, and no tokenizer could decode them."""
    logits = logits[:, :vocab_size].float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth_best = torch.topk(logits, min(sampling.top_k, vocab_size), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return sample(torch.softmax(logits, dim=-1), generator)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id [B] per row of probs [B, V], drawn with probability probs.

    argmax(p / E) with E ~ Exponential(1) is distributed as p (the Gumbel-max trick: -log E is Gumbel);
    on the CPU it is ten times faster than torch.multinomial over GPT-2's 50257 ids, and never syncs a GPU."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)


class Decoder:
    """The last position's logits [B, V] of tokens [B, T] that continue the cached sequence, one eager forward
    each (KVCache)."""

    def __init__(self, model: nn.Module, max_len: int):
        self.model, self.cache = model, KVCache(max_len)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, cache=self.cache)[:, -1]


class GraphedDecoder(Decoder):
    """A Decoder over a StaticKVCache whose single-token steps replay one CUDA graph.

    The prompt (T > 1) runs eagerly. The first single-token step is run twice on a side stream (cuBLAS and
    allocator set-up stays out of the graph; the cache's position is put back after each), then captured; every
    step after copies its token into the graph's input and replays it. The returned logits are the graph's own
    output buffer, overwritten by the next step."""

    def __init__(self, model: nn.Module, max_len: int, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CUDA graph decoding needs a CUDA device, not {device}")
        self.model = model
        self.cache: StaticKVCache = StaticKVCache(max_len, device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] != 1:
            return super().__call__(tokens)
        if self.graph is None:
            self.graph = self._capture(tokens)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits

    def _capture(self, tokens: torch.Tensor) -> torch.cuda.CUDAGraph:
        self.tokens = tokens.clone()
        position = self.cache.position.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(self.tokens, cache=self.cache)
                self.cache.position.copy_(position)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # recorded, not run: the position moves at each replay
            self.logits = self.model(self.tokens, cache=self.cache)[:, -1]
        return graph


@torch.inference_mode()
def generate(
    model: DecoderModule,
    prompt_ids: list[int],
    max_new_tokens: int,
    vocab_size: int,
    sampling: Sampling = Sampling(),
    eot_id: int | None = None,
    cuda_graph: bool = False,
    until: Callable[[list[int]], bool] | None = None,
) -> Generation:
    """Continue prompt_ids by up to max_new_tokens ids, stopping early at eot_id (kept as the last id) or when
    prompt and continuation fill the model's context (model.args.max_seq_len positions).

    The prompt goes through the model once (prefill); then each new token is one forward of that token alone,
    its attention reading the keys and values of all earlier positions from a KV cache. `cuda_graph` (a CUDA
    device only) replays those single-token forwards as one CUDA graph (GraphedDecoder); its capture is inside
    the timed call. `until(new_ids)`: stop early where it says so (after eot_id, before the other reasons)."""
    device = next(model.parameters()).device
    max_len = min(model.args.max_seq_len, len(prompt_ids) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    new_ids: list[int] = []
    start = time.perf_counter()
    decode = GraphedDecoder(model, max_len, device) if cuda_graph else Decoder(model, max_len)
    tokens = torch.tensor([prompt_ids], device=device)  # [1, T]
    while True:
        logits = decode(tokens)  # [1, V]
        tokens = next_token(logits, vocab_size, sampling, generator)[:, None]  # [1, 1]
        new_ids.append(int(tokens.item()))  # .item() waits for the device: the clock below is honest
        stop = _stop_reason(new_ids, max_new_tokens, eot_id, len(prompt_ids) + len(new_ids), model.args.max_seq_len)
        if until is not None and stop != END_OF_TEXT and until(new_ids):
            stop = STOP_SEQUENCE
        if stop:
            return Generation(new_ids, stop, time.perf_counter() - start)


def _stop_reason(new_ids: list[int], max_new_tokens: int, eot_id: int | None, length: int, context: int) -> str | None:
    if eot_id is not None and new_ids[-1] == eot_id:
        return END_OF_TEXT
    if len(new_ids) == max_new_tokens:
        return MAX_NEW_TOKENS
    if length == context:  # the next token would have no position to sit at
        return CONTEXT_FULL
    return None
