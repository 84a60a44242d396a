"""Gemma 4's text decoder on the shared decoder (titanlite/models/common/decoder.py). Each block: attention between
a norm before and one after it; a GELU-tanh gated MLP between its norms, and in the mixture-of-experts models the
experts beside it (routed on the block's residual stream, their own norms around them, the two outputs added before
the post-feed-forward norm); then, with per-layer embeddings, a gated projection of the layer's per-layer input;
then the block's output times its `layer_scalar` (a checkpointed buffer, as in transformers).

Attention: per-head Q/K norms and a weightless value norm, scores unscaled; sliding layers rotate whole heads of
head_dim (rope_local_theta), full layers heads of global_head_dim by proportional RoPE (the leading rotated_pairs
frequencies of rope_theta over global_head_dim, the rest zero). Rotation pairs each head's halves (i, i + hd/2), as
Hugging Face's weights are laid out, so no row is reordered on import: with keys equal to values (k_eq_v) the values
are the unrotated key projection, which a reordering would scramble. The last kv_shared_layers layers take the keys
and values of the last earlier layer of their kind (handed on through a SharedKV the forward makes).

Norms multiply by their weight (ones at init; Gemma 3's added one), in float32 (models/common/norms.py
Float32RMSNorm). The per-layer inputs and the SharedKV reach the blocks through the shared decoder's layer_inputs.
The logits are softcapped; the chunked loss, which applies the head itself, cannot cap them, so such a model asks for
the whole logits. No parallelism inside."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from titanlite.base.errors import ConfigError
from titanlite.models.common.attention import Sequence, attend, build_core
from titanlite.models.common.decoder import Block, Transformer
from titanlite.models.common.feed_forward import GatedMLP, gelu_tanh
from titanlite.models.common.flops import moe_flops_per_token, sequence_flops_per_token
from titanlite.models.common.head import OutputHead
from titanlite.models.common.init_scheme import InitScheme, start_linears
from titanlite.models.common.interface import Decoder, DecoderModule
from titanlite.models.common.kv_cache import LayerCache
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.moe.layer import GroupedExperts, MoE, Router, Routing
from titanlite.models.common.norms import Float32RMSNorm
from titanlite.models.common.rope import RotaryTable, apply_rope_halves
from titanlite.models.gemma4.args import Gemma4Args


class SharedKV:
    """The keys and values a forward's storing layers hand to the layers that reuse them, by layer kind. A plain
    holder, not a dict: FSDP's forward hooks copy the containers among a block's arguments."""

    def __init__(self) -> None:
        self.by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


class Gemma4Attention(nn.Module):
    """Grouped-query attention of n_heads query heads over n_kv_heads key/value heads of head_dim. `kv`: "own",
    "store" (hand keys and values on under `kind`), "reuse" (no key or value projections: take them)."""

    def __init__(self, args: Gemma4Args, layer: int):
        super().__init__()
        a = args
        head_dim, n_kv_heads = a.attention_shape(layer)
        self.head_dim, self.kind, self.kv = head_dim, a.kinds()[layer], a.kv_mode(layer)
        self.wq = nn.Linear(a.dim, a.n_heads * head_dim, bias=a.qkv_bias)
        self.q_norm = Float32RMSNorm(head_dim, a.norm_eps)
        self.wk: nn.Linear | None = None
        self.wv: nn.Linear | None = None
        if self.kv != "reuse":
            self.wk = nn.Linear(a.dim, n_kv_heads * head_dim, bias=a.qkv_bias)
            if not (a.k_eq_v and self.kind == "full_attention"):
                self.wv = nn.Linear(a.dim, n_kv_heads * head_dim, bias=a.qkv_bias)
            self.k_norm = Float32RMSNorm(head_dim, a.norm_eps)
            self.v_norm = Float32RMSNorm(head_dim, a.norm_eps, scale=False)
        self.wo = nn.Linear(a.n_heads * head_dim, a.dim, bias=a.out_bias)
        window = a.sliding_window if self.kind == "sliding_attention" and a.sliding_window else None
        self.core = build_core("sdpa", window=window, scale=1.0)  # context parallelism wraps it

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
        shared: SharedKV | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        cos, sin = cos[:seqlen], sin[:seqlen]  # the full tables come in (sequence parallelism cuts x, not them)
        # -1 heads: under tensor parallelism the local head counts follow from the sharded weights.
        q = apply_rope_halves(self.q_norm(self.wq(x).view(bsz, seqlen, -1, self.head_dim)), cos, sin).transpose(1, 2)
        if self.kv == "reuse":
            if shared is None or self.kind not in shared.by_kind:
                raise ValueError(f"a {self.kind} layer that reuses keys and values got none to reuse")
            k, v = shared.by_kind[self.kind]
        else:
            assert self.wk is not None
            keys = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
            values = keys if self.wv is None else self.wv(x).view(bsz, seqlen, -1, self.head_dim)
            k = apply_rope_halves(self.k_norm(keys), cos, sin).transpose(1, 2)  # [B, Hkv, T, hd]
            v = self.v_norm(values).transpose(1, 2)
            if self.kv == "store" and shared is not None:
                shared.by_kind[self.kind] = (k, v)
        # A reusing layer keeps the keys and values in its own cache too (those of the new tokens): the same history.
        out = attend(self.core, q, k, v, sequence) if cache is None else cache.attend(q, k, v, self.core)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        start_linears(name, full, generator, scheme, inputs=("wq", "wk", "wv"), outputs=("wo",))


def gelu_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The experts' activation: gelu_tanh(gate) * up."""
    return gelu_tanh(gate) * up


