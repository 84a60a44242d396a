"""DeepSeek-V4's config.json (model_type deepseek_v4, DeepseekV4ForCausalLM) both ways, torch-free. An absent key takes
transformers' DeepseekV4Config default (the DeepSeek-V4-Flash shape); every field that changes the math is honoured or
refused in one line naming it.

Honoured: the sizes (hidden_size, num_hidden_layers, num_attention_heads, head_dim, q_lora_rank, o_groups,
o_lora_rank, vocab_size), each layer's attention kind (layer_types, or the published folders' compress_ratios of 0, 4
and 128 per layer, or transformers' default of two HCA layers then HCA and CSA alternating), the compressed blocks'
lengths (compress_rates, or compress_rate_csa / compress_rate_hca), sliding_window, the indexer (index_n_heads,
index_head_dim, index_topk), the hyper-connections (hc_mult, hc_sinkhorn_iters, hc_eps), the rotary channels
(partial_rotary_factor, or qk_rope_head_dim), the two RoPE bases and the compressed layers' YaRN, the experts
(n_routed_experts, num_experts_per_tok, moe_intermediate_size, scoring_func "sqrtsoftplus", "sigmoid" or "softmax",
routed_scaling_factor, swiglu_limit), the hash-routed layers (mlp_layer_types, or num_hash_layers: that many first
layers), rms_norm_eps, tie_word_embeddings, max_position_embeddings (the context, as max_seq_len).

The rotations as transformers computes them: rope_parameters {"main": ..., "compress": ...} gives each kind's base
and channels (a "compress" without rope_theta takes rope_theta, as transformers' does, not compress_rope_theta); a flat
rope_parameters or rope_scaling (the published folders') is the compressed layers' scaling, their base
compress_rope_theta, and its YaRN's attention_factor 1.0 where it names none (DeepSeek's code does not scale cos and
sin). The sliding layers' rotation must be plain ("main" of rope_type "default").

Refused: num_key_value_heads other than 1 (one key/value head, the key is the value), n_shared_experts other than 1,
hidden_act other than silu, attention_bias or mlp_bias true (DeepSeek-V4's projections have none; transformers'
attention would ignore attention_bias),
norm_topk_prob false (transformers' routers renormalise the chosen scores whatever it says). transformers 5.25 cannot
build a "softmax" router (its activations hold no softmax); we read it as MoEArgs' softmax over all experts, then the
chosen renormalised.

Multi-token prediction: num_nextn_predict_layers (absent: none) is mtp_layers, those layers (the published folders'
mtp.K.*) loaded and trained where the folder holds them (titanlite/models/hf_config.py held_mtp_layers: a folder
transformers saved holds none; model.mtp_layers = 0 leaves them out of the run and carries them unchanged into an
export); each one's attention kind is compress_ratios' entry past the layers' (0: sliding, where it has none).
Ignored, as they change no math or transformers' DeepseekV4 does not read them: output_router_logits,
router_aux_loss_coef (DeepSeek balances by the routing bias, balance "bias"), topk_method, n_group and topk_group
(transformers' V4 routes without groups), initializer_range, use_cache, bos/eos/pad token ids. Dropout and
router_jitter_noise: a training run refuses non-zero ones (titanlite/base/hf_config.py check_training_fields).
quantization_config and expert_dtype: the shared quantization_of, which reads the published folders' fp8 weights with
power-of-two scales (scale_fmt "ue8m0") and fp4 experts (expert_dtype "fp4"), dequantized as they are read
(titanlite/components/hf_quantized.py)."""

from __future__ import annotations

import dataclasses

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import (
    COUNT,
    OBJECT,
    POSITIVE,
    TEXT,
    TEXTS,
    WHOLE,
    WHOLES,
    FieldTypes,
    check_types,
    refuse,
)
from titanlite.models.common.decoder_config import partial_rotary_dim
from titanlite.models.common.moe.args import SCORE_FUNCS, MoEArgs
from titanlite.models.common.moe.hf_config import (
    CONFIG_KEYS,
    MOE_FIELDS,
    check_expressible,
    check_top_k,
    in_config_names,
)
from titanlite.models.common.rope_args import YarnRopeScaling, yarn_from_hf, yarn_to_hf
from titanlite.models.deepseek_v4.args import (
    CSA,
    HCA,
    LAYER_KINDS,
    SLIDING,
    DeepseekV4Args,
    default_layer_types,
    v4_moe,
)

