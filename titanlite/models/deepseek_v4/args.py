"""DeepSeek-V4's arguments, torch-free: hyper-connections (titanlite/models/common/hyper_connections.py), the
compressed attention of each layer's kind (titanlite/models/common/compressed_attention.py) and the mixture of experts
(sqrt-softplus scores, a clamped SwiGLU, the first layers routed by a token table: titanlite/models/common/moe/); the
published sizes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from titanlite.models.common.decoder_args import TransformerDefaults
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.spec import not_math

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)


def _debug_moe() -> MoEArgs:
    return v4_moe(n_experts=8, top_k=2, expert_dim=32, route_scale=1.5, hash_layers=(0, 1, 2), swiglu_limit=10.0)


def v4_moe(
    n_experts: int, top_k: int, expert_dim: int, route_scale: float, hash_layers: tuple[int, ...], swiglu_limit: float
) -> MoEArgs:
    """DeepSeek-V4's block: sqrt(softplus) scores chosen with a routing bias (balance "bias"), the chosen scores
    renormalised then times route_scale, one shared expert, every SwiGLU clamped at swiglu_limit, the `hash_layers`
    routed by their token table."""
    return MoEArgs(
        n_experts=n_experts,
        top_k=top_k,
        expert_dim=expert_dim,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        route_scale=route_scale,
        n_shared_experts=1,
        balance="bias",
        swiglu_limit=swiglu_limit,
        hash_layers=hash_layers,
    )


@dataclass
class DeepseekV4Args(TransformerDefaults):
    """DeepSeek-V4 (titanlite/models/deepseek_v4/model.py): `hc_mult` residual streams; in each layer the attention of
    its kind (layer_types: "sliding_attention", "compressed_sparse_attention" (CSA), "heavily_compressed_attention"
    (HCA)) and a mixture of experts, each behind its RMSNorm and its hyper-connection."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int = not_math()
    max_seq_len: int = not_math(4096)
    head_dim: int = 512
    """The width of every query head and of the one key/value head (the key is the value)."""
    rotary_dim: int = 64
    """The channels at the end of each head that rotate (qk_rope_head_dim; config.json's partial_rotary_factor x
    head_dim), in adjacent pairs."""
    q_lora_rank: int = 1024
    rope_theta: float = 10000.0
    """The sliding layers' RoPE base."""
    compress_rope_theta: float = 160000.0
    """The compressed layers' RoPE base (their queries, keys and compressed keys)."""
    rope_scaling: YarnRopeScaling | None = None
    """YaRN of the compressed layers' rotations (the sliding layers' are plain); None: plain."""
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    """Each layer's attention kind; empty: transformers' default (two HCA layers, then CSA and HCA alternating)."""
    sliding_window: int = 128
    """The recent tokens every query sees, itself included."""
    csa_rate: int = 4
    """Tokens per compressed block of the CSA layers (compress_rates["compressed_sparse_attention"])."""
    hca_rate: int = 128
    """Tokens per compressed block of the HCA layers."""
    o_groups: int = 8
    """Groups of heads the output projection maps apart (each to o_lora_rank) before mixing them to dim."""
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    """Compressed blocks each query of a CSA layer reads (of those it may see)."""
    hc_mult: int = 4
    """Residual streams (1: hyper-connections over one stream, still mixed by their weights)."""
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    moe: MoEArgs = field(default_factory=_debug_moe)
    mtp_layers: int = 0
    """Multi-token prediction depths (DeepSeek's MTP layers: mtp.K in the published folders), each a layer after the
    decoder's over the streams (hyper_connections.py HyperMultiTokenProjection)."""
    mtp_layer_types: tuple[str, ...] = ()
    """Each depth's attention kind; empty: sliding, as the published folders' (their compress_ratios' last entry)."""
    indexer_loss_coefficient: float = not_math(1.0)
    """The CSA layers' indexer loss's weight in the training loss (training.indexer_loss_coefficient); not math."""
    family: str = not_math("deepseek_v4")

    TRAINING: ClassVar[tuple[str, ...]] = ()
    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = default_layer_types(self.n_layers)
        self.layer_types = tuple(self.layer_types)
        unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"DeepseekV4Args.layer_types has {unknown[0]!r}; its kinds are {', '.join(LAYER_KINDS)}")
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"DeepseekV4Args.layer_types has {len(self.layer_types)} entries for {self.n_layers}")
        for name in ("hc_mult", "hc_sinkhorn_iters", "csa_rate", "hca_rate", "sliding_window", "o_groups",
                     "q_lora_rank", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"DeepseekV4Args.{name}={getattr(self, name)}; it must be at least 1")
        if self.n_heads % self.o_groups:
            raise ValueError(
                f"DeepseekV4Args.o_groups={self.o_groups} does not divide n_heads={self.n_heads}; the output "
                "projection maps whole groups of heads"
            )
        for name, width in (("head_dim", self.head_dim), ("index_head_dim", self.index_head_dim)):
            if self.rotary_dim % 2 or not 0 < self.rotary_dim <= width:
                raise ValueError(
                    f"DeepseekV4Args.rotary_dim={self.rotary_dim}; use an even number up to {name}={width}"
                )
        if self.mtp_layers < 0:
            raise ValueError(f"DeepseekV4Args.mtp_layers={self.mtp_layers}; use 0 (none) or more")
        self.mtp_layer_types = tuple(self.mtp_layer_types)
        unknown = sorted(set(self.mtp_layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(
                f"DeepseekV4Args.mtp_layer_types has {unknown[0]!r}; its kinds are {', '.join(LAYER_KINDS)}"
            )
        if self.mtp_layer_types and len(self.mtp_layer_types) < self.mtp_layers:
            raise ValueError(
                f"DeepseekV4Args.mtp_layer_types has {len(self.mtp_layer_types)} entries for mtp_layers="
                f"{self.mtp_layers}; give one per depth, or none (sliding)"
            )
        self.moe.check_depth(self.n_layers)

    @property
    def has_indexer(self) -> bool:
        """Whether a layer's indexer trains beside the model (a CSA layer's): training.indexer_* apply."""
        return any(self.kind(i) == CSA for i in range(self.n_layers + self.mtp_layers))

    def kind(self, layer: int) -> str:
        """Layer `layer`'s attention kind: layer_types', or past them a multi-token prediction depth's."""
        if layer < self.n_layers:
            return self.layer_types[layer]
        depth = layer - self.n_layers
        return self.mtp_layer_types[depth] if depth < len(self.mtp_layer_types) else SLIDING

    # TransformerArgs: the shared expert's width is the experts'; one key/value head.
    @property
    def ffn_dim(self) -> int:
        return self.moe.expert_dim

    @property
    def n_kv_heads(self) -> int:
        return 1

    def rate(self, layer: int) -> int:
        """Tokens per compressed block of `layer` (0: a sliding layer)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.kind(layer)]


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """transformers' layer types for a config without them: two HCA layers, then CSA and HCA alternating."""
    rest = tuple(CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0)))
    return ((HCA,) * min(n_layers, 2) + rest)[:n_layers]


