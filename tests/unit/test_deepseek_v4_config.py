"""DeepSeek-V4's config.json (titanlite/models/deepseek_v4/hf_config.py): every flavor reads back from what it writes;
transformers' DeepseekV4Config, given what we write or a folder's legacy keys (compress_ratios, num_hash_layers,
qk_rope_head_dim, a flat YaRN rope_scaling), saves a config.json that reads as the same model; the published
DeepSeek-V4-Flash and -Pro config.json files read as their flavors; what DeepSeek-V4 does not compute is refused in
one line naming the field. (The published flavors count transformers' parameters: tests/unit/test_hf_families.py.)"""

from __future__ import annotations

import dataclasses

import pytest

from titanlite.base.errors import ConfigError
from titanlite.base.hf_config import check_types, quantization_of
from titanlite.models.common.moe.args import MoEArgs
from titanlite.models.common.rope_args import YarnRopeScaling
from titanlite.models.deepseek_v4.args import CSA, FLAVORS, HCA, SLIDING
from titanlite.models.deepseek_v4.hf_config import FIELDS, read, write

try:
    from transformers import DeepseekV4Config
except ImportError:  # the reader's own tests still run
    DeepseekV4Config = None
needs_transformers = pytest.mark.skipif(
    DeepseekV4Config is None, reason="transformers is an optional test dependency (pip install .[hf])"
)

WHERE = "config.json"
# The debug flavor with a vocabulary (its own is the tokenizer's, 0 until a run sets it).
DEBUG = dataclasses.replace(FLAVORS["debug"], vocab_size=300)
# The published config.json files (deepseek-ai/DeepSeek-V4-Flash and deepseek-ai/DeepSeek-V4-Pro), as on the Hub:
# compress_ratios name the MTP layer last.
PUBLISHED = {
    "deepseek_v4_flash": {
        "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128,
        "index_n_heads": 64, "index_topk": 512, "initializer_range": 0.02, "max_position_embeddings": 1048576,
        "model_type": "deepseek_v4", "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43,
        "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
        "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
    "deepseek_v4_pro": {
        "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": 7168, "index_head_dim": 128,
        "index_n_heads": 64, "index_topk": 1024, "initializer_range": 0.02, "max_position_embeddings": 1048576,
        "model_type": "deepseek_v4", "moe_intermediate_size": 3072, "n_routed_experts": 384, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 6, "num_hidden_layers": 61,
        "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 16,
        "o_lora_rank": 1024, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
        "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
        "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    },
}  # fmt: skip
# The debug shape in a published folder's legacy keys: per-layer compress_ratios (the MTP layer's 0 last), the block
# lengths as compress_rate_csa / _hca, the first two layers hash-routed by num_hash_layers, the rotary channels as
# qk_rope_head_dim, a flat YaRN for the compressed layers (no attention_factor: 1.0).
LEGACY_EXPECTED = dataclasses.replace(
    DEBUG,
    rope_scaling=YarnRopeScaling(factor=4.0, original_max_position_embeddings=512, attention_factor=1.0),
    compress_rope_theta=40000.0,
    moe=dataclasses.replace(DEBUG.moe, hash_layers=(0, 1)),
)
MODERN_KEYS = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor", "rope_parameters")


def legacy_config() -> dict:
    config = {k: v for k, v in write(DEBUG).items() if k not in MODERN_KEYS}
    return config | {
        "compress_ratios": [0, 4, 128, 4, 0],
        "compress_rate_csa": DEBUG.csa_rate,
        "compress_rate_hca": DEBUG.hca_rate,
        "num_hash_layers": 2,
        "qk_rope_head_dim": DEBUG.rotary_dim,
        "compress_rope_theta": 40000.0,
        "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 512, "beta_fast": 32,
                         "beta_slow": 1},
    }  # fmt: skip


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_flavor_reads_back_from_what_it_writes(flavor):
    args = FLAVORS[flavor]
    config = write(args)
    assert read(config, WHERE) == args
    # the front door's type check passes what we write (the debug flavor's vocabulary: the run's tokenizer's)
    check_types(write(args if args.vocab_size else DEBUG), WHERE, FIELDS)


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_json_reads_as_its_flavor(flavor):
    """With the multi-token prediction layer the folders name (num_nextn_predict_layers 1; compress_ratios' last
    entry, 0: sliding), which the flavors leave out as transformers' count does. The published folders' experts are
    fp4 (expert_dtype) and their other weights fp8 with power-of-two scales (scale_fmt ue8m0), both read
    (quantization_of says so); a bfloat16 copy's config.json (neither key) reads as the same model."""
    check_types(PUBLISHED[flavor], WHERE, FIELDS)
    published = dataclasses.replace(FLAVORS[flavor], mtp_layers=1, mtp_layer_types=(SLIDING,))
    assert read(PUBLISHED[flavor], WHERE) == published
    assert quantization_of(PUBLISHED[flavor], WHERE) == {
        "method": "fp8", "block": (128, 128), "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    }  # fmt: skip
    bf16 = {k: v for k, v in PUBLISHED[flavor].items() if k not in ("expert_dtype", "quantization_config")}
    assert read(bf16, WHERE) == published


def test_multi_token_prediction_depths_write_and_read_back_with_their_kinds():
    """Depths that are not all sliding write the published compress_ratios beside layer_types (the depths' kinds
    after the layers'); sliding ones need none; a compress_ratios naming fewer depths than declared is refused."""
    csa = dataclasses.replace(DEBUG, mtp_layers=2, mtp_layer_types=(CSA, SLIDING))
    written = write(csa)
    assert written["num_nextn_predict_layers"] == 2 and written["compress_ratios"] == [0, 4, 128, 4, 4, 0]
    assert read(written, WHERE) == csa
    sliding = dataclasses.replace(DEBUG, mtp_layers=1)
    assert "compress_ratios" not in write(sliding) and read(write(sliding), WHERE) == sliding
    short = {**written, "compress_ratios": [0, 4, 128, 4, 4]}
    with pytest.raises(ConfigError, match=r"compress_ratios.*names 1 of the num_nextn_predict_layers=2"):
        read(short, WHERE)


def test_legacy_keys_read_as_the_modern_ones():
    assert read(legacy_config(), WHERE) == LEGACY_EXPECTED


def test_absent_keys_take_transformers_defaults():
    """DeepseekV4Config's defaults are the Flash shape, with its own default layer kinds (two HCA layers, then HCA
    and CSA alternating from HCA) and no YaRN."""
    args = read({"model_type": "deepseek_v4"}, WHERE)
    flash = FLAVORS["deepseek_v4_flash"]
    assert args.layer_types[:4] == (HCA, HCA, HCA, CSA)
    assert args == dataclasses.replace(flash, layer_types=args.layer_types, rope_scaling=None)


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_other_scores_are_read(score):
    args = dataclasses.replace(DEBUG, moe=dataclasses.replace(DEBUG.moe, score_func=score))
    assert write(args)["scoring_func"] == score
    assert read(write(args), WHERE) == args


@needs_transformers
@pytest.mark.parametrize(
    "name, config, expected",
    [
        ("debug", write(DEBUG), DEBUG),
        ("yarn", write(LEGACY_EXPECTED), LEGACY_EXPECTED),
        ("legacy keys", legacy_config(), LEGACY_EXPECTED),
    ],
)
def test_transformers_saves_a_config_json_that_reads_as_the_same_model(name, config, expected):
    saved = DeepseekV4Config(**config).to_dict()
    check_types(saved, WHERE, FIELDS)
    assert read(saved, WHERE) == expected


def nested_rope(main: dict | None = None, **compress) -> dict:
    factor = DEBUG.rotary_dim / DEBUG.head_dim
    return {
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor, **(main or {})},
            "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": factor, **compress},
        }
    }


