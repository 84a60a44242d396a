"""The shared decoder's arguments, torch-free (titanlite/models/common/decoder.py builds them): the shape and the
switches most families set (biases, Q/K norms, norm placement, NoPE layers, windows, per-layer kinds and their
own rotary settings), and the helpers that read them. A family's folder sets them, or extends the dataclass with
what only it has. TransformerArgs: what the decoder reads of any family's arguments, DecoderArgs' or not."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.rope_args import LayerRope, Llama3RopeScaling, YarnRopeScaling
from titanlite.models.spec import not_math

QK_NORMS = ("none", "head", "full")
NORM_POSITIONS = ("pre", "post")
# The layer kinds these arguments build (Transformer.mixers in titanlite/models/common/decoder.py).
LAYER_KINDS = ("full_attention", "sliding_attention")


class TransformerArgs(Protocol):
    """What the shared decoder (titanlite/models/common/decoder.py Transformer) reads of a family's arguments, the
    one contract every family's arguments meet: mypy holds each family's module to it through its `args`
    annotation. Read-only, so a dataclass field, a property and a class attribute meet a member alike; a family
    without the switches (from `moe` on) takes TransformerDefaults' values."""

    @property
    def dim(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def layer_types(self) -> tuple[str, ...]: ...
    @property
    def moe(self) -> MoEArgs | None: ...
    @property
    def mtp_layers(self) -> int: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def norm_position(self) -> str: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> Llama3RopeScaling | YarnRopeScaling | None: ...
    @property
    def rotary_dim(self) -> int: ...
    @property
    def layer_rope(self) -> Mapping[str, LayerRope]: ...
    @property
    def sliding_window(self) -> int: ...


class TransformerDefaults:
    """TransformerArgs' switches at the values of a family that has none of them: no mixture of experts, no
    multi-token prediction, a SwiGLU without biases, pre-norm blocks, one rotary table over whole heads at
    rope_theta, no window. A base of a family's arguments: class attributes, not dataclass fields, so a family
    gains no field by them (its config.json and checkpoints stay its own). A field of the same name replaces one;
    it must give a default of its own, or a dataclass would take the class attribute's."""

    moe: MoEArgs | None = None
    mtp_layers: int = 0
    mlp_bias: bool = False
    norm_position: str = "pre"
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    rotary_dim: int = 0
    """0: the whole head (head_dim)."""
    layer_rope: Mapping[str, LayerRope] = MappingProxyType({})
    sliding_window: int = 0


@dataclass
class DecoderArgs(TransformerDefaults):
    """The shared decoder (titanlite/models/common/decoder.py): its shape and the switches families set on it."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = not_math()
    max_seq_len: int = not_math(2048)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0
    """Width of each attention head; 0 means dim // n_heads (some families set it, e.g. 128)."""
    rotary_dim: int = 0
    """Partial rotary: the leading rotary_dim channels of each head rotate, at frequencies theta^(-2i / rotary_dim),
    and the rest pass unchanged (config.json's head_dim x partial_rotary_factor: GLM-4.5, MiniMax-M2, Qwen3.5); an
    even number up to head_dim. 0 or head_dim: the whole head (0 is set to head_dim). A layer kind's own
    `layer_rope` rotary_dim, where it names one, overrides it for that kind's layers."""
    rope_scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    """RoPE frequency scaling: Llama 3.1's, or YaRN (titanlite/models/common/rope_args.py); None: plain RoPE."""
    family: str = not_math("")
    """The model.name (registered spec) this shape belongs to: its Hugging Face config.json, plan and sizes."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (and every family's attention_bias)."""
    out_bias: bool = False
    """A bias on the attention's output projection (attention_bias)."""
    mlp_bias: bool = False
    """Biases on the three projections of the SwiGLU feed-forward (Llama's mlp_bias)."""
    qk_norm: str = "none"
    """RMSNorm of queries and keys before RoPE: "head" normalises each head on its own, with one weight of
    head_dim shared by the heads; "full" each token's whole query and key projection."""
    norm_position: str = "pre"
    """"pre": each sublayer normalises its input (Llama); "post": each normalises its output, before the
    residual add, and the blocks have no input norms."""
    nope_layers: tuple[int, ...] = ()
    """Layers that apply no rotary position embedding (NoPE)."""
    sliding_window: int = 0
    """Sliding-window attention (0: none): a query of a sliding layer sees only the keys fewer than
    sliding_window positions before it, itself included (Mistral, Qwen2 with use_sliding_window)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "sliding_attention" or "full_attention" (config.json's layer_types); empty: every layer slides
    when sliding_window is set. A family whose arguments name more kinds (`layer_kinds`) builds them itself."""
    layer_rope: dict[str, LayerRope] = field(default_factory=dict)
    """Rotary settings of their own for the layers of a kind ("full_attention", "sliding_attention", as
    `rope_kind` names a layer's): theta, scaling, rotated channels (titanlite/models/common/rope_args.py
    LayerRope); config.json's rope_parameters keyed by layer type (decoder_config.layer_rope_from_hf). A kind not
    listed takes rope_theta and rope_scaling over whole heads. E.g. OLMo 3's YaRN on its full layers only."""

    layer_kinds: ClassVar[tuple[str, ...]] = LAYER_KINDS
    """The layer kinds these arguments build (a family's subclass adds its own mixers' kinds)."""

    def __post_init__(self) -> None:
        if not self.family:
            raise ValueError("DecoderArgs.family is empty; name the model.name (spec) this shape belongs to")
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if not 0 < self.rotary_dim <= self.head_dim or (self.rotary_dim < self.head_dim and self.rotary_dim % 2):
            raise ValueError(
                f"{type(self).__name__}.rotary_dim={self.rotary_dim}; use an even number up to head_dim={self.head_dim}"
            )
        self.nope_layers = tuple(self.nope_layers)
        self.layer_types = tuple(self.layer_types)
        unknown = sorted(set(self.layer_types) - set(self.layer_kinds))
        if unknown:
            kinds = ", ".join(self.layer_kinds)
            raise ValueError(f"{type(self).__name__}.layer_types has {unknown[0]!r}; its layer kinds are {kinds}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"DecoderArgs.layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        self.layer_rope = {kind: as_layer_rope(rope) for kind, rope in self.layer_rope.items()}
        for kind, rope in self.layer_rope.items():
            if kind not in LAYER_KINDS:
                raise ValueError(f"DecoderArgs.layer_rope has {kind!r}; name one of {', '.join(LAYER_KINDS)}")
            if rope.rotary_dim > self.head_dim:
                raise ValueError(f"DecoderArgs.layer_rope[{kind!r}].rotary_dim={rope.rotary_dim} > head_dim")
        for name, value, allowed in (
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("norm_position", self.norm_position, NORM_POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"DecoderArgs.{name}={value!r}; use one of {', '.join(allowed)}")


def as_layer_rope(value: LayerRope | dict) -> LayerRope:
    """A LayerRope, or the dict dataclasses.asdict made of one, as a LayerRope."""
    if isinstance(value, LayerRope):
        return value
    fields = dict(value)
    scaling = fields.get("scaling")
    if isinstance(scaling, dict):
        fields["scaling"] = (YarnRopeScaling if "beta_fast" in scaling else Llama3RopeScaling)(**scaling)
    return LayerRope(**fields)


def every(interval: int, n_layers: int) -> tuple[int, ...]:
    """Layer indices i with (i + 1) % interval == 0 (a NoPE pattern such as no_rope_layer_interval's)."""
    return tuple(i for i in range(n_layers) if (i + 1) % interval == 0)


def sizes(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int) -> dict[str, Any]:
    """A flavor's sizes as its arguments' keywords: the width, the depth, the query and key/value heads, the MLP's
    width (a mixture's experts': MoEDecoderArgs.ffn_dim)."""
    return {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "ffn_dim": ffn_dim}


# The debug flavors' sizes: dim 64, 4 layers, 4 heads (2 for keys and values), an MLP of 192; vocab_size 0, the
# tokenizer's, padded.
DEBUG_SIZES: dict[str, Any] = sizes(64, 4, 4, 2, 192) | {"vocab_size": 0}


def debug(family: str, **switches) -> DecoderArgs:
    """A tiny decoder of `family` for tests and CPU runs: DEBUG_SIZES, and `switches` (sizes too) over them."""
    return DecoderArgs(**(DEBUG_SIZES | switches), family=family)


def tp_split_sizes(args: DecoderArgs) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: query and key/value heads, the MLP width, the vocabulary."""
    return {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "ffn_dim": args.ffn_dim,
        "vocab_size": args.vocab_size,
    }


def with_depth(args: DecoderArgs, n_layers: int) -> dict:
    """The fields that change with model.n_layers: the depth, and a NoPE pattern kept at the new depth."""
    depth: dict = {"n_layers": n_layers}
    if args.nope_layers:
        depth["nope_layers"] = every(args.nope_layers[0] + 1, n_layers)
    return depth


def kind_of(args: TransformerArgs, layer: int) -> str:
    """Layer `layer`'s kind: its layer_types entry; "full_attention" without layer_types, and for a layer past them (a
    multi-token prediction depth's block: models/common/multi_token.py), which attends to the whole sequence."""
    kinds = args.layer_types
    return kinds[layer] if layer < len(kinds) else "full_attention"


def window_of(args: DecoderArgs, layer: int) -> int | None:
    """The attention window of layer `layer` (None: full causal attention)."""
    if not args.sliding_window:
        return None
    if args.layer_types and kind_of(args, layer) != "sliding_attention":
        return None
    return args.sliding_window


def rope_kind(args: TransformerArgs, layer: int) -> str:
    """The layer kind whose rotary settings `layer` takes: its layer_types entry, or, without layer_types,
    "sliding_attention" when every layer slides (sliding_window set) and "full_attention" otherwise."""
    if args.layer_types:
        return kind_of(args, layer)
    return "sliding_attention" if args.sliding_window else "full_attention"


def layer_rope_of(args: TransformerArgs, layer: int) -> LayerRope:
    """The rotary settings of `layer`: its kind's own (args.layer_rope), or the shared rope_theta and rope_scaling
    over whole heads."""
    own = args.layer_rope.get(rope_kind(args, layer))
    return own if own is not None else LayerRope(args.rope_theta, args.rope_scaling)


def rotary_dim_of(args: TransformerArgs, layer: int) -> int:
    """The leading channels of each head that `layer` rotates: its kind's own (args.layer_rope rotary_dim, where it
    names one), else args.rotary_dim (the whole head unless set)."""
    own = args.layer_rope.get(rope_kind(args, layer))
    if own is not None and own.rotary_dim:
        return own.rotary_dim
    return args.rotary_dim or args.head_dim


def _debug_moe() -> MoEArgs:
    return MoEArgs(n_experts=8, top_k=2, expert_dim=32, norm_topk_prob=True, dense_layers=(1,))


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """The Llama decoder (ffn_dim: the width of the dense layers' feed-forward, config.json intermediate_size)
    whose blocks hold `moe` instead of the dense feed-forward, except at moe.dense_layers."""

    moe: MoEArgs = field(default_factory=_debug_moe)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.moe.check_depth(self.n_layers)


class WithExperts(TransformerArgs, Protocol):
    """The arguments of a family whose blocks hold mixtures of experts (MoEDecoderArgs', DeepSeek-V3's, ...)."""

    @property
    def moe(self) -> MoEArgs: ...


def moe_with_depth(args: WithExperts, n_layers: int) -> dict:
    """model.n_layers: the depth, keeping the dense layers that still exist."""
    return {"n_layers": n_layers, "moe": args.moe.at_depth(n_layers)}


def moe_split_sizes(args: MoEDecoderArgs) -> dict[str, int]:
    return tp_split_sizes(args)


def moe_auxiliary_losses(args: WithExperts) -> tuple[str, ...]:
    names = ("load_balance",) if args.moe.balance == "aux_loss" and args.moe.aux_loss_coef > 0 else ()
    return names + (("router_z",) if args.moe.z_loss_coef > 0 else ())


if TYPE_CHECKING:  # mypy holds the shared arguments to the decoder's contract (a family's own: its module's `args`)

    def _meets_the_contract(args: DecoderArgs) -> TransformerArgs:
        return args