MODEL_TYPE = "deepseek_v4"
ARCHITECTURE = "DeepseekV4ForCausalLM"

# The config.json fields DeepSeek-V4 reads beyond the shared ones (titanlite/base/hf_config.py FIELDS): the experts'
# and their routing, the compressed attention's, the indexer's, the hyper-connections', and the legacy names the
# published folders use (compress_ratios, compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim).
FIELDS: FieldTypes = {
    **MOE_FIELDS,
    "n_shared_experts": (WHOLE, False),
    "routed_scaling_factor": (POSITIVE, False),
    "scoring_func": (TEXT, False),
    "swiglu_limit": (POSITIVE, False),
    "mlp_layer_types": (TEXTS, True),
    "num_hash_layers": (WHOLE, True),
    "q_lora_rank": (COUNT, False),
    "o_groups": (COUNT, False),
    "o_lora_rank": (COUNT, False),
    "index_n_heads": (COUNT, False),
    "index_head_dim": (COUNT, False),
    "index_topk": (COUNT, False),
    "compress_rates": (OBJECT, True),
    "compress_rate_csa": (COUNT, True),
    "compress_rate_hca": (COUNT, True),
    "compress_ratios": (WHOLES, True),
    "compress_rope_theta": (POSITIVE, False),
    "qk_rope_head_dim": (WHOLE, True),
    "hc_mult": (COUNT, False),
    "hc_sinkhorn_iters": (COUNT, False),
    "hc_eps": (POSITIVE, False),
    "num_nextn_predict_layers": (WHOLE, True),
    "expert_dtype": (TEXT, True),
}

