"""MiniMax-M2 against `transformers`' MiniMaxM2ForCausalLM (fp32, CPU): a random model (head_dim 24 of which 12
rotate, whole-projection Q/K norms, sigmoid routing with non-zero correction biases) imports with transformers'
logits to 1e-5 and greedy ids; a trained model exports as MiniMaxM2ForCausalLM with our logits and reads back equal;
the published config.json reads as the flavor; what is not implemented is refused in one line; a folder's
multi-token prediction layers are named once, left out and carried bit for bit into an export; the published shape
counts transformers' parameters (tests/unit/test_hf_families.py) and about 10B of them per token."""

import dataclasses
import json
import logging

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

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
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import load_hf_into, save_hf  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.flops import active_parameters  # noqa: E402
from titanlite.models.common.moe.layer import MoE, update_balance_bias  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args, hf_config  # noqa: E402
from titanlite.models.minimax_m2.args import FLAVORS  # noqa: E402

VOCAB = 300
# 4 query and 2 key/value heads of 24 channels, the leading 12 of each rotating; 8 experts of width 32, 3 per token.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    rotary_dim=12,
    rope_theta=1e4,
    num_local_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
# MiniMaxAI/MiniMax-M2's config.json as published, less its quantization_config (fp8 blocks) and auto_map.
PUBLISHED = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "model_type": "minimax_m2",
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "rms_norm_eps": 1e-06,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "transformers_version": "4.46.1",
    "use_cache": True,
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}


def random_minimax(**changes):
    """transformers' MiniMaxM2ForCausalLM, its weights (norms too) moved off their init, its correction biases
    non-zero."""
    return random_hf(
        lambda: transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**{**SHAPE, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    hf = random_minimax()
    path = tmp_path_factory.mktemp("minimax_m2")
    hf.save_pretrained(path)
    return hf, path


def test_a_folder_imports_with_transformers_logits(folder):
    hf, path = folder
    ours = imports_with_its_logits(hf, path, tokens(VOCAB))  # (saved again: the same files)
    assert ours.args.rotary_dim == 12 and ours.args.qk_norm == "full" and ours.args.moe.score_func == "sigmoid"
    with torch.no_grad():
        expected = hf(tokens(VOCAB)).logits
        # the imported correction biases choose the experts: without them the logits differ
        for m in ours.modules():
            if isinstance(m, MoE):
                m.router.expert_bias.zero_()
        assert (ours(tokens(VOCAB)) - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.slow
def test_greedy_generation_equals_transformers(folder):
    hf, path = folder
    greedy_ids_match(hf, imported(path), [5, 17, 42, 7, 99], 12, VOCAB)


def balance_biases(model) -> None:
    """Bias balancing after a step, as a run does: the routing biases move."""
    for m in model.modules():
        if isinstance(m, MoE):
            update_balance_bias(m, m.step_tokens, 0.05)
            m.step_tokens.zero_()


@pytest.mark.slow
def test_a_trained_model_exports_as_minimax_m2_with_our_logits(tmp_path):
    """A few steps of training with bias balancing (the biases move), then an export that transformers loads."""
    args = debug_args(FLAVORS)
    ours, batch = trained(args, after_step=balance_biases)
    assert all(m.router.expert_bias.count_nonzero() for m in ours.modules() if isinstance(m, MoE))
    hf = exports_as(ours, args, tmp_path, "MiniMaxM2ForCausalLM", batch)
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5 and hf.config.rotary_dim == 8


@pytest.mark.slow
def test_the_published_config_reads_as_the_flavor():
    assert args_from_hf_config(PUBLISHED) == FLAVORS["minimax_m2"]
    # transformers' form: the factor in rope_parameters, no rotary_dim
    factor = {k: v for k, v in PUBLISHED.items() if k not in ("rotary_dim", "rope_theta")} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}
    }
    assert args_from_hf_config(factor) == FLAVORS["minimax_m2"]


def config_json(**changes) -> dict:
    return {**transformers.MiniMaxM2Config(**SHAPE).to_dict(), **changes}


REFUSED = {
    "attn_type_list[1]=0": {"attn_type_list": [1, 0, 1]},
    "attn_type_list=[1, 1]": {"attn_type_list": [1, 1]},
    "qk_norm_type='per_head'": {"qk_norm_type": "per_head"},
    "use_qk_norm=False": {"use_qk_norm": False},
    "scoring_func='softmax'": {"scoring_func": "softmax"},
    "use_routing_bias=False": {"use_routing_bias": False},
    "shared_intermediate_size=512": {"shared_intermediate_size": 512},
    "norm_topk_prob=False": {"norm_topk_prob": False},
    "attention_bias=True": {"attention_bias": True},
    "sliding_window=16": {"sliding_window": 16},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "rope_type='yarn'": {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.5}
    },
    "rope_parameters.partial_rotary_factor=0.25": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    },  # rotary_dim 12 says half of each head of 24
    "rotary_dim=7": {"rotary_dim": 7, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "num_experts_per_tok=9": {"num_experts_per_tok": 9},
    "num_mtp_modules=-1": {"use_mtp": True, "num_mtp_modules": -1},
}