class Gemma4Router(Router):
    """The gate reads the residual stream normalised (no weight), times `scale` [dim] and dim**-0.5; softmax over
    every expert, the top k renormalised, each then times its expert's `per_expert_scale`."""

    def __init__(self, dim: int, args: MoEArgs, eps: float):
        super().__init__(dim, args)
        self.eps, self.dim = eps, dim
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(args.n_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        h = F.rms_norm(x.float(), (self.dim,), eps=self.eps).type_as(x) * self.scale * self.dim**-0.5
        logits = self.gate(h).float()  # [N, E]
        scores = logits.softmax(dim=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        indices = torch.topk(choice, self.args.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(-1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[indices].float()
        return Routing(logits, scores, indices, weights)

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The scales at one, the gate as the shared router's."""
        if name in ("scale", "per_expert_scale"):
            nn.init.ones_(full)
        else:
            super().init_own(name, full, generator, scheme)


class Gemma4MoE(MoE):
    """The experts beside a Gemma 4 layer's MLP, [B, T, dim] in (the block's residual stream) and out: routed on
    their input as it is, computed on it normalised (`input_norm`), their sum normalised (`output_norm`)."""

    def __init__(self, dim: int, args: MoEArgs, eps: float):
        super().__init__(dim, args, experts=GroupedExperts(dim, args.expert_dim, args.n_experts, activation=gelu_gated))
        self.router = Gemma4Router(dim, args, eps)
        self.input_norm = Float32RMSNorm(dim, eps)
        self.output_norm = Float32RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, dim]; `tokens` taken, as the shared block's, and unused (no block of Gemma 4 is hash-routed)."""
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)  # [N, D]
        route = self.router(flat)
        inputs = self.input_norm(flat)
        chosen = route.indices.reshape(-1)  # [N*k]
        counts = torch.zeros(self.args.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
        order = torch.argsort(chosen, stable=True)
        token = order // self.args.top_k
        step = (counts, self.step_tokens) if torch.is_grad_enabled() else None
        expert_out = self.experts(inputs[token], counts, step=step)  # [N*k, D]
        weights = route.weights.reshape(-1)[order, None]
        out = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, expert_out.float() * weights).to(x.dtype)
        out = self.add_balancing_terms(out, route, counts)
        return self.output_norm(out.view(bsz, seqlen, dim))


class PerLayerInputs(nn.Module):
    """Each layer's per-layer input [B, T, n_layers, per_dim]: the tokens' rows of a second embedding (scaled by
    sqrt(per_dim)) and a normalised projection of the scaled embeddings (times dim**-0.5), summed, times 2**-0.5."""

    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.n_layers, self.per_dim, self.dim = args.n_layers, args.per_layer_dim, args.dim
        self.embedding = nn.Embedding(args.vocab_size, args.n_layers * args.per_layer_dim)
        self.projection = nn.Linear(args.dim, args.n_layers * args.per_layer_dim, bias=False)
        self.norm = Float32RMSNorm(args.per_layer_dim, args.norm_eps)

    def forward(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        shape = (*tokens.shape, self.n_layers, self.per_dim)
        rows = self.embedding(tokens)
        rows = (rows * torch.tensor(self.per_dim**0.5, dtype=rows.dtype, device=rows.device)).view(shape)
        projected = self.norm((self.projection(embedded) * self.dim**-0.5).view(shape))
        return (projected + rows) * 2**-0.5

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The embedding as the token embedding, the projection input-side."""
        if name == "embedding.weight":
            scheme.embedding(full, generator)
        else:
            start_linears(name, full, generator, scheme, inputs=("projection",), outputs=())


class Gemma4Block(Block):
    """One Gemma 4 layer (module docstring): Block's modules with norms "both", and `post_mlp_norm` and `moe` (the
    experts) where there are experts, `per_layer_gate`, `per_layer_proj` and `per_layer_norm` where there are
    per-layer inputs, and the buffer `layer_scalar`."""

    layer_scalar: torch.Tensor

    def __init__(self, args: Gemma4Args, layer: int, norm):
        mlp = GatedMLP(args.dim, args.ffn_width(layer), activation="gelu_tanh")
        super().__init__(Gemma4Attention(args, layer), mlp, norm, "both", "both")
        self.post_mlp_norm = norm() if args.moe is not None else None
        self.moe = Gemma4MoE(args.dim, args.moe, args.norm_eps) if args.moe is not None else None
        self.per_layer_gate: nn.Linear | None = None
        if args.per_layer_dim:
            self.per_layer_gate = nn.Linear(args.dim, args.per_layer_dim, bias=False)
            self.per_layer_proj = nn.Linear(args.per_layer_dim, args.dim, bias=False)
            self.per_layer_norm = norm()
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        sequence: Sequence | None = None,
        shared: SharedKV | None = None,
        per_layer: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = self.attention(self.attention_norm(x), cos, sin, cache=cache, sequence=sequence, shared=shared)
        h = x + self.post_attention_norm(y)
        y = self.feed_forward(self.ffn_norm(h))
        if self.moe is not None and self.post_mlp_norm is not None:
            y = self.post_mlp_norm(y) + self.moe(h)
        h = h + self.post_ffn_norm(y)
        if self.per_layer_gate is not None:
            if per_layer is None:
                raise ValueError("a layer with per-layer embeddings got no per-layer input")
            gated = gelu_tanh(self.per_layer_gate(h)) * per_layer
            h = h + self.per_layer_norm(self.per_layer_proj(gated))
        return h * self.layer_scalar

    def init_own(self, name: str, full: torch.Tensor, generator: torch.Generator, scheme: InitScheme) -> None:
        """The per-layer input's gate input-side, its projection back residual-side."""
        start_linears(name, full, generator, scheme, inputs=("per_layer_gate",), outputs=("per_layer_proj",))


class Gemma4(Transformer):
    """Implements titanlite.models.common.interface.Decoder."""

    args: Gemma4Args
    pooled_balance = False  # each MoE block adds its own load-balancing term

    def __init__(self, args: Gemma4Args):
        super().__init__(args)
        self.embedding_scale = args.dim**0.5
        self.per_layer_inputs: PerLayerInputs | None = PerLayerInputs(args) if args.per_layer_dim else None
        if args.final_softcap:
            self.output = OutputHead(args.dim, args.vocab_size, args.final_softcap)
            self.tie_weights()

    def build_layer(self, layer: int) -> Block:
        return Gemma4Block(self.args, layer, self.build_norm)

    def build_norm(self) -> nn.Module:
        return Float32RMSNorm(self.args.dim, self.args.norm_eps)

    def rotary_tables(self) -> dict[str, RotaryTable]:
        """The full layers' proportional table (its rotated_pairs frequencies) and the sliding layers' whole one."""
        a = self.args
        return {
            "rope": RotaryTable(
                2 * a.rotated_pairs, a.rope_theta, linear_factor=a.rope_factor, frequency_dim=a.global_head_dim
            ),
            "local_rope": RotaryTable(a.head_dim, a.rope_local_theta),
        }

    def rotary_of(self, layer: int) -> str:
        return "rope" if self.args.kinds()[layer] == "full_attention" else "local_rope"

    def layer_inputs(
        self, tokens: torch.Tensor, h: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> dict[str, dict[str, Any]]:
        """Each block's per-layer input (its slice of PerLayerInputs') and the SharedKV of this forward, through
        which the layers that store keys and values hand them to those that reuse them."""
        a = self.args
        if (a.per_layer_dim or a.kv_shared_layers) and (self.tok_embeddings is None or self.output is None):
            raise ConfigError(
                "gemma4 with per-layer embeddings or shared keys and values cannot be split into pipeline stages; "
                "set parallelism.pipeline_parallel_degree = 1"
            )
        per_layer = self.per_layer_inputs(tokens, h) if self.per_layer_inputs is not None else None  # [B, T, L, P]
        shared = SharedKV()
        return {
            name: {"shared": shared, "per_layer": None if per_layer is None else per_layer[:, :, int(name)]}
            for name in self.layers
        }

    def init_buffers(self) -> None:
        """The rotary tables, and each block's layer_scalar at one (a folder or a checkpoint then restores it)."""
        super().init_buffers()
        for module in self.modules():  # the blocks, under whatever wraps them
            if isinstance(module, Gemma4Block):
                module.layer_scalar.fill_(1.0)


def flops_per_token(model: DecoderModule, seq_len: int) -> float:
    """Training FLOPs per token: the mixture-of-experts formula (models/common/flops.py; a dense model's has no idle
    experts) with the per-layer embedding table counted as the lookup it is, not a matmul, and attention's term over
    each layer's own head width (the full layers' global_head_dim)."""
    args = model.args
    assert isinstance(args, Gemma4Args), type(args).__name__
    flops = moe_flops_per_token(model, seq_len) - sequence_flops_per_token(model, seq_len)
    per_layer = getattr(model, "per_layer_inputs", None)
    if per_layer is not None:
        flops -= 6.0 * per_layer.embedding.weight.numel()
    widths = sum(args.n_heads * args.attention_shape(i)[0] for i in range(args.n_layers))
    return flops + 12.0 * widths * seq_len


if TYPE_CHECKING:

    def _implements_decoder(model: Gemma4) -> Decoder:
        return model