# DeepseekV4Config's defaults (transformers 5.24) for the keys a config.json may leave out.
DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROTARY_FACTOR = 64 / 512  # qk_rope_head_dim 64 of head_dim 512
# The published folders' compress_ratios entries -> the layer kind transformers reads each as (whatever
# compress_rates says: the entries name kinds, not lengths).
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}
HASH, ROUTED = "hash_moe", "moe"
# Aliases transformers reads as one field (DeepseekV4Config.attribute_map): alias -> field.
ALIASES = {"num_local_experts": "n_routed_experts", "intermediate_size": "moe_intermediate_size"}
# Fields that must be a whole number of at least 1 (check_types refuses them at the front door; read refuses them
# itself when called on its own).
COUNTS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "hc_sinkhorn_iters",
    "sliding_window",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "max_position_embeddings",
)
# DeepseekV4Args' and MoEArgs' fields -> the config.json keys that set them (their refusals in config.json's names).
ARGS_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rotary_dim": "qk_rope_head_dim",
    "csa_rate": "compress_rates.compressed_sparse_attention",
    "hca_rate": "compress_rates.heavily_compressed_attention",
    "norm_eps": "rms_norm_eps",
    "mtp_layers": "num_nextn_predict_layers",
    **{name: name for name in ("head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
                               "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "sliding_window")},
}  # fmt: skip
MOE_KEYS = CONFIG_KEYS | {
    "n_experts": "n_routed_experts",
    "score_func": "scoring_func",
    "hash_layers": "mlp_layer_types",
    "swiglu_limit": "swiglu_limit",
}


def read(config: dict, where: str) -> DeepseekV4Args:
    """DeepseekV4Args of a deepseek_v4 config.json (absent or null keys take DeepseekV4Config's defaults)."""
    config = _with_defaults(config, where)
    _check_switches(config, where)
    n_layers = config["num_hidden_layers"]
    layer_types = _layer_types(config, where, n_layers)
    csa_rate, hca_rate = _rates(config, where, layer_types)
    rope_theta, compress_rope_theta, rotary_dim, rope_scaling = _rope(config, where)
    moe = _moe(config, where, n_layers)
    try:
        return DeepseekV4Args(
            dim=config["hidden_size"],
            n_layers=n_layers,
            n_heads=config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            max_seq_len=config["max_position_embeddings"],
            head_dim=config["head_dim"],
            rotary_dim=rotary_dim,
            q_lora_rank=config["q_lora_rank"],
            rope_theta=rope_theta,
            compress_rope_theta=compress_rope_theta,
            rope_scaling=rope_scaling,
            norm_eps=float(config["rms_norm_eps"]),
            tie_embeddings=bool(config["tie_word_embeddings"]),
            layer_types=layer_types,
            sliding_window=config["sliding_window"],
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            o_groups=config["o_groups"],
            o_lora_rank=config["o_lora_rank"],
            index_n_heads=config["index_n_heads"],
            index_head_dim=config["index_head_dim"],
            index_topk=config["index_topk"],
            hc_mult=config["hc_mult"],
            hc_sinkhorn_iters=config["hc_sinkhorn_iters"],
            hc_eps=float(config["hc_eps"]),
            moe=moe,
            mtp_layers=config.get("num_nextn_predict_layers", 0),
            mtp_layer_types=_mtp_layer_types(config, where, n_layers),
        )
    except ValueError as e:  # DeepseekV4Args' own checks (o_groups dividing the heads, the rotary channels' width)
        raise ConfigError(f"{where} is not supported: {in_config_names(str(e), ARGS_KEYS)}") from e


def _with_defaults(config: dict, where: str) -> dict:
    """config.json over DeepseekV4Config's defaults, a null taken as absent and the aliases under their fields."""
    given = {key: value for key, value in config.items() if value is not None}
    for alias, key in ALIASES.items():
        if alias not in given:
            continue
        if key in given and given[key] != given[alias]:
            raise refuse(where, alias, given[alias], f"it differs from {key}={given[key]}; transformers reads one")
        given[key] = given[alias]
    return {**DEFAULTS, **given}


def _check_switches(config: dict, where: str) -> None:
    """Refuse what DeepSeek-V4 does not compute: another activation, biases, more key/value heads or shared
    experts, a count below 1."""
    for key in COUNTS:
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(where, key, value, "it must be a whole number of at least 1")
    if config["hidden_act"] != "silu":
        raise refuse(where, "hidden_act", config["hidden_act"], "DeepSeek-V4's experts are clamped SwiGLUs (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config[key]:
            raise refuse(where, key, config[key], "DeepSeek-V4's projections have no biases; set it to false")
    if config["num_key_value_heads"] != 1:
        raise refuse(
            where, "num_key_value_heads", config["num_key_value_heads"],
            "DeepSeek-V4 attends with one key/value head, whose key is its value; set 1",
        )  # fmt: skip


def _layer_types(config: dict, where: str, n_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind, as transformers reads it: layer_types, else the published compress_ratios
    (0, 4 or 128 per layer), else two HCA layers then CSA and HCA alternating. A longer list is cut to the layers
    (the published compress_ratios name the MTP layer last); a shorter one is refused."""
    if "layer_types" in config:
        key, kinds = "layer_types", list(config["layer_types"])
        for kind in kinds:
            if kind not in LAYER_KINDS:
                raise refuse(where, key, kind, f"DeepSeek-V4's layer kinds are {', '.join(LAYER_KINDS)}")
    elif "compress_ratios" in config:
        key, ratios = "compress_ratios", list(config["compress_ratios"])
        for i, ratio in enumerate(ratios):
            if ratio not in RATIO_KINDS:
                raise refuse(
                    where, f"compress_ratios[{i}]", ratio, "transformers reads 0 (sliding_attention), 4 "
                    "(compressed_sparse_attention) and 128 (heavily_compressed_attention); write layer_types "
                    "and compress_rates for other block lengths",
                )  # fmt: skip
        kinds = [RATIO_KINDS[ratio] for ratio in ratios]
    else:
        return default_layer_types(n_layers)
    if len(kinds) < n_layers:
        raise refuse(where, key, f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    return tuple(kinds[:n_layers])


def _mtp_layer_types(config: dict, where: str, n_layers: int) -> tuple[str, ...]:
    """The multi-token prediction layers' attention kinds: compress_ratios' entries past the decoder's layers (the
    published folders name them there), none (every depth sliding) where it has no more. A depth with no entry of
    its own is refused."""
    mtp = config.get("num_nextn_predict_layers", 0)
    ratios = list(config.get("compress_ratios") or [])[n_layers:]
    if not mtp or not ratios:
        return ()
    if len(ratios) < mtp:
        raise refuse(
            where, "compress_ratios", f"[{n_layers + len(ratios)} entries]", f"it names {len(ratios)} of the "
            f"num_nextn_predict_layers={mtp} multi-token prediction layers after the {n_layers} layers; give one each",
        )  # fmt: skip
    for i, ratio in enumerate(ratios, start=n_layers):
        if ratio not in RATIO_KINDS:
            raise refuse(where, f"compress_ratios[{i}]", ratio, "its entries are 0, 4 and 128")
    return tuple(RATIO_KINDS[ratio] for ratio in ratios[:mtp])


def _rates(config: dict, where: str, layer_types: tuple[str, ...]) -> tuple[int, int]:
    """The CSA and HCA layers' tokens per compressed block: compress_rates (a given dict replaces the default
    whole, as transformers takes it), compress_rate_csa / compress_rate_hca over it. A kind no layer has keeps the
    default where the dict leaves it out."""
    given = config.get("compress_rates")
    rates = dict(DEFAULT_RATES if given is None else given)
    unknown = sorted(set(rates) - set(DEFAULT_RATES))
    if unknown:
        raise refuse(where, "compress_rates", given, f"its keys are {CSA!r} and {HCA!r}, not {unknown[0]!r}")
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if legacy in config:
            rates[kind] = config[legacy]
    found = []
    for kind in (CSA, HCA):
        if kind not in rates:
            if kind in layer_types:
                raise refuse(where, "compress_rates", given, f"it lacks {kind!r}, the block length of those layers")
            rates[kind] = DEFAULT_RATES[kind]
        rate = rates[kind]
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise refuse(where, f"compress_rates.{kind}", rate, "tokens per block: a whole number of at least 1")
        found.append(rate)
    return found[0], found[1]


def _rope(config: dict, where: str) -> tuple[float, float, int, YarnRopeScaling | None]:
    """rope_theta (the sliding layers'), compress_rope_theta (the compressed layers'), the rotary channels and the
    compressed layers' YaRN, from rope_parameters nested {"main", "compress"} (transformers' own form) or flat
    (rope_scaling or rope_parameters: the compressed layers' scaling; rope_scaling first, as transformers reads)."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(key) or {}
    head_dim, theta = config["head_dim"], float(config["rope_theta"])
    if not (isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict)):
        if "partial_rotary_factor" in config:
            factor_key, factor = "partial_rotary_factor", config["partial_rotary_factor"]
        elif "qk_rope_head_dim" in config:
            factor_key, factor = "qk_rope_head_dim / head_dim", config["qk_rope_head_dim"] / head_dim
        else:
            factor_key, factor = "partial_rotary_factor", DEFAULT_ROTARY_FACTOR
        rotary_dim = partial_rotary_dim(factor, head_dim, where, factor_key)
        flat = {k: v for k, v in rope.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        scaling = _compress_scaling(flat, f"{where} {key}", config, flat=True)
        return theta, float(config["compress_rope_theta"]), rotary_dim, scaling
    main, compress = rope["main"], rope["compress"]
    for label, inner in (("main", main), ("compress", compress)):
        check_types({"rope_parameters": inner}, f"{where} {key}.{label}:")
    main_type = main.get("rope_type") or main.get("type") or "default"
    if main_type != "default":
        raise refuse(
            where, f"{key}.main.rope_type", main_type, "DeepSeek-V4's sliding layers rotate by plain RoPE "
            "('default'); YaRN belongs to the compressed layers (rope_parameters.compress)",
        )  # fmt: skip
    dims = []
    for label, inner in (("main", main), ("compress", compress)):
        # transformers fills a nested dict's absent factor from the top-level one, if config.json gives one
        factor = (
            inner["partial_rotary_factor"] if "partial_rotary_factor" in inner else config.get("partial_rotary_factor")
        )
        if factor is None:
            raise ConfigError(
                f"{where} {key}.{label} lacks partial_rotary_factor: transformers would not rotate the channels "
                "config.json means there; write it"
            )
        dims.append(partial_rotary_dim(factor, head_dim, where, f"{key}.{label}.partial_rotary_factor"))
    if dims[0] != dims[1]:
        raise refuse(
            where, f"{key}.compress.partial_rotary_factor", compress.get("partial_rotary_factor"),
            f"it rotates {dims[1]} channels where {key}.main rotates {dims[0]}; DeepSeek-V4 rotates one width",
        )  # fmt: skip
    scaling = _compress_scaling(compress, f"{where} {key}.compress", config, flat=False)
    main_theta = float(main.get("rope_theta", theta))
    return main_theta, float(compress.get("rope_theta", theta)), dims[0], scaling


def _compress_scaling(rope: dict, where: str, config: dict, flat: bool) -> YarnRopeScaling | None:
    """The compressed layers' frequency scaling: none or YaRN. A flat one without attention_factor takes 1.0, as
    transformers fills it in (DeepSeek's code does not scale cos and sin); its original context: the dict's
    original_max_position_embeddings, else max_position_embeddings."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ConfigError(
            f"{where} rope_type={rope_type!r} is not supported: DeepSeek-V4's compressed layers rotate by plain "
            "RoPE ('default') or by 'yarn'"
        )
    fields = dict(rope)
    if flat and "attention_factor" not in fields:
        fields["attention_factor"] = 1.0
    if fields.get("attention_factor") == 0:
        raise ConfigError(
            f"{where} attention_factor=0 is not supported: it multiplies cos and sin; leave it out for YaRN's own"
        )
    try:
        return yarn_from_hf(fields, where, {"max_position_embeddings": config["max_position_embeddings"]})
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {e}") from None


def _hash_layers(config: dict, where: str, n_layers: int) -> tuple[int, ...]:
    """The layers routed by their token table: mlp_layer_types' "hash_moe" ones, else the first num_hash_layers
    (3 where neither is given), as transformers reads them."""
    if "mlp_layer_types" not in config:
        return tuple(range(min(n_layers, config.get("num_hash_layers", DEFAULT_HASH_LAYERS))))
    kinds = list(config["mlp_layer_types"])
    for kind in kinds:
        if kind not in (HASH, ROUTED):
            raise refuse(where, "mlp_layer_types", kind, f"DeepSeek-V4's MoE layer kinds are {HASH!r} and {ROUTED!r}")
    if len(kinds) < n_layers:
        raise refuse(where, "mlp_layer_types", f"[{len(kinds)} entries]", f"it needs one per layer ({n_layers})")
    return tuple(i for i, kind in enumerate(kinds[:n_layers]) if kind == HASH)


def _moe(config: dict, where: str, n_layers: int) -> MoEArgs:
    """DeepSeek-V4's block (args.v4_moe) with the config's scores; what transformers' block cannot mean refused."""
    score = config["scoring_func"]
    if score not in SCORE_FUNCS:
        raise refuse(where, "scoring_func", score, f"DeepSeek-V4 scores experts by {', '.join(SCORE_FUNCS)}")
    if config["norm_topk_prob"] is not True:
        raise refuse(
            where, "norm_topk_prob", config["norm_topk_prob"], "transformers' DeepseekV4 routers renormalise the "
            "chosen experts' scores whatever it says; set it to true",
        )  # fmt: skip
    if config["n_shared_experts"] != 1:
        raise refuse(
            where, "n_shared_experts", config["n_shared_experts"], "DeepSeek-V4's block has one shared expert of "
            "moe_intermediate_size (transformers builds one whatever it says); set 1",
        )  # fmt: skip
    limit = config["swiglu_limit"]
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise refuse(
            where, "swiglu_limit", limit, "transformers clamps every expert's SwiGLU at it (0 would zero them); "
            "DeepSeek-V4's is 10.0",
        )  # fmt: skip
    n_experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    check_top_k(where, config, "n_routed_experts", top_k, n_experts)
    hash_layers = _hash_layers(config, where, n_layers)
    try:
        moe = v4_moe(
            n_experts=n_experts,
            top_k=top_k,
            expert_dim=config["moe_intermediate_size"],
            route_scale=float(config["routed_scaling_factor"]),
            hash_layers=hash_layers,
            swiglu_limit=float(limit),
        )
        return moe if score == moe.score_func else dataclasses.replace(moe, score_func=score)
    except ValueError as e:
        raise ConfigError(f"{where} is not supported: {in_config_names(str(e), MOE_KEYS)}") from e


def write(args: DeepseekV4Args) -> dict:
    """DeepSeek-V4's config.json, in transformers' modern fields (layer_types, mlp_layer_types, compress_rates,
    partial_rotary_factor, rope_parameters nested "main" / "compress"); what it cannot say is refused in one line
    naming the field: a block other than DeepSeek-V4's (dense layers, groups, a router bias, a gated or wider shared
    expert, relu^2 or latent experts, no SwiGLU clamp, scores not renormalised), another frequency scaling than
    YaRN, a rotary width no partial_rotary_factor gives back."""
    _check_expressible(args)
    factor = args.rotary_dim / args.head_dim
    compress = yarn_to_hf(args.rope_scaling) if args.rope_scaling is not None else {"rope_type": "default"}
    moe = args.moe
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "q_lora_rank": args.q_lora_rank,
        "o_groups": args.o_groups,
        "o_lora_rank": args.o_lora_rank,
        "layer_types": list(args.layer_types),
        "sliding_window": args.sliding_window,
        "compress_rates": {CSA: args.csa_rate, HCA: args.hca_rate},
        "index_n_heads": args.index_n_heads,
        "index_head_dim": args.index_head_dim,
        "index_topk": args.index_topk,
        "hc_mult": args.hc_mult,
        "hc_sinkhorn_iters": args.hc_sinkhorn_iters,
        "hc_eps": args.hc_eps,
        "rope_theta": args.rope_theta,
        "compress_rope_theta": args.compress_rope_theta,
        "partial_rotary_factor": factor,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": args.rope_theta, "partial_rotary_factor": factor},
            "compress": {**compress, "rope_theta": args.compress_rope_theta, "partial_rotary_factor": factor},
        },
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_dim,
        "n_shared_experts": 1,
        "scoring_func": moe.score_func,
        "norm_topk_prob": True,
        "routed_scaling_factor": moe.route_scale,
        "swiglu_limit": moe.swiglu_limit,
        "mlp_layer_types": [HASH if i in moe.hash_layers else ROUTED for i in range(args.n_layers)],
        "num_nextn_predict_layers": args.mtp_layers,
        **_compress_ratios(args),
    }