# (what to change in the debug flavor's config.json, what the one-line refusal names)
REFUSED = {
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "shared experts": ({"n_shared_experts": 2}, "n_shared_experts=2"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "no streams": ({"hc_mult": 0}, "hc_mult=0"),
    "layer types too short": ({"layer_types": [SLIDING, CSA, HCA]}, "layer_types='[3 entries]'"),
    "unknown layer type": ({"layer_types": [SLIDING, "full_attention", HCA, CSA]}, "layer_types='full_attention'"),
    "unknown mlp layer type": ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, "mlp_layer_types='dense'"),
    "mlp layer types too short": ({"mlp_layer_types": ["moe"]}, "mlp_layer_types='[1 entries]'"),
    "unknown compress ratio": ({"layer_types": None, "compress_ratios": [0, 8, 128, 4]}, "compress_ratios[1]=8"),
    "compress rates misspelt": ({"compress_rates": {"compressed_sparse_attn": 2}}, "compress_rates="),
    "o_groups": ({"o_groups": 3}, "o_groups=3 does not divide num_attention_heads=4"),
    "main rope yarn": (nested_rope({"rope_type": "yarn", "factor": 4.0}), "rope_parameters.main.rope_type='yarn'"),
    "compress rope llama3": (nested_rope(rope_type="llama3"), "rope_parameters.compress rope_type='llama3'"),
    "no rotary width": (nested_rope({"partial_rotary_factor": None}), "rope_parameters.main lacks partial_rotary"),
    "attention bias": ({"attention_bias": True}, "attention_bias=True"),
    "not renormalised": ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    "score": ({"scoring_func": "tanh"}, "scoring_func='tanh'"),
    "top-k": ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    "rotary wider than the indexer's heads": (
        {"rope_parameters": None, "partial_rotary_factor": 1.0},
        "qk_rope_head_dim=32; use an even number up to index_head_dim=16",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_deepseek_v4_does_not_compute_is_refused_in_one_line(case):
    changes, named = REFUSED[case]
    config = write(DEBUG) | changes  # a null is read as absent: {"layer_types": None} leaves compress_ratios
    with pytest.raises(ConfigError) as e:
        read(config, WHERE)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"moe": MoEArgs(8, 2, 32, score_func="sqrtsoftplus", norm_topk_prob=True, route_scale=1.5,
                         n_shared_experts=1, balance="bias", swiglu_limit=10.0, dense_layers=(3,))},
         "MoEArgs.dense_layers=[3]"),
        ({"moe": dataclasses.replace(DEBUG.moe, router_bias=True)}, "MoEArgs.router_bias=True"),
        ({"moe": dataclasses.replace(DEBUG.moe, swiglu_limit=0.0)}, "swiglu_limit=0.0"),
        ({"moe": dataclasses.replace(DEBUG.moe, norm_topk_prob=False)}, "MoEArgs.norm_topk_prob=False"),
    ],
)  # fmt: skip
def test_what_a_deepseek_v4_config_cannot_say_is_not_written(changes, named):
    with pytest.raises(ConfigError, match="a deepseek_v4 config.json cannot express") as e:
        write(dataclasses.replace(DEBUG, **changes))
    assert named in str(e.value), str(e.value)
