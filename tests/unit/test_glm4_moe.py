"""GLM-4.5 against `transformers`' Glm4MoeForCausalLM (fp32, CPU): random models (half of each head rotated, QKV
biases, per-head Q/K norms on and off, 2 expert groups of which 1 is kept, a non-zero correction bias, a shared
expert, a dense first layer) import with transformers' logits to 1e-5 and greedy ids; a trained model exports as
Glm4MoeForCausalLM with our logits and reads back equal; a folder's multi-token prediction layer is left out in one
line and carried into an export bit for bit; a GLM-4.5-FP8 folder (e4m3 in 128 x 128 blocks) imports with the logits of
its dequantized weights; bad config.json values are refused in one line; the published shapes count transformers'
parameters, and their config.json reads as the flavors."""

import dataclasses
import json
import logging

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from safetensors.torch import load_file  # noqa: E402

from tests.conformance import (  # noqa: E402
    assert_logits_match,
    debug_args,
    exports_as,
    greedy_ids_match,
    imported,
    imports_with_its_logits,
    random_hf,
    tokens,
    trained,
)
from tests.unit.test_quantized_folders import fp8_folders, imported_logits, rewrite  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_quantized import quantize_fp8  # noqa: E402
from titanlite.components.hf_weights import WeightReader, check_tensors, load_hf_into, save_hf  # noqa: E402
from titanlite.models.build import model_from_args, with_mtp_layers  # noqa: E402
from titanlite.models.common.moe.layer import MoE, update_balance_bias  # noqa: E402
from titanlite.models.glm4_moe.args import FLAVORS  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args, folder_model_args, hf_config  # noqa: E402

VOCAB = 300
# 4 heads of 24 (2 for keys and values), 12 channels of each rotated; QKV biases, per-head Q/K norms; 8 experts of 32
# in 2 groups (1 kept), 2 per token, one shared; the first layer dense (FFN 96).
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    rope_theta=1e4,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
CASES = {
    "qk_norm-bias-groups": {},
    "air-like": {"use_qk_norm": False, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    "no_bias-quarter_rotary-two_shared": {
        "attention_bias": False,
        "partial_rotary_factor": 0.25,
        "n_shared_experts": 2,
    },
    "yarn": {"rope_parameters": {**YARN, "partial_rotary_factor": 0.5}},
}


def random_glm(**changes):
    """transformers' Glm4MoeForCausalLM, its weights (biases and norms too) moved off their init and its correction
    biases non-zero."""
    return random_hf(
        lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**{**SHAPE, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),
    )


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=() if not i else pytest.mark.slow) for i, c in enumerate(CASES)]
)
def test_a_folder_imports_with_transformers_logits(tmp_path, case):
    hf = random_glm(**CASES[case])
    ours = imports_with_its_logits(hf, tmp_path, tokens(VOCAB))
    assert ours.args.rotary_dim == int(ours.args.head_dim * hf.config.rope_parameters["partial_rotary_factor"])
    biases = [m.router.expert_bias for m in ours.modules() if isinstance(m, MoE)]
    assert len(biases) == 2 and all(b is not None and b.count_nonzero() for b in biases)  # imported, not left at 0


@pytest.mark.slow
def test_greedy_generation_equals_transformers(tmp_path):
    hf = random_glm()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), [5, 17, 42, 7, 99], 12, VOCAB)


def balance_biases(model) -> None:
    """Bias balancing after a step, as a run does: the routing biases move."""
    for m in model.modules():
        if isinstance(m, MoE):
            update_balance_bias(m, m.step_tokens, 0.05)
            m.step_tokens.zero_()


@pytest.mark.slow
def test_a_trained_model_exports_as_glm4_moe_with_our_logits(tmp_path):
    """A few steps of training with bias balancing (the biases move), then an export that transformers loads."""
    args = debug_args(FLAVORS)
    ours, batch = trained(args, after_step=balance_biases)
    assert all(m.router.expert_bias.count_nonzero() for m in ours.modules() if isinstance(m, MoE))
    exports_as(ours, args, tmp_path, "Glm4MoeForCausalLM", batch)


