"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings, no dropout.
Plain modules with no parallelism inside; the trainer shards them from outside."""

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, build_core
from titanlite.models.common.head import OutputHead
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import KVCache, LayerCache
from titanlite.models.gpt2.args import GPT2Args

# Our activation names (GPT2Args.activation) -> F.gelu's `approximate` argument.
GELU_APPROXIMATION = {"gelu_tanh": "tanh", "gelu": "none"}


class Attention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.head_dim
        # Separate projections (not one fused qkv) so tensor parallelism can shard each column-wise.
        self.wq = nn.Linear(args.dim, args.dim)
        self.wk = nn.Linear(args.dim, args.dim)
        self.wv = nn.Linear(args.dim, args.dim)
        self.wo = nn.Linear(args.dim, args.dim)
        self.core = build_core("sdpa")  # context parallelism wraps it to gather the other ranks' keys

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, sequence: Sequence | None = None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism the local head count follows from the sharded weight.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # [B, T, H, hd]
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        if cache is None:
            out = self.core(q, k, v, sequence)
        else:
            out = cache.attend(q, k, v)  # over the cached positions too
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, H*hd]
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, activation: str = "gelu_tanh"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)  # up
        self.w2 = nn.Linear(hidden_dim, dim)  # down
        self.approximate = GELU_APPROXIMATION[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate=self.approximate))


class TransformerBlock(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.activation)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, sequence: Sequence | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cache=cache, sequence=sequence)
        return h + self.feed_forward(self.ffn_norm(h))


class GPT2(nn.Module):
    """Implements titanlite.models.common.interface.Decoder."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings", "pos_embeddings")
    last_stage_modules: ClassVar[tuple[str, ...]] = ("norm", "output")

    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage
        # deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make output.weight the very tensor tok_embeddings.weight.

        Call again after anything that replaces parameters, such as to_empty (which unties them)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """GPT-2 has no buffers; present so the trainer treats every model alike."""

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor:
        """Logits [B, T, vocab] of tokens [B, T] at positions 0..T-1 (training), or at `sequence.positions`,
        attending as `sequence` says (titanlite/models/common/attention.py). With a cache (generation), the tokens
        continue the cached sequence, and their keys and values are added to the cache. logits=False: the final
        hidden states [B, T, dim] instead, for a loss that applies `output` itself."""
        if self.tok_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)  # [T]
            if cache is not None:  # the first uncached positions
                pos = cache.positions(tokens.shape[1], tokens.device)
            elif sequence is not None and sequence.positions is not None:
                pos = sequence.positions
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)  # [B, T, dim]
        else:
            h = tokens  # a later pipeline stage receives hidden states, not tokens
        for name, layer in self.layers.items():
            h = layer(h, cache=None if cache is None else cache.layer(name), sequence=sequence)
        if cache is not None:
            cache.advance(tokens.shape[1])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, project=logits) if self.output is not None else h  # [B, T, vocab], or [B, T, dim]

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (the full-size value of parameter `name`) in place, using only `generator`."""
        # Match on the last two name components, so wrapper prefixes (e.g. "_orig_mod.") do not matter.
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02
        # GPT-2 scales the residual projections down so the residual stream's variance does not
        # grow with depth.
        residual_std = std / math.sqrt(2 * self.args.n_layers)
        norms = ("attention_norm", "ffn_norm", "norm")
        if leaf == "bias" and parent in ("wq", "wk", "wv", "wo", "w1", "w2", *norms):
            nn.init.zeros_(full)
        elif leaf != "weight":
            raise KeyError(f"GPT2.init_param: unknown parameter {name!r}")
        elif parent in norms:
            nn.init.ones_(full)
        elif parent in ("tok_embeddings", "output", "wq", "wk", "wv", "w1"):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent in ("wo", "w2"):
            nn.init.normal_(full, mean=0.0, std=residual_std, generator=generator)
        elif parent == "pos_embeddings":
            nn.init.normal_(full, mean=0.0, std=0.01, generator=generator)
        else:
            raise KeyError(f"GPT2.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: GPT2) -> Decoder:
        return model
