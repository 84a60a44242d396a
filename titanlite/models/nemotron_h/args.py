"""Nemotron-H's arguments, torch-free: the shared decoder's with Mamba-2 layers (Mamba2Args,
titanlite/models/common/mamba2_args.py), each layer one sublayer behind its own pre-norm, as `layer_types` says:
a Mamba-2 mixer, attention without positions, a relu^2 MLP; the published sizes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from titanlite.models.common.mamba2_args import Mamba2Args
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.spec import not_math

LAYER_KINDS = ("mamba", "full_attention", "mlp", "moe")
# hybrid_override_pattern's characters -> our layer kinds (and back)
PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def layers_of(pattern: str) -> tuple[str, ...]:
    """The layer kinds of a hybrid_override_pattern such as "M-M*-" (a ValueError naming a character it does not
    know and those it does)."""
    unknown = sorted(set(pattern) - set(PATTERN))
    if unknown:
        raise ValueError(f"pattern character {unknown[0]!r}; Nemotron-H's are {', '.join(PATTERN)}")
    return tuple(PATTERN[c] for c in pattern)


def pattern_of(layer_types: tuple[str, ...]) -> str:
    mark = {kind: c for c, kind in PATTERN.items()}
    return "".join(mark[kind] for kind in layer_types)


@dataclass
class NemotronHArgs(Mamba2Args):
    """Nemotron-H's decoder (titanlite/models/nemotron_h/model.py): n_layers layers, each of `layer_types`' kind
    ("mamba": a Mamba-2 mixer; "full_attention": grouped-query attention with no rotations, the causal order its only
    positions; "mlp": up and down projections around relu^2, of width ffn_dim; "moe": the mixture of experts `moe`,
    relu^2 experts without gates, sigmoid routing with routing biases, a shared expert, and with moe.latent_dim the
    experts in a smaller width: Nemotron 3's LatentMoE), each behind its own RMSNorm and inside a residual add."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    family: str = not_math("nemotron_h")
    norm_eps: float = 1e-5
    dt_min: float = 0.001  # transformers' mixer clamps the step below at time_step_min
    moe: MoEArgs | None = None
    """The "moe" layers' block (None: the model has none); its dense_layers are the other layers, set here."""
    mtp_layers: int = 0
    """Multi-token prediction depths (num_nextn_predict_layers; Nemotron 3 Super's: 0 or 1): a depth is attention then
    the mixture of experts, each behind its pre-norm (mtp_hybrid_override_pattern "*E"), between DeepSeek's fusion
    of the embeddings ahead with the hidden states and a final norm (models/common/multi_token.py)."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = layers_of("M-M*-" * (self.n_layers // 5) + "M-M*-"[: self.n_layers % 5])
        super().__post_init__()
        if ("moe" in self.layer_types) != (self.moe is not None):
            raise ValueError("NemotronHArgs: moe is given exactly when layer_types has moe layers")
        if self.moe is not None:
            others = tuple(i for i, kind in enumerate(self.layer_types) if kind != "moe")
            self.moe = dataclasses.replace(self.moe, dense_layers=others)
        if self.mtp_layers not in (0, 1) or (self.mtp_layers and self.moe is None):
            raise ValueError(
                f"NemotronHArgs.mtp_layers={self.mtp_layers}; Nemotron's multi-token prediction has 0 or 1 depth, "
                "of attention and the mixture of experts (a model with moe layers)"
            )
        if self.qkv_bias or self.out_bias or self.qk_norm != "none" or self.norm_position != "pre":
            raise ValueError("NemotronHArgs: no attention biases or Q/K norms; pre-norm layers")
        if self.sliding_window or self.nope_layers:
            raise ValueError("NemotronHArgs: its attention has no window and no rotations to turn off")


def with_depth(args: NemotronHArgs, n_layers: int) -> dict:
    """model.n_layers: the depth, the pattern repeated (or cut) to it."""
    pattern = pattern_of(args.layer_types)
    kinds = layers_of((pattern * math.ceil(n_layers / len(pattern)))[:n_layers])
    return {"n_layers": n_layers, "layer_types": kinds, "moe": args.moe if "moe" in kinds else None}


# The published Nemotron-H-8B-Base-8K (Nemotron-H v0.1): 52 layers, 24 Mamba-2, 4 attention and 24 MLP, in this order
# (the hybrid_override_pattern of its config.json, which Megatron-Bridge and vLLM take as their defaults).
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
# The debug flavors' sizes: dim 64, six layers, 4 attention heads over 2 key/value heads, an MLP of 128, 8 Mamba heads
# of 8 in 2 groups over a state of 16, scanned in chunks of 16; vocab_size 0, the tokenizer's, padded.
DEBUG_SHAPE: dict[str, Any] = dict(
    dim=64,
    n_layers=6,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    vocab_size=0,
    max_seq_len=2048,
    mamba_heads=8,
    mamba_head_dim=8,
    mamba_groups=2,
    state_dim=16,
    mamba_chunk_size=16,
)
FLAVORS = {
    # Tiny, for tests and CPU runs: every kind of layer, grouped B and C, grouped key/value heads.
    "debug": NemotronHArgs(
        **DEBUG_SHAPE,
        layer_types=layers_of("M-M*-M"),
    ),
    # The debug model's all-attention cut: the same six layers, each Mamba-2 layer an attention layer (a baseline).
    "debug_attention": NemotronHArgs(
        **DEBUG_SHAPE,
        layer_types=layers_of("*-**-*"),
    ),
    # Tiny, with mixture-of-experts layers (relu^2 experts in a latent width, a shared expert, grouped routing).
    "debug_moe": NemotronHArgs(
        **DEBUG_SHAPE,
        layer_types=layers_of("ME*EM-"),
        moe=MoEArgs(
            n_experts=8,
            top_k=2,
            expert_dim=32,
            score_func="sigmoid",
            norm_topk_prob=True,
            route_scale=2.5,
            shared_expert_dim=48,
            balance="bias",
            n_groups=2,
            topk_groups=1,
            activation="relu2",
            latent_dim=32,
        ),  # fmt: skip
    ),
    "nemotron_h_8b": NemotronHArgs(
        dim=4096,
        n_layers=len(NEMOTRON_H_8B_PATTERN),
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=21504,
        vocab_size=131072,
        max_seq_len=8192,
        layer_types=layers_of(NEMOTRON_H_8B_PATTERN),
        mamba_heads=128,
        mamba_head_dim=64,
        mamba_groups=8,
        state_dim=128,
    ),
    # NVIDIA-Nemotron-3-Nano-30B-A3B: 23 Mamba-2, 23 MoE (128 relu^2 experts, 6 a token, one shared of twice their
    # width, weights scaled by 2.5) and 6 attention layers (Megatron-Bridge's Nemotron3NanoProvider sizes).
    "nemotron3_nano_30b_a3b": NemotronHArgs(
        dim=2688,
        n_layers=52,
        n_heads=32,
        n_kv_heads=2,
        head_dim=128,
        ffn_dim=1856,
        vocab_size=131072,
        max_seq_len=262144,
        layer_types=layers_of("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
        mamba_heads=64,
        mamba_head_dim=64,
        mamba_groups=8,
        state_dim=128,
        moe=MoEArgs(
            n_experts=128,
            top_k=6,
            expert_dim=1856,
            score_func="sigmoid",
            norm_topk_prob=True,
            route_scale=2.5,
            shared_expert_dim=3712,
            balance="bias",
            activation="relu2",
        ),  # fmt: skip
    ),
}
