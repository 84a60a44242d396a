"""DeepSeek-V3: pre-norm blocks of multi-head latent attention (MLA) and a mixture of experts (the shared block,
titanlite/models/common/moe.py: sigmoid scores, group-limited top-k, the balancing bias, shared experts), the first
moe.dense_layers with a dense SwiGLU. Plain modules with no parallelism inside; multi-token prediction is not built.

MLA, per token x [dim]: the query is wq(x), or wq_b(q_norm(wq_a(x))) through a rank-q_lora_rank bottleneck; wkv_a(x)
gives the compressed latent c [kv_lora_rank] and ONE rotary key k_rot [qk_rope_head_dim] shared by every head;
wkv_b(kv_norm(c)) expands the latent into each head's non-rotary key [qk_nope_head_dim] and value [v_head_dim].
Each head attends with query [q_nope, rope(q_rot)] and key [k_nope, rope(k_rot)] at the scale
DeepseekV3Args.softmax_scale. The attention runs through the shared core (sdpa or flex, block-causal masks,
context parallelism, the KV cache), which takes keys and values of one width: where v_head_dim differs from the
query/key width, the narrower side is padded with zeros (zeros change no score, and the output's padding is cut)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import Sequence, build_core
from titanlite.models.common.head import OutputHead
from titanlite.models.common.interface import Decoder
from titanlite.models.common.kv_cache import KVCache, LayerCache
from titanlite.models.common.moe import MoE, count_step_tokens
from titanlite.models.deepseek_v3.args import DeepseekV3Args
from titanlite.models.llama3.model import FeedForward, apply_rope, precompute_rope

LATENT_NORM_EPS = 1e-6  # the latent norms' epsilon in DeepSeek's code and transformers', whatever rms_norm_eps says


class LatentAttention(nn.Module):
    """Multi-head latent attention (module docstring). Every projection a separate nn.Linear, so tensor
    parallelism splits the per-head ones (wq or wq_b, wkv_b, wo) by heads and keeps the latent ones whole."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_rank = args.kv_lora_rank
        q_width = args.n_heads * args.qk_head_dim
        self.wq: nn.Linear | None = None
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_width, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_width, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.core = build_core("sdpa", scale=args.softmax_scale)  # context parallelism wraps it

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallelism the local head count follows from the sharded weights.
        q_nope, q_rot = q.view(bsz, seqlen, -1, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seqlen, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, T, H, nope], [B, T, H, v]
        cos, sin = cos[:seqlen], sin[:seqlen]  # the full tables come in (sequence parallelism: see Llama)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot.unsqueeze(2), cos, sin)  # k_rot [B, T, 1, r]
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # [B, T, H, nope + rope]
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, width]
        out = self.core(q, k, v, sequence) if cache is None else cache.attend(q, k, v, self.core)
        out = out[..., : self.v_dim].transpose(1, 2).reshape(bsz, seqlen, -1)  # [B, T, H * v]
        return self.wo(out)


class TransformerBlock(nn.Module):
    def __init__(self, args: DeepseekV3Args, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = LatentAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(args.dim, args.moe) if args.moe.is_sparse(layer) else FeedForward(args.dim, args.ffn_dim)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache=cache, sequence=sequence)
        return h + self.feed_forward(self.ffn_norm(h))


class DeepseekV3(nn.Module):
    """Implements titanlite.models.common.interface.Decoder."""

    first_stage_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    last_stage_modules: ClassVar[tuple[str, ...]] = ("norm", "output")
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: OutputHead | None = OutputHead(args.dim, args.vocab_size)
        self.tie_weights()
        # RoPE tables [max_seq_len, qk_rope_head_dim // 2], non-persistent: they follow from args.
        shape = (args.max_seq_len, args.qk_rope_head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """RoPE tables in float32 on the model's device; the step's token counts and the routing biases at zero
        (a checkpoint or a Hugging Face folder then restores the biases)."""
        args = self.args
        cos, sin = precompute_rope(
            args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, self.rope_cos.device, args.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, MoE):
                module.step_tokens.zero_()
                if module.router.expert_bias is not None:
                    module.router.expert_bias.zero_()

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
        """As the Llama decoder's forward (titanlite/models/llama3/model.py): logits [B, T, vocab], or the final
        hidden states with logits=False; a pipeline stage without the head returns its hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        if cache is not None:
            positions = cache.positions(tokens.shape[1], h.device)
            cos, sin = cos[positions], sin[positions]
        elif sequence is not None and sequence.positions is not None:
            cos, sin = cos[sequence.positions], sin[sequence.positions]
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, cache=None if cache is None else cache.layer(name), sequence=sequence)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if torch.is_grad_enabled():  # a training forward: its expert counts join the step's (bias balancing)
            count_step_tokens(self)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, project=logits) if self.output is not None else h

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `full` (parameter `name`'s full value) using only `generator`: norms at one, the embedding normal
        std 0.02, the input-side projections (latent ones, experts' gate and up, the router) trunc normal std
        0.02, the residual-side ones (wo, w2) at std 0.02 / sqrt(2 * n_layers), an untied head at dim**-0.5."""
        path, _, leaf = name.rpartition(".")
        parent = path.rpartition(".")[2]
        std = 0.02
        residual_std = std / math.sqrt(2 * self.args.n_layers)

        def trunc(std: float, bound: float = 2.0) -> None:
            nn.init.trunc_normal_(full, mean=0.0, std=std, a=-bound * std, b=bound * std, generator=generator)

        if parent in ("attention_norm", "ffn_norm", "norm", "q_norm", "kv_norm"):
            nn.init.ones_(full)
        elif parent == "tok_embeddings" or (parent == "output" and self.args.tie_embeddings):
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)
        elif parent == "output":
            trunc(self.args.dim**-0.5, bound=3.0)
        elif parent in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w3", "gate") or leaf in ("w1", "w3"):
            trunc(std)  # leaf w1, w3: the stacked experts' gate and up
        elif parent in ("wo", "w2") or leaf == "w2":
            trunc(residual_std)
        else:
            raise KeyError(f"DeepseekV3.init_param: unknown parameter {name!r}")


if TYPE_CHECKING:  # mypy holds the class to the model interface and names any member that differs

    def _implements_decoder(model: DeepseekV3) -> Decoder:
        return model