@pytest.mark.slow
def test_a_multi_token_prediction_layer_is_left_out_in_one_line_and_exported_bit_for_bit(tmp_path, caplog):
    """A published folder's layer past num_hidden_layers (num_nextn_predict_layers 1): a whole decoder layer (built
    by transformers as a fourth layer) and the prediction head's own tensors, with model.mtp_layers = 0 (trained by
    default: tests/unit/test_multi_token_prediction.py)."""
    hf = random_glm(num_hidden_layers=4)
    hf.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    extra = {
        "enorm.weight": (64,),
        "hnorm.weight": (64,),
        "eh_proj.weight": (64, 128),
        "shared_head.norm.weight": (64,),
    }
    weights |= {f"model.layers.3.{name}": torch.randn(shape) for name, shape in extra.items()}
    mtp = {k: v for k, v in weights.items() if k.startswith("model.layers.3.")}
    rewrite(tmp_path / "hf", weights, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1})
    reference = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported(tmp_path / "hf", 64, "--model.mtp_layers", "0")
    # Reading the folder says nothing of num_nextn_predict_layers (a run's start-up line does): the import's one line.
    told = [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in ("nextn", "also holds"))]
    assert len(told) == 1 and f"also holds {len(mtp)} tensors the model does not train (model.layers.*)" in told[0]
    with torch.no_grad():
        assert_logits_match(ours(tokens(VOCAB)), reference(tokens(VOCAB)).logits)
    save_hf(tmp_path / "export", ours.args, ours.state_dict(), carry_from=tmp_path / "hf")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in mtp.items())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_match(back(tokens(VOCAB)).logits, ours(tokens(VOCAB)))
    # A prediction layer of another width is not this model's: refused before a run (hf_carried_shapes)
    weights["model.layers.3.eh_proj.weight"] = torch.randn(64, 96)
    rewrite(tmp_path / "hf", weights, {})
    with pytest.raises(ConfigError, match="'model.layers.3.eh_proj.weight', carried"):
        check_tensors(with_mtp_layers(folder_model_args(tmp_path / "hf"), 0), WeightReader(tmp_path / "hf"))


FP8_BLOCK = [128, 128]  # GLM-4.5-FP8's weight_block_size


@pytest.mark.slow
def test_a_glm4_5_fp8_folder_imports_with_the_logits_of_its_dequantized_weights(tmp_path, caplog):
    """The projections (attention, dense MLP, experts, shared experts) in e4m3 with a float32 weight_scale_inv per
    128 x 128 block as published, the widths (160, 80, 192, 48) leaving partial blocks at the edges; the router,
    biases, norms, embedding and head as they were. transformers reads the dequantized copy."""
    shape = dict(hidden_size=160, intermediate_size=192, moe_intermediate_size=48, head_dim=40, num_hidden_layers=2)
    folder, stored, reference = fp8_folders(
        random_glm(**shape), tmp_path, lambda name: name.endswith("_proj.weight"), FP8_BLOCK
    )
    assert sum(name.endswith("_scale_inv") for name in stored) == 4 + 3 + 8 * 3 + 3 + 4  # layer 0's attention and
    # MLP, layer 1's experts and shared expert
    assert stored["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported_logits(folder, tokens(VOCAB))
    assert "is quantized (fp8 (e4m3) in 128 x 128 blocks, quantization_config)" in caplog.text
    with torch.no_grad():
        theirs = reference(tokens(VOCAB)).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (theirs - random_glm(**shape)(tokens(VOCAB)).logits).abs().max() > 1e-4  # the blocks' rounding shows


def config_json(**changes) -> dict:
    return {**transformers.Glm4MoeConfig(**SHAPE).to_dict(), **changes}


REFUSED = {
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "mlp_bias=True": {"mlp_bias": True},
    "use_qk_norm='true'": {"use_qk_norm": "true"},
    "partial_rotary_factor=0.3": {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}},
    "partial_rotary_factor=0.0": {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.0}},
    "first_k_dense_replace=4": {"first_k_dense_replace": 4},
    "num_experts_per_tok=9": {"num_experts_per_tok": 9},
    "n_group=3": {"n_group": 3},
    "topk_group=3": {"topk_group": 3},
    "sliding_window=16": {"sliding_window": 16},
    "quant_method 'gptq'": {"quantization_config": {"quant_method": "gptq", "bits": 4}},
    "rope_type='llama3'": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "partial_rotary_factor": 0.5,
        },
    },  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("named", REFUSED)
