"""The relu2 module: titanlite's model interface (titanlite.models.common.interface.Decoder), no parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.models.common.attention import build_core
from titanlite.models.common.auxiliary import add_auxiliary_loss
from titanlite.models.common.head import OutputHead


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.core = build_core("sdpa")

    def forward(self, x, cache=None, sequence=None):
        bsz, seqlen, _ = x.shape
        q, k, v = (w(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = self.core(q, k, v, sequence) if cache is None else cache.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square())


class Block(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.act_l2 = args.act_l2

    def forward(self, x, cache=None, sequence=None):
        h = x + self.attention(self.attention_norm(x), cache=cache, sequence=sequence)
        out = h + self.feed_forward(self.ffn_norm(h))
        if self.act_l2:  # an auxiliary loss term, as a mixture of experts adds its load-balancing loss
            out = add_auxiliary_loss(out, "act_l2", self.act_l2 * out.float().pow(2).mean())
        return out


class Relu2(nn.Module):
    first_stage_modules = ("tok_embeddings", "pos_embeddings")
    last_stage_modules = ("norm", "output")

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size)

    def tie_weights(self) -> None:
        """Untied: nothing to re-tie."""

    def init_buffers(self) -> None:
        """No buffers."""

    def forward(self, tokens, cache=None, sequence=None, *, logits=True):
        if self.tok_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            if cache is not None:
                pos = cache.positions(tokens.shape[1], tokens.device)
            elif sequence is not None and sequence.positions is not None:
                pos = sequence.positions
            h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        else:
            h = tokens
        for name, layer in self.layers.items():
            h = layer(h, cache=None if cache is None else cache.layer(name), sequence=sequence)
        if cache is not None:
            cache.advance(tokens.shape[1])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h, project=logits) if self.output is not None else h

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        parent = name.rpartition(".")[0].rpartition(".")[2]
        if parent in ("attention_norm", "ffn_norm", "norm"):
            nn.init.ones_(full)
        else:
            std = 0.02 / (2 * self.args.n_layers) ** 0.5 if parent in ("wo", "w2") else 0.02
            nn.init.normal_(full, mean=0.0, std=std, generator=generator)


def flops_per_token(model: Relu2, seq_len: int) -> float:
    """relu2's own FLOP count (its spec's `flops`), matmul by matmul: per layer Q, K, V, O (4 d^2) and the MLP's two
    projections (2 x 4 d^2), plus the output projection (d x vocab), 6 FLOPs per weight for forward and backward;
    attention's QK^T and AV at half of the full T x T, since the mask is causal (the dense formula counts all)."""
    a = model.args
    weights = a.n_layers * (4 * a.dim * a.dim + 2 * a.dim * a.ffn_dim) + a.dim * a.vocab_size
    return 6.0 * weights + 6.0 * a.n_layers * a.dim * seq_len
