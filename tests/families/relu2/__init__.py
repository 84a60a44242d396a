"""relu2: a model family defined entirely outside titanlite, registered when this module is imported
(`--model.custom_import tests.families.relu2`). A decoder with learned positions, RMSNorm, bias-free
projections and a squared-ReLU MLP; untied embeddings; at flavor debug_aux, an auxiliary loss on the activations.
Its torch halves are model.py and parallelize.py."""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.models.registry import register
from titanlite.models.spec import ModelSpec


@dataclass
class Relu2Args:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    max_seq_len: int = 256
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    act_l2: float = 0.0  # > 0: an auxiliary loss act_l2 * mean(h^2) on each block's output (models/common/auxiliary.py)
    family: str = "relu2"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return 4 * self.dim


SPEC = ModelSpec(
    name="relu2",
    args_type=Relu2Args,
    flavors={
        "debug": Relu2Args(dim=64, n_layers=3, n_heads=4, vocab_size=0),
        "debug_aux": Relu2Args(dim=64, n_layers=3, n_heads=4, vocab_size=0, act_l2=0.05),
    },
    model="tests.families.relu2.model:Relu2",
    tp_plan="tests.families.relu2.parallelize:tp_plan",
    hf_weights="",
    tp_split_sizes=lambda a: {"n_heads": a.n_heads, "ffn_dim": a.ffn_dim, "vocab_size": a.vocab_size},
    flops="tests.families.relu2.model:flops_per_token",
    auxiliary_losses=lambda a: ("act_l2",) if a.act_l2 else (),
    learned_positions=True,
    description="a test family: learned positions, RMSNorm, squared-ReLU MLP",
)
register(SPEC)
