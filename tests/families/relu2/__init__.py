"""relu2: a model family defined entirely outside titanlite, registered when this module is imported
(`--model.custom_import tests.families.relu2`). The shared decoder with learned positions, RMSNorm, bias-free
projections and a squared-ReLU MLP; untied embeddings; at flavor debug_aux, an auxiliary loss on the activations;
at flavor hybrid, its own second mixer kind ("shift", a toy token-shift mixer) between attention layers
(layer_types). Its torch halves are model.py and parallelize.py."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.common.decoder_args import TransformerDefaults
from titanlite.models.registry import register
from titanlite.models.spec import ModelSpec


@dataclass
class Relu2Args(TransformerDefaults):  # the shared decoder's switches it does not set (no experts, pre-norm, ...)
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int = 256
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    act_l2: float = 0.0  # > 0: an auxiliary loss act_l2 * mean(h^2) on each block's output (models/common/auxiliary.py)
    layer_types: tuple[str, ...] = ()  # per layer "attention" or "shift" (model.py); empty: every layer attends
    family: str = "relu2"

    def __post_init__(self) -> None:
        kinds = ("attention", "shift")
        unknown = [kind for kind in self.layer_types if kind not in kinds]
        if unknown:
            raise ValueError(f"Relu2Args.layer_types has {unknown[0]!r}; relu2 knows {', '.join(kinds)}")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"Relu2Args.layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return 4 * self.dim


def with_depth(args: Relu2Args, n_layers: int) -> dict:
    """model.n_layers: the depth, the layer kinds' pattern repeated to it."""
    kinds = args.layer_types
    return {"n_layers": n_layers, "layer_types": tuple(kinds[i % len(kinds)] for i in range(n_layers)) if kinds else ()}


SPEC = ModelSpec(
    name="relu2",
    args_type=Relu2Args,
    flavors={
        "debug": Relu2Args(dim=64, n_layers=3, n_heads=4, vocab_size=0),
        "debug_aux": Relu2Args(dim=64, n_layers=3, n_heads=4, vocab_size=0, act_l2=0.05),
        "hybrid": Relu2Args(dim=64, n_layers=4, n_heads=4, vocab_size=0, layer_types=("shift", "attention") * 2),
    },
    model="tests.families.relu2.model:Relu2",
    tp_plan="tests.families.relu2.parallelize:tp_plan",
    hf_weights="",
    tp_split_sizes=lambda a: {"n_heads": a.n_heads, "dim": a.dim, "ffn_dim": a.ffn_dim, "vocab_size": a.vocab_size},
    with_depth=with_depth,
    flops="tests.families.relu2.model:flops_per_token",
    auxiliary_losses=lambda a: ("act_l2",) if a.act_l2 else (),
    learned_positions=True,
    description="a test family: learned positions, RMSNorm, squared-ReLU MLP",
)
register(SPEC)
