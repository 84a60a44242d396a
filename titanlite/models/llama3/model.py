"""The Llama decoder: RoPE, RMSNorm, SwiGLU feed-forward, grouped-query attention; and, by switches of its
arguments (titanlite/models/llama3/args.py), the families built like it (each sets them in its own folder):
Q/K/V biases, per-head or whole-projection Q/K norms, NoPE layers, post-norm blocks.
Plain modules with no parallelism inside; the trainer shards them from outside."""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, attend, build_core
from titanlite.models.common.head import OutputHead
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import KVCache, LayerCache
from titanlite.models.common.rope import rope_frequencies, yarn_frequencies
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.llama3.args import Llama3RopeScaling, LlamaArgs, window_of


def scale_rope_frequencies(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling (titanlite/models/llama3/args.py): rotations slower than the original
    context are slowed by `factor`, fast ones kept, those in between blended."""
    wavelength = 2 * math.pi / inv_freq
    context = scaling.original_max_position_embeddings
    # 0 for wavelengths longer than context / low_freq_factor, 1 for those shorter than
    # context / high_freq_factor, linear in context / wavelength in between.
    span = scaling.high_freq_factor - scaling.low_freq_factor
    blend = ((context / wavelength - scaling.low_freq_factor) / span).clamp(0, 1)
    return (1 - blend) * inv_freq / scaling.factor + blend * inv_freq


def precompute_rope(
    head_dim: int,
    seq_len: int,
    theta: float,
    device,
    scaling: Llama3RopeScaling | YarnRopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each [seq_len, head_dim // 2], in float32 (YaRN's scaled by its
    attention scale, as transformers applies it)."""
    if isinstance(scaling, YarnRopeScaling):
        inv_freq = yarn_frequencies(head_dim, theta, scaling, device)
    else:
        inv_freq = rope_frequencies(head_dim, theta, device)
        if scaling is not None:
            inv_freq = scale_rope_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    gain = scaling.attention_scale if isinstance(scaling, YarnRopeScaling) else 1.0
    return angles.cos() * gain, angles.sin() * gain


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, T, H, hd], Meta's layout for Llama weights."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each [B, T, H, hd/2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, hd/2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """`norm(width, eps)` builds the Q/K norms (Gemma 3's differ); `scale` replaces head_dim**-0.5 of the scores."""

    def __init__(
        self,
        args: LlamaArgs,
        use_rope: bool = True,
        window: int | None = None,
        norm: Callable[..., nn.Module] = nn.RMSNorm,
        scale: float | None = None,
    ):
        super().__init__()
        self.head_dim, self.use_rope = args.head_dim, use_rope
        q_width, kv_width = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        # Separate projections (not one fused qkv) so tensor parallelism can shard each column-wise.
        self.wq = nn.Linear(args.dim, q_width, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_width, bias=args.qkv_bias)
        self.wo = nn.Linear(q_width, args.dim, bias=args.out_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm != "none":  # "head": one weight per head dimension; "full": per projection channel
            per_head = args.qk_norm == "head"
            self.q_norm = norm(args.head_dim if per_head else q_width, eps=args.norm_eps)
            self.k_norm = norm(args.head_dim if per_head else kv_width, eps=args.norm_eps)
        self.core = build_core(
            "sdpa", window=window, scale=scale
        )  # context parallelism wraps it to gather the other ranks' keys

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [B, T, H*hd]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism the local head counts follow from the sharded weights.
        q = q.view(bsz, seqlen, -1, self.head_dim)  # [B, T, Hq, hd]
        k = k.view(bsz, seqlen, -1, self.head_dim)  # [B, T, Hkv, hd]
        v = v.view(bsz, seqlen, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            # The full tables come in and are cut here: under sequence parallelism the block's input
            # holds a slice of the sequence, but attention sees the whole of it.
            cos, sin = cos[:seqlen], sin[:seqlen]  # [T, hd/2]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        sinks = self.attention_sinks()
        if cache is None:
            out = attend(self.core, q, k, v, sequence, sinks)
        else:  # the cache keeps H_kv heads and attends over the cached positions too
            out = cache.attend(q, k, v, self.core, sinks)  # [B, Hq, T, hd]; the core's window applies there too
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, Hq*hd]
        return self.wo(out)

    def attention_sinks(self) -> torch.Tensor | None:
        """The sink logits [Hq] of this rank's heads that the core adds to each softmax (gpt-oss's); none here."""
        return None


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=bias)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=bias)  # down
        self.w3 = nn.Linear(dim, hidden_dim, bias=bias)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm (each sublayer normalises its input), or post-norm (each normalises its output before the
    residual add); `attention_norm` and `ffn_norm` are the two norms either way."""

    def __init__(self, args: LlamaArgs, layer: int = 0):
        super().__init__()
        self.post_norm = args.norm_position == "post"
        # nn.RMSNorm runs torch.nn.functional.rms_norm, a fused kernel where the backend has one.
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, use_rope=layer not in args.nope_layers, window=window_of(args, layer))
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, bias=args.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        if self.post_norm:
            h = x + self.attention_norm(self.attention(x, cos, sin, cache=cache, sequence=sequence))
            return h + self.ffn_norm(self.feed_forward(h))
        h = x + self.attention(self.attention_norm(x), cos, sin, cache=cache, sequence=sequence)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Implements titanlite.models.common.interface.Decoder."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    last_stage_modules: ClassVar[tuple[str, ...]] = ("norm", "output")
    rope_cos: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    rope_sin: torch.Tensor

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage
        # deletes the layers it does not own.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.tie_weights()
        # RoPE tables [max_seq_len, head_dim // 2]; non-persistent because they follow from args,
        # so checkpoints need not carry them. Registered empty here to fix their device.
        shape = (args.max_seq_len, args.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Compute the RoPE tables in float32 on the device the model lives on (after to_empty too)."""
        args = self.args
        cos, sin = precompute_rope(
            args.head_dim, args.max_seq_len, args.rope_theta, self.rope_cos.device, args.rope_scaling
        )
        # Re-registering (rather than copy_) keeps them float32 even if the model was cast.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """With tie_embeddings, make output.weight the very tensor tok_embeddings.weight.

        Call again after anything that replaces parameters, such as to_empty (which unties them)."""
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
        """Logits [B, T, vocab] of tokens [B, T] at positions 0..T-1 (training), or at `sequence.positions`,
        attending as `sequence` says (titanlite/models/common/attention.py). With a cache (generation), the tokens
        continue the cached sequence, and their keys and values are added to the cache. logits=False: the final
        hidden states [B, T, dim] instead, for a loss that applies `output` itself."""
        # A later pipeline stage receives hidden states [B, T, dim] instead of tokens [B, T].
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin  # [max_seq_len, hd/2]; attention cuts them to length
        if cache is not None:  # the new tokens' rotations start at the first uncached position
            positions = cache.positions(tokens.shape[1], h.device)
            cos, sin = cos[positions], sin[positions]
        elif sequence is not None and sequence.positions is not None:
            cos, sin = cos[sequence.positions], sin[sequence.positions]
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, cache=None if cache is None else cache.layer(name), sequence=sequence)
        if cache is not None:
            cache.advance(tokens.shape[1])
        h = self.after_blocks(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, project=logits) if self.output is not None else h  # [B, T, vocab], or [B, T, dim]

    def after_blocks(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states after this part's last block, before the final norm: a family's hook (the MoE decoder
        joins its pooled balance term here, where the norm that follows makes the part's output a tensor of its
        own, not a view of h, which FSDP would warn about at the root)."""
        return h

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (the full-size value of parameter `name`) in place, using only `generator`."""
        init_decoder_param(self.args, name, full, generator)


def init_decoder_param(args: LlamaArgs, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """Llama's initialisation of parameter `name` (its full value `full`, in place, drawing only from `generator`),
    shared with the families whose modules are named as Llama's."""
    # Match on the last two name components, so wrapper prefixes (e.g. "_orig_mod.") do not matter.
    path, _, leaf = name.rpartition(".")
    parent = path.rpartition(".")[2]
    std = 0.02
    # Residual projections are scaled down so the residual stream's variance does not grow with depth.
    residual_std = std / math.sqrt(2 * args.n_layers)
    if leaf == "bias" and parent in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        nn.init.zeros_(full)
    elif leaf != "weight":
        raise KeyError(f"Llama.init_param: unknown parameter {name!r}")
    elif parent in ("attention_norm", "ffn_norm", "norm", "q_norm", "k_norm"):
        nn.init.ones_(full)
    elif parent == "tok_embeddings" or (parent == "output" and args.tie_embeddings):
        nn.init.normal_(full, mean=0.0, std=std, generator=generator)
    elif parent == "output":
        out_std = args.dim**-0.5
        nn.init.trunc_normal_(full, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std, generator=generator)
    elif parent in ("wq", "wk", "wv", "w1", "w3"):
        nn.init.trunc_normal_(full, mean=0.0, std=std, a=-2 * std, b=2 * std, generator=generator)
    elif parent in ("wo", "w2"):
        nn.init.trunc_normal_(
            full, mean=0.0, std=residual_std, a=-2 * residual_std, b=2 * residual_std, generator=generator
        )
    else:
        raise KeyError(f"Llama.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy (.ci/run) holds the class to the model interface and names any member that differs

    def _implements_decoder(model: Llama) -> Decoder:
        return model