def debug() -> DeepseekV4Args:
    """4 layers (sliding, CSA, HCA, CSA), dim 64, 4 heads of 32 (8 rotating), a window of 8, blocks of 2 (CSA) and
    4 (HCA), 2 of them read per CSA query, 2 streams; 8 experts of 32, 2 per token, the first three layers routed by
    their token tables (as the published models), the last by its scores."""
    return DeepseekV4Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        vocab_size=0,
        max_seq_len=2048,
        head_dim=32,
        rotary_dim=8,
        q_lora_rank=32,
        layer_types=(SLIDING, CSA, HCA, CSA),
        sliding_window=8,
        csa_rate=2,
        hca_rate=4,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        hc_mult=2,
        hc_sinkhorn_iters=4,
    )


def debug_dense() -> DeepseekV4Args:
    """The debug model with dense attention: every layer a sliding one whose window (2^20 positions) holds every
    sequence, no compressed blocks; what the compressed layers are measured against (BENCHMARKS.md)."""
    return dataclasses.replace(debug(), layer_types=(SLIDING,) * 4, sliding_window=1 << 20)


FLAVORS = {"debug": debug(), "debug_dense": debug_dense()}


def with_depth(args: DeepseekV4Args, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer kinds and the hash-routed layers that still exist."""
    kinds = (args.layer_types * (n_layers // len(args.layer_types) + 1))[:n_layers]
    return {"n_layers": n_layers, "layer_types": kinds, "moe": args.moe.at_depth(n_layers)}


# The published sizes, from deepseek-ai/DeepSeek-V4-Flash's and deepseek-ai/DeepSeek-V4-Pro's config.json: 129,280
# tokens, 1,048,576 positions, heads of 512 (64 rotating), one shared expert beside 6 routed per token, SwiGLUs
# clamped at 10, sqrt(softplus) scores, the first 3 layers hash-routed, a window of 128, blocks of 4 (CSA) and 128
# (HCA), 4 streams and 20 Sinkhorn iterations; the compressed layers' YaRN stretches the 65,536 positions trained on
# 16 times at base 160,000 without scaling cos and sin (their rope_scaling names no attention_factor, which
# transformers then fills with 1.0), the sliding layers' RoPE plain at 10,000. Both folders hold one multi-token
# prediction layer (sliding), which transformers does not count: the flavors leave it out, as model.mtp_layers = 1
# adds it.
def _v4_yarn() -> YarnRopeScaling:
    return YarnRopeScaling(factor=16.0, original_max_position_embeddings=65536, attention_factor=1.0)


def deepseek_v4_flash() -> DeepseekV4Args:
    """deepseek-ai/DeepSeek-V4-Flash (and -Base), transformers' DeepseekV4Config defaults but the layer kinds: 43
    layers of dim 4096 (two sliding, then CSA and HCA alternating from CSA), 64 heads, query rank 1024, output in 8
    groups of rank 1024; an indexer of 64 heads of 128 reading 512 blocks; 256 experts of 2048, scale 1.5."""
    return DeepseekV4Args(
        dim=4096,
        n_layers=43,
        n_heads=64,
        vocab_size=129280,
        max_seq_len=1048576,
        q_lora_rank=1024,
        rope_scaling=_v4_yarn(),
        layer_types=(SLIDING, SLIDING) + tuple(HCA if i % 2 else CSA for i in range(41)),
        o_groups=8,
        index_topk=512,
        moe=v4_moe(n_experts=256, top_k=6, expert_dim=2048, route_scale=1.5, hash_layers=(0, 1, 2), swiglu_limit=10.0),
    )


def deepseek_v4_pro() -> DeepseekV4Args:
    """deepseek-ai/DeepSeek-V4-Pro: 61 layers of dim 7168 (two HCA, then CSA and HCA alternating from CSA), 128
    heads, query rank 1536, output in 16 groups of rank 1024; an indexer of 64 heads of 128 reading 1024 blocks; 384
    experts of 3072, scale 2.5."""
    return DeepseekV4Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        max_seq_len=1048576,
        q_lora_rank=1536,
        rope_scaling=_v4_yarn(),
        layer_types=(HCA, HCA) + tuple(HCA if i % 2 else CSA for i in range(59)),
        o_groups=16,
        index_topk=1024,
        moe=v4_moe(n_experts=384, top_k=6, expert_dim=3072, route_scale=2.5, hash_layers=(0, 1, 2), swiglu_limit=10.0),
    )


FLAVORS["deepseek_v4_flash"] = deepseek_v4_flash()
FLAVORS["deepseek_v4_pro"] = deepseek_v4_pro()
