"""Gemma 3's text decoder: the Llama decoder's attention and projections (titanlite/models/llama3/model.py) with
Gemma's differences: (1 + weight) RMSNorms computed in float32, a norm before and after each sublayer, embeddings
scaled by sqrt(dim), a GELU-tanh gated MLP, scores scaled by query_pre_attn_scalar**-0.5, and two RoPE tables
(sliding layers rope_local_theta, full layers rope_theta with linear scaling). No parallelism inside."""

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence
from titanlite.models.common.head import OutputHead
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import KVCache, LayerCache
from titanlite.models.gemma3.args import Gemma3Args
from titanlite.models.llama3 import model as llama
from titanlite.models.llama3.args import window_of

NORMS = ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm", "norm", "q_norm", "k_norm")


class GemmaRMSNorm(nn.Module):
    """RMSNorm that multiplies by (1 + weight), weight starting at 0, all in float32 (then the input's dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float, factor: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim // 2] in float32, the frequencies divided by `factor` (linear scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq / factor)
    return angles.cos(), angles.sin()


class Attention(llama.Attention):
    """Llama's grouped-query attention with per-head (1 + weight) Q/K norms and Gemma's score scale."""

    def __init__(self, args: Gemma3Args, window: int | None):
        super().__init__(args, window=window, norm=GemmaRMSNorm, scale=args.query_pre_attn_scalar**-0.5)


class FeedForward(llama.FeedForward):
    """Gated MLP with GELU (tanh approximation) where Llama has SiLU: w2(gelu(w1 x) * w3 x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class TransformerBlock(nn.Module):
    """Each sublayer normalises its input (attention_norm, ffn_norm) and its output (post_attention_norm,
    post_ffn_norm) before the residual add."""

    def __init__(self, args: Gemma3Args, layer: int):
        super().__init__()
        self.attention_norm = GemmaRMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, window=window_of(args, layer))
        self.post_attention_norm = GemmaRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = GemmaRMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, bias=args.mlp_bias)
        self.post_ffn_norm = GemmaRMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, cache=cache, sequence=sequence)
        h = x + self.post_attention_norm(attended)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Gemma3(nn.Module):
    """Implements titanlite.models.common.interface.Decoder."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    last_stage_modules: ClassVar[tuple[str, ...]] = ("norm", "output")
    rope_cos: torch.Tensor  # the full layers' tables (buffers, see init_buffers)
    rope_sin: torch.Tensor
    local_rope_cos: torch.Tensor  # the sliding layers'
    local_rope_sin: torch.Tensor

    def __init__(self, args: Gemma3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = GemmaRMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.tie_weights()
        shape = (args.max_seq_len, args.head_dim // 2)
        for name in ("rope_cos", "rope_sin", "local_rope_cos", "local_rope_sin"):
            self.register_buffer(name, torch.empty(shape, dtype=torch.float32), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Both RoPE tables in float32 on the model's device (non-persistent: they follow from args)."""
        a, device = self.args, self.rope_cos.device
        tables = {
            "rope": rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_linear_factor, device),
            "local_rope": rope_tables(a.head_dim, a.max_seq_len, a.rope_local_theta, 1.0, device),
        }
        for name, (cos, sin) in tables.items():
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        sequence: Sequence | None = None,
        *,
        logits: bool = True,
    ) -> torch.Tensor:
        """As Llama's forward (titanlite/models/llama3/model.py), each layer given its own RoPE table."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            # The scale rounded to the embedding's dtype first, as transformers does (sqrt(3072) is 55.5 in bf16).
            h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype, device=h.device)
        else:  # a later pipeline stage receives hidden states
            h = tokens
        tables = {False: (self.rope_cos, self.rope_sin), True: (self.local_rope_cos, self.local_rope_sin)}
        positions = None
        if cache is not None:
            positions = cache.positions(tokens.shape[1], h.device)
        elif sequence is not None and sequence.positions is not None:
            positions = sequence.positions
        if positions is not None:
            tables = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in tables.items()}
        for name, layer in self.layers.items():
            cos, sin = tables[window_of(self.args, int(name)) is not None]
            h = layer(h, cos, sin, cache=None if cache is None else cache.layer(name), sequence=sequence)
        if cache is not None:
            cache.advance(tokens.shape[1])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, project=logits) if self.output is not None else h

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Llama's initialisation, except the (1 + weight) norms, which start at 0."""
        path, _, leaf = name.rpartition(".")
        if leaf == "weight" and path.rpartition(".")[2] in NORMS:
            nn.init.zeros_(full)
        else:
            llama.init_decoder_param(self.args, name, full, generator)


if TYPE_CHECKING:

    def _implements_decoder(model: Gemma3) -> Decoder:
        return model