def test_what_is_not_implemented_is_refused_in_one_line(named):
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config_json(**REFUSED[named]), "config.json:")
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).count("config.json:") == 1, str(e.value)


@pytest.mark.slow
def test_what_a_glm4_moe_config_cannot_say_is_not_exported():
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=320)
    with pytest.raises(ConfigError, match="cannot express MoEArgs.score_func='softmax'"):
        hf_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax")))
    with pytest.raises(ConfigError, match="cannot express out_bias=True"):
        hf_config(dataclasses.replace(args, out_bias=True))


# The published config.json files (zai-org/GLM-4.5, GLM-4.5-Air, GLM-4.6), their fields that change the math.
PUBLISHED = {
    "glm4_5": {
        "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92, "first_k_dense_replace": 3,
        "moe_intermediate_size": 1536, "n_routed_experts": 160, "routed_scaling_factor": 2.5, "use_qk_norm": True,
        "max_position_embeddings": 131072,
    },
    "glm4_5_air": {
        "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46, "first_k_dense_replace": 1,
        "moe_intermediate_size": 1408, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "use_qk_norm": False,
        "max_position_embeddings": 131072,
    },
    "glm4_6": {
        "hidden_size": 5120, "intermediate_size": 12288, "num_hidden_layers": 92, "first_k_dense_replace": 3,
        "moe_intermediate_size": 1536, "n_routed_experts": 160, "routed_scaling_factor": 2.5, "use_qk_norm": True,
        "max_position_embeddings": 202752,
    },
}  # fmt: skip
COMMON = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "num_attention_heads": 96, "num_key_value_heads": 8, "partial_rotary_factor": 0.5,
    "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": False, "vocab_size": 151552, "attention_dropout": 0.0, "torch_dtype": "bfloat16",
}  # fmt: skip


def count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.slow
@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_reads_as_its_flavor_with_transformers_parameter_count(flavor):
    """The flavors leave multi-token prediction out (model.mtp_layers adds it); a folder's config.json says it."""
    mtp = {**COMMON, **PUBLISHED[flavor]}.get("num_nextn_predict_layers", 0)
    assert args_from_hf_config({**COMMON, **PUBLISHED[flavor]}) == dataclasses.replace(FLAVORS[flavor], mtp_layers=mtp)
    with torch.device("meta"):
        ours = model_from_args(FLAVORS[flavor])
        theirs = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**hf_config(FLAVORS[flavor])))
    assert count(ours) == count(theirs), (count(ours), count(theirs))


@pytest.mark.slow
def test_an_fp8_folder_exports_its_blocks_and_reads_back(tmp_path):
    """checkpoint.export_quantized on a GLM folder: the projections written in 128 x 128 blocks again."""
    hf = random_glm(num_hidden_layers=2)
    hf.save_pretrained(tmp_path / "fp8")
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    for name in [n for n, t in stored.items() if t.dim() == 2 and n.endswith("_proj.weight")]:
        stored[name], stored[name + "_scale_inv"] = quantize_fp8(stored[name], tuple(FP8_BLOCK))
    rewrite(tmp_path / "fp8", stored, {"quantization_config": {"quant_method": "fp8", "weight_block_size": FP8_BLOCK}})
    args = folder_args(tmp_path / "fp8", 64)
    model = model_from_args(args)
    load_hf_into([model], tmp_path / "fp8")
    save_hf(tmp_path / "export", args, model.state_dict(), carry_from=tmp_path / "fp8", quantized=True)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported["model.layers.1.mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    with torch.no_grad():
        first = model.eval()(tokens(VOCAB))
    torch.testing.assert_close(imported_logits(tmp_path / "export", tokens(VOCAB)), first, rtol=1e-5, atol=1e-5)
