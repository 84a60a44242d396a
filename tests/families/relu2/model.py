"""The relu2 module: the shared decoder (titanlite.models.common.decoder.Transformer) with relu2's own layers: its
attention (learned positions, so no rotations), a squared-ReLU MLP, and a second mixer kind of its own, "shift" (a
toy token-shift mixer), mixed per layer by the flavor's layer_types. No parallelism inside, no edit in titanlite/."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.decoder import Block, Transformer
from titanlite.models.common.init_scheme import InitScheme, NormalInit, start_linears
from titanlite.models.common.mixers import Attention


class TokenShift(nn.Module):
    """A toy sequence mixer: y_t = wo(wa x_t + wb x_{t-1}), x_{t-1} zero at the start of each sequence and of each
    document (block-causal masking: `sequence.documents`). Under tensor parallelism wa and wb split column-wise and
    wo row-wise, as an MLP's. It keeps no state for generation."""

    def __init__(self, dim: int):
        super().__init__()
        self.wa = nn.Linear(dim, dim, bias=False)
        self.wb = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cache=None, sequence=None):
        if cache is not None:
            raise ValueError("relu2's shift layers keep no generation state; generate with a flavor without them")
        previous = F.pad(x, (0, 0, 1, 0))[:, :-1]  # [B, T, D]: x_{t-1}, zeros at t = 0
        if sequence is not None and sequence.documents is not None:
            docs = sequence.documents
            same = torch.ones_like(docs, dtype=torch.bool)
            same[:, 1:] = docs[:, 1:] == docs[:, :-1]  # the previous token is of the same document
            previous = previous * same[..., None].to(x.dtype)
        return self.wo(self.wa(x) + self.wb(previous))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("wa", "wb"), outputs=("wo",))


class SquaredReLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square())

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("w1",), outputs=("w2",))


class AuxBlock(Block):
    """The shared block, adding act_l2 * mean(h^2) of its output to the training loss (as a mixture of experts adds
    its load-balancing term) when the flavor sets act_l2."""

    act_l2: float = 0.0

    def forward(self, x, cos=None, sin=None, cache=None, sequence=None):
        out = super().forward(x, cos, sin, cache=cache, sequence=sequence)
        if self.act_l2:
            out = add_auxiliary_loss(out, "act_l2", self.act_l2 * out.float().pow(2).mean())
        return out


def attention(model, layer: int) -> nn.Module:
    a = model.args
    return Attention(a.dim, a.n_heads, a.n_heads, a.head_dim, rotary=False)


def shift(model, layer: int) -> nn.Module:
    return TokenShift(model.args.dim)


class Relu2(Transformer):
    first_stage_modules = ("tok_embeddings", "pos_embeddings")
    learned_positions = True
    mixers = {"attention": attention, "shift": shift}

    def layer_kind(self, layer: int) -> str:
        return self.args.layer_types[layer] if self.args.layer_types else "attention"

    def build_layer(self, layer: int) -> Block:
        block = AuxBlock(self.build_mixer(layer), self.build_feed_forward(layer), self.build_norm, rotary=False)
        block.act_l2 = self.args.act_l2
        return block

    def build_feed_forward(self, layer: int) -> nn.Module:
        return SquaredReLU(self.args.dim, self.args.ffn_dim)

    def rotary_tables(self) -> dict:
        return {}  # learned positions

    def init_scheme(self) -> InitScheme:
        """Plain normal draws, std 0.02 (the head and the positions too), the residual-side projections scaled down."""
        return NormalInit(self.args.n_layers, self.args.dim, self.args.tie_embeddings)


def flops_per_token(model: Relu2, seq_len: int) -> float:
    """relu2's own FLOP count (its spec's `flops`), matmul by matmul: per attention layer Q, K, V, O (4 d^2), per
    shift layer its three projections (3 d^2), per layer the MLP's two projections (2 x 4 d^2), plus the output
    projection (d x vocab), 6 FLOPs per weight for forward and backward; attention's QK^T and AV at half of the full
    T x T, since the mask is causal (the dense formula counts all)."""
    a = model.args
    kinds = [model.layer_kind(i) for i in range(a.n_layers)]
    mixing = sum(4 if kind == "attention" else 3 for kind in kinds) * a.dim * a.dim
    weights = mixing + a.n_layers * 2 * a.dim * a.ffn_dim + a.dim * a.vocab_size
    return 6.0 * weights + 6.0 * kinds.count("attention") * a.dim * seq_len
