"""A mixture-of-experts block's arguments, torch-free (the block is titanlite/models/common/moe/layer.py): the
router, the routed and shared experts, load balancing, and which layers keep a dense feed-forward or route by a fixed
token table. Families fill it from their own arguments and Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
# How training balances the experts' load (the run's [moe] section may set them): not what the weights compute.
BALANCE_FIELDS = ("balance", "aux_loss_coef", "z_loss_coef", "bias_update_rate")
BALANCES = ("aux_loss", "bias", "none")
AUX_LOSS_STYLES = ("switch",)
EXPERT_ACTIVATIONS = ("swiglu", "relu2")


@dataclass(frozen=True)
class MoEArgs:
    """One MoE block's shape and routing; every field is checked on construction (ValueError naming it)."""

    TRAINING = BALANCE_FIELDS  # how the run balances the experts ([moe]), not what the weights compute

    n_experts: int
    """Routed experts per block (num_experts / num_local_experts)."""
    top_k: int
    """Experts each token is routed to (num_experts_per_tok); no token is dropped (capacity is unlimited)."""
    expert_dim: int
    """Hidden width of each routed expert's SwiGLU (moe_intermediate_size; Mixtral's intermediate_size)."""
    score_func: str = "softmax"
    """"softmax": probabilities over all experts, then top-k (Mixtral, Qwen-MoE, OLMoE); "sigmoid": each
    expert's score on its own (DeepSeek-V3); "sqrtsoftplus": each expert's sqrt(softplus(logit)), on its own as
    sigmoid's (DeepSeek-V4)."""
    norm_topk_prob: bool = False
    """Renormalise the chosen top-k scores to sum to 1 (Mixtral always; Qwen-MoE and OLMoE by norm_topk_prob)."""
    route_scale: float = 1.0
    """Factor on the combine weights after the optional renormalisation (DeepSeek's routed_scaling_factor)."""
    router_bias: bool = False
    """A bias on the router's linear layer (none of the supported families has one)."""
    n_shared_experts: int = 0
    """Experts every token goes through, fused into one SwiGLU of n_shared_experts * expert_dim (DeepSeek);
    shared_expert_dim, when set, gives that width instead."""
    shared_expert_dim: int = 0
    """Hidden width of the shared expert (Qwen2-MoE's shared_expert_intermediate_size); 0: from n_shared_experts."""
    shared_gate: bool = False
    """Scale the shared expert's output by sigmoid(a linear dim -> 1 of the input), as Qwen2-MoE does."""
    activation: str = "swiglu"
    """The experts' (routed and shared) feed-forward: "swiglu", down(silu(gate x) * up x); "relu2", down(relu(up
    x)^2) with no gate (Nemotron-H's)."""
    swiglu_limit: float = 0.0
    """With activation "swiglu", clamp the experts' (routed and shared) gate above at this value and their up
    projection to +-this value before silu(gate) * up (DeepSeek-V4's swiglu_limit); 0: no clamp."""
    latent_dim: int = 0
    """LatentMoE (Nemotron 3): the routed experts work in this smaller width, between a projection down from the
    model's width (after the router, which reads the full width) and one back up; 0: in the model's width."""
    balance: str = "aux_loss"
    """"aux_loss": the auxiliary loss of aux_loss_style added to the training loss; "bias": auxiliary-loss-free
    balancing, a per-expert bias added to the scores for choosing experts only, updated after each step
    (moe.py update_balance_bias); "none"."""
    aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss in the training loss (router_aux_loss_coef); used with balance="aux_loss"."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, the mean over tokens of logsumexp(router logits)^2 (OLMoE); 0: none."""
    aux_loss_style: str = "switch"
    """"switch": n_experts * sum_i f_i * P_i over the block's tokens, f_i the fraction of tokens routed to expert i
    and P_i its mean router probability (Switch Transformer; transformers' load_balancing_loss_func for
    Mixtral, Qwen-MoE and OLMoE, applied to one block)."""
    bias_update_rate: float = 0.001
    """Step of the balancing bias per update, with balance="bias" (DeepSeek-V3's bias update speed)."""
    dense_layers: tuple[int, ...] = ()
    """Layer indices that keep a dense feed-forward instead of the MoE block (Qwen-MoE's mlp_only_layers and
    decoder_sparse_step: dense_layers_from_hf)."""
    hash_layers: tuple[int, ...] = ()
    """Layer indices whose MoE block chooses each token's experts by a fixed table of its token id (DeepSeek-V4's
    "hash_moe" layers, tid2eid), the gate's scores only weighting them; no balancing bias there."""
    n_groups: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts form n_groups equal groups, in order; 1: none."""
    topk_groups: int = 1
    """With n_groups > 1, each token chooses its top_k experts among the topk_groups groups whose two best
    scores (with the balancing bias) sum highest (DeepSeek-V3's topk_group, its "noaux_tc" routing)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        object.__setattr__(self, "hash_layers", tuple(self.hash_layers))
        for name in ("n_experts", "top_k", "expert_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name}={getattr(self, name)}; it must be at least 1")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEArgs.top_k={self.top_k} exceeds n_experts={self.n_experts}; use at most n_experts")
        for name, allowed in (
            ("score_func", SCORE_FUNCS),
            ("balance", BALANCES),
            ("aux_loss_style", AUX_LOSS_STYLES),
            ("activation", EXPERT_ACTIVATIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoEArgs.{name}={getattr(self, name)!r}; use one of {', '.join(allowed)}")
        if self.route_scale <= 0:
            raise ValueError(f"MoEArgs.route_scale={self.route_scale}; it must be positive")
        for name in (
            "n_shared_experts",
            "shared_expert_dim",
            "aux_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
            "latent_dim",
            "swiglu_limit",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"MoEArgs.{name}={getattr(self, name)}; it must not be negative")
        if self.shared_gate and not self.shared_hidden:
            raise ValueError(
                "MoEArgs.shared_gate=True needs a shared expert; set n_shared_experts or shared_expert_dim"
            )
        if self.swiglu_limit and self.activation != "swiglu":
            raise ValueError(
                f"MoEArgs.swiglu_limit={self.swiglu_limit} clamps a SwiGLU; activation={self.activation!r} has none, "
                "so use swiglu_limit=0"
            )
        self._check_groups()
        self._check_layers()

    def _check_layers(self) -> None:
        for name in ("dense_layers", "hash_layers"):
            if any(not isinstance(i, int) or i < 0 for i in getattr(self, name)):
                raise ValueError(f"MoEArgs.{name}={getattr(self, name)}; use layer indices (integers from 0)")
        both = sorted(set(self.dense_layers) & set(self.hash_layers))
        if both:
            raise ValueError(
                f"MoEArgs.hash_layers={list(self.hash_layers)} names dense layers {both}; a dense layer has no router"
            )

    def _check_groups(self) -> None:
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            raise ValueError(f"MoEArgs.n_groups={self.n_groups}; use a divisor of n_experts={self.n_experts}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"MoEArgs.topk_groups={self.topk_groups}; use 1 to n_groups={self.n_groups}")
        per_group = self.n_experts // self.n_groups
        if self.n_groups > 1 and per_group < 2:
            raise ValueError(
                f"MoEArgs.n_groups={self.n_groups} leaves {per_group} expert per group; a group is scored by its "
                "two best experts, so use at most n_experts // 2 groups"
            )
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"MoEArgs.top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts of topk_groups="
                f"{self.topk_groups} groups; raise topk_groups or lower top_k"
            )

    @property
    def shared_hidden(self) -> int:
        """Hidden width of the shared expert; 0: none."""
        return self.shared_expert_dim or self.n_shared_experts * self.expert_dim

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` holds the MoE block (else a dense feed-forward)."""
        return layer not in self.dense_layers

    def is_hashed(self, layer: int) -> bool:
        """Whether block `layer`'s router chooses experts by the token-id table (hash_layers)."""
        return layer in self.hash_layers

    def check_depth(self, n_layers: int) -> None:
        """Refuse (ValueError) dense_layers or hash_layers naming a layer a decoder of `n_layers` does not have."""
        for name in ("dense_layers", "hash_layers"):
            if any(i >= n_layers for i in getattr(self, name)):
                raise ValueError(f"MoEArgs.{name}={list(getattr(self, name))} names layers beyond n_layers={n_layers}")

    def at_depth(self, n_layers: int) -> MoEArgs:
        """These arguments for a decoder cut or grown to `n_layers` (model.n_layers): the dense and hashed layers
        that still exist."""
        return dataclasses.replace(
            self,
            dense_layers=tuple(i for i in self.dense_layers if i < n_layers),
            hash_layers=tuple(i for i in self.hash_layers if i < n_layers),
        )


def dense_layers_from_hf(
    n_layers: int, mlp_only_layers: list[int] | tuple[int, ...], sparse_step: int
) -> tuple[int, ...]:
    """The dense layers of a Qwen-MoE config.json: those in mlp_only_layers, and those with (i + 1) not a
    multiple of decoder_sparse_step (as transformers' MoE decoder layers choose)."""
    if sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={sparse_step}; it must be at least 1")
    return tuple(i for i in range(n_layers) if i in mlp_only_layers or (i + 1) % sparse_step != 0)


def bias_routed(
    n_experts: int,
    top_k: int,
    expert_dim: int,
    route_scale: float,
    n_shared_experts: int = 1,
    n_groups: int = 1,
    topk_groups: int = 1,
    dense_layers: tuple[int, ...] = (0,),
) -> MoEArgs:
    """A DeepSeek-V3-style block (DeepSeek-V3, Kimi Linear, GLM-4.5): each expert scored by a sigmoid of its own, chosen
    by score plus the routing bias (balance "bias", no auxiliary loss), in groups where n_groups > 1; the chosen scores
    renormalised, then scaled by route_scale; shared experts beside them; the dense_layers dense."""
    return MoEArgs(
        n_experts=n_experts,
        top_k=top_k,
        expert_dim=expert_dim,
        score_func="sigmoid",
        norm_topk_prob=True,
        route_scale=route_scale,
        n_shared_experts=n_shared_experts,
        balance="bias",
        n_groups=n_groups,
        topk_groups=topk_groups,
        dense_layers=dense_layers,
    )


def debug_bias_routed(route_scale: float = 2.5, n_groups: int = 1, topk_groups: int = 1) -> MoEArgs:
    """The debug flavors' bias_routed block: 8 experts of width 32, 2 per token, one shared expert; the first layer
    dense."""
    return bias_routed(8, 2, 32, route_scale, n_groups=n_groups, topk_groups=topk_groups)