@pytest.mark.slow
@pytest.mark.parametrize("named", REFUSED)
def test_what_is_not_implemented_is_refused_in_one_line(named):
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config_json(**REFUSED[named]), "config.json:")
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow
def test_what_a_minimax_m2_config_cannot_say_is_not_exported():
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=320)
    with pytest.raises(ConfigError, match="cannot express MoEArgs.score_func='softmax'"):
        hf_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax")))
    with pytest.raises(ConfigError, match="cannot express qk_norm='head'"):
        hf_config(dataclasses.replace(args, qk_norm="head"))
    with pytest.raises(ConfigError, match="cannot express .*MoEArgs.dense_layers=\\[1\\]"):
        hf_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, dense_layers=(1,))))


@pytest.mark.slow
def test_multi_token_prediction_is_named_once_left_out_and_carried_bit_for_bit(folder, tmp_path, caplog):
    """A folder declaring MTP and holding a layer past the decoder (as MiniMax's inference code names them): one
    line at the config, the layer left out of the run with one line, carried unchanged into an export whose
    config.json still declares it; the export loads in transformers with our logits."""
    from safetensors.torch import load_file, save_file

    hf, path = folder
    source = tmp_path / "hf"
    hf.save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "use_mtp": True, "num_mtp_modules": 1}))
    weights = load_file(source / "model.safetensors")
    mtp = {"model.layers.3.enorm.weight": torch.randn(64), "model.layers.3.eh_proj.weight": torch.randn(64, 128)}
    save_file({**weights, **mtp}, source / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="titanlite"):
        args = folder_args(source, 64)
        model = model_from_args(args)
        load_hf_into([model], source)  # reads config.json again: not named again
    named = [r.getMessage() for r in caplog.records if "multi-token" in r.getMessage()]
    assert len(named) == 1 and "num_mtp_modules=1" in named[0], named
    assert "also holds 2 tensors the model does not train (model.layers.*)" in caplog.text
    save_hf(tmp_path / "export", args, model.state_dict(), carry_from=source)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in mtp.items())
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["use_mtp"], config["num_mtp_modules"]) == (True, 1)
    back = transformers.MiniMaxM2ForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_logits_match(model.eval()(tokens(VOCAB)), back(tokens(VOCAB)).logits)
        assert_logits_match(back(tokens(VOCAB)).logits, hf(tokens(VOCAB)).logits)


@pytest.mark.slow
def test_the_published_shape_is_230b_of_which_about_10b_per_token():
    """Its parameter count equals transformers' (test_hf_families' test_a_published_shape_counts_transformers_
    parameters); MiniMax's model card: 230B total, 10B activated (without the embedding and output tables, 1.2B)."""
    with torch.device("meta"):
        ours = model_from_args(FLAVORS["minimax_m2"])
    total = sum(p.numel() for p in ours.parameters())
    tables = ours.tok_embeddings.weight.numel() + ours.output.weight.numel()
    assert 228e9 < total < 231e9 and 9.5e9 < active_parameters(ours) - tables < 10.5e9, (total, tables)


@pytest.mark.slow
def test_a_published_style_fp8_folder_imports_with_the_logits_of_its_dequantized_weights(tmp_path):
    """MiniMax-M2's folders as published: attention and experts in e4m3 with a weight_scale_inv per 128 x 128 block,
    the format named fmt "float8_e4m3fn"; the router, norms, embedding and head as they were."""
    from tests.unit.test_quantized_folders import fp8_folders, imported_logits

    folder, _, reference = fp8_folders(
        random_minimax(), tmp_path, lambda n: n.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")),
        [128, 128], "float8_e4m3fn",
    )  # fmt: skip
    batch = tokens(VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(imported_logits(folder, batch), reference(batch).logits, rtol=1e-5, atol=1e-5)