def _compress_ratios(args: DeepseekV4Args) -> dict:
    """The published folders' compress_ratios, one per layer and multi-token prediction layer, where the latter's
    kinds are not all sliding (transformers reads layer_types and drops it; read takes the depths' kinds from it)."""
    kinds = [args.kind(i) for i in range(args.n_layers + args.mtp_layers)]
    if all(kind == SLIDING for kind in kinds[args.n_layers :]):
        return {}
    ratio_of = {kind: ratio for ratio, kind in RATIO_KINDS.items()}
    return {"compress_ratios": [ratio_of[kind] for kind in kinds]}


def _check_expressible(args: DeepseekV4Args) -> None:
    """Refuse, in one line naming every such field, what DeepseekV4Config cannot say (transformers would build
    another model)."""
    moe = args.moe
    more = []
    if args.rope_scaling is not None and not isinstance(args.rope_scaling, YarnRopeScaling):
        more.append(f"rope_scaling={args.rope_scaling!r} (the compressed layers' scaling is YaRN or none)")
    if int(args.head_dim * (args.rotary_dim / args.head_dim)) != args.rotary_dim:
        more.append(f"rotary_dim={args.rotary_dim} (no partial_rotary_factor of head_dim={args.head_dim} gives it)")
    if not moe.swiglu_limit:
        more.append("MoEArgs.swiglu_limit=0.0 (transformers clamps every expert's SwiGLU at swiglu_limit)")
    check_expressible(
        moe,
        "deepseek_v4",
        dense_layers=False,
        fixed={
            "norm_topk_prob": True,
            "router_bias": False,
            "n_shared_experts": 1,
            "shared_expert_dim": 0,
            "shared_gate": False,
            "n_groups": 1,
            # config.json says any clamp (swiglu_limit; none is refused above) and any hash layers (mlp_layer_types)
            "swiglu_limit": moe.swiglu_limit,
            "hash_layers": moe.hash_layers,
        },
        bias_balance=True,
        more=tuple(more),
    )
