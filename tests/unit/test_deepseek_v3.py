"""DeepSeek-V3 against `transformers`' DeepseekV3ForCausalLM (fp32, CPU): random models (query compression on and
off, YaRN with mscale_all_dim, 4 expert groups of which 2 are kept, a non-zero correction bias, both rotary layouts)
import with transformers' logits to 1e-5 and greedy ids; a trained model exports as DeepseekV3ForCausalLM with our
logits and reads back equal; what is not implemented is refused in one line; multi-token prediction left out is said
in one line (tests/unit/test_multi_token_prediction.py imports it);
the published shapes count transformers' parameters (DeepSeek-V2-Lite's, DeepseekV2ForCausalLM's)."""

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
from titanlite.components.hf_weights import save_hf  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.common.moe.args import MoEArgs  # noqa: E402
from titanlite.models.common.moe.layer import MoE, update_balance_bias  # noqa: E402
from titanlite.models.deepseek_v3.args import FLAVORS  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, hf_config  # noqa: E402

VOCAB = 300
# 4 heads of key 16 + 8 rotary, value 12 (not the key's width); query rank 24, latent 32; 8 experts in 4 groups,
# 2 groups and 3 experts per token, one shared; the first layer dense.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 1e4,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
CASES = {
    "q_lora-groups": {},
    "no_q_lora-one_group": {"q_lora_rank": None, "n_group": 1, "topk_group": 1},
    "yarn": {"rope_parameters": YARN, "max_position_embeddings": 64},
    "rotate_half": {"rope_interleave": False},
}


def random_deepseek(**changes):
    """transformers' DeepseekV3ForCausalLM, its weights moved off their init and its correction biases non-zero."""
    return random_hf(
        lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE, **changes})),
        buffers=lambda name: name.endswith("e_score_correction_bias"),
    )


@pytest.mark.parametrize("case", CASES)
def test_a_folder_imports_with_transformers_logits(tmp_path, case):
    imports_with_its_logits(random_deepseek(**CASES[case]), tmp_path, tokens(VOCAB))


def test_the_correction_bias_and_the_group_limit_choose_the_experts(tmp_path):
    """The logits above depend on both: without the imported bias, or without the group limit, they differ."""
    hf = random_deepseek()
    hf.save_pretrained(tmp_path)
    ours = imported(tmp_path)
    with torch.no_grad():
        expected = hf(tokens(VOCAB)).logits
        biases = [m.router.expert_bias for m in ours.modules() if isinstance(m, MoE)]
        assert all(b is not None and b.count_nonzero() for b in biases)  # imported, not left at zero
        saved = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        assert (ours(tokens(VOCAB)) - expected).abs().max() > 1e-3 * expected.abs().max()
        for b, s in zip(biases, saved):
            b.copy_(s)
        for m in ours.modules():
            if isinstance(m, MoE):
                m.router.args = dataclasses.replace(m.args, topk_groups=4)
        assert (ours(tokens(VOCAB)) - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("case", ["q_lora-groups", "yarn"])
def test_greedy_generation_equals_transformers(tmp_path, case):
    hf = random_deepseek(**CASES[case])
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), [5, 17, 42, 7, 99], 12, VOCAB)


def balance_biases(model) -> None:
    """Bias balancing after a step, as a run does: the routing biases move."""
    for m in model.modules():
        if isinstance(m, MoE):
            update_balance_bias(m, m.step_tokens, 0.05)
            m.step_tokens.zero_()


def test_a_trained_model_exports_as_deepseek_v3_with_our_logits(tmp_path):
    """A few steps of training with bias balancing (the biases move), then an export that transformers loads."""
    args = debug_args(FLAVORS)
    ours, batch = trained(args, after_step=balance_biases)
    assert all(m.router.expert_bias.count_nonzero() for m in ours.modules() if isinstance(m, MoE))
    exports_as(ours, args, tmp_path, "DeepseekV3ForCausalLM", batch)


def test_a_rotate_half_folder_exports_back_in_its_own_layout(tmp_path):
    hf = random_deepseek(rope_interleave=False)
    hf.save_pretrained(tmp_path / "in")
    ours = imported(tmp_path / "in")
    save_hf(tmp_path / "out", ours.args, ours.state_dict())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.rope_interleave is False
    with torch.no_grad():
        assert_logits_match(back(tokens(VOCAB)).logits, hf(tokens(VOCAB)).logits)


def config_json(**changes) -> dict:
    return {**transformers.DeepseekV3Config(**SHAPE).to_dict(), **changes}


REFUSED = {
    "scoring_func='softmax'": {"scoring_func": "softmax"},
    "topk_method='group_limited_greedy'": {"topk_method": "group_limited_greedy"},
    "topk_method='greedy'": {"topk_method": "greedy"},  # with a group limit (n_group 4, topk_group 2)
    "moe_layer_freq=2": {"moe_layer_freq": 2},
    "attention_bias=True": {"attention_bias": True},
    "num_key_value_heads=2": {"num_key_value_heads": 2},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "quant_method 'gptq'": {"quantization_config": {"quant_method": "gptq", "bits": 4}},
    "weight_block_size=None": {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}},
    "n_group=3": {"n_group": 3},
    "rope_type='llama3'": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 1e4,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },  # fmt: skip
}


@pytest.mark.parametrize("named", REFUSED)
def test_what_is_not_implemented_is_refused_in_one_line(named):
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config_json(**REFUSED[named]), "config.json:")
    assert named in str(e.value) and "\n" not in str(e.value)


def test_greedy_without_a_group_limit_is_the_same_routing():
    args = args_from_hf_config(config_json(topk_method="greedy", n_group=1, topk_group=1))
    assert args.moe.n_groups == 1 and args.moe.score_func == "sigmoid"


def test_multi_token_prediction_is_left_out_with_mtp_layers_0_in_one_line(tmp_path, caplog):
    """model.mtp_layers = 0: the folder's MTP layer (here one tensor of it) is not read, which the import says in its
    one checkpoint line; reading the folder says nothing of num_nextn_predict_layers (a run's start-up line does:
    tests/unit/test_multi_token_prediction.py, which imports a whole one)."""
    hf = random_deepseek()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.3.enorm.weight"] = torch.ones(64)  # an MTP layer's tensor, past num_hidden_layers
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ours = imported(tmp_path, 64, "--model.mtp_layers", "0")
    told = [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in ("nextn", "also holds"))]
    assert len(told) == 1 and "also holds 1 tensors the model does not train (model.layers.*)" in told[0], told
    with torch.no_grad():
        assert_logits_match(ours(tokens(VOCAB)), hf(tokens(VOCAB)).logits)


def test_what_a_deepseek_v3_config_cannot_say_is_not_exported():
    args = dataclasses.replace(FLAVORS["debug"], vocab_size=320)
    with pytest.raises(ConfigError, match="cannot express MoEArgs.score_func='softmax'"):
        hf_config(dataclasses.replace(args, moe=dataclasses.replace(args.moe, score_func="softmax")))


def count(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("flavor", ["deepseek_v3_671b", "moonlight_16b_a3b"])
def test_a_published_shape_counts_transformers_parameters(flavor):
    with torch.device("meta"):
        ours = model_from_args(FLAVORS[flavor])
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_config(FLAVORS[flavor])))
    assert count(ours) == count(theirs), (count(ours), count(theirs))


def test_deepseek_v2_lite_counts_transformers_deepseek_v2_parameters():
    """DeepSeek-V2-Lite's published config.json, built by transformers' DeepseekV2ForCausalLM."""
    v2_lite = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
        n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", norm_topk_prob=False,
        routed_scaling_factor=1.0, max_position_embeddings=163840, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        ours = model_from_args(FLAVORS["deepseek_v2_lite"])
        theirs = transformers.DeepseekV2ForCausalLM(v2_lite)
    assert count(ours) == count(theirs), (count(ours), count(theirs))


def test_group_limited_routing_needs_groups_that_hold_the_choices():
    with pytest.raises(ValueError, match="topk_groups=1 groups"):
        MoEArgs(n_experts=8, top_k=3, expert_dim=4, n_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="n_groups=3; use a divisor"):
        MoEArgs(n_experts=8, top_k=2, expert_dim=4, n_groups=3)


def _tp_gradients(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titanlite.models.build import build_model
    from titanlite.parallel.parallelize import materialize
    from titanlite.parallel.tensor_parallel import apply_tp

    batch = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = build_model("deepseek_v3", "debug", 320, 64)
    init_weights(whole, 0)
    with torch.device("meta"):
        split = build_model("deepseek_v3", "debug", 320, 64)
    apply_tp(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), loss_parallel=False, chunked_loss=False)
    materialize(split, torch.device("cpu"), seed=0)
    weights = torch.randn(2, 40, 320, generator=torch.Generator().manual_seed(5))
    for model in (whole, split):
        logits = model(batch)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        torch.testing.assert_close(logits, whole(batch), rtol=1e-5, atol=1e-5)
        (logits * weights).sum().backward()
    expected = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        scale = expected[name].grad.abs().max()
        assert (grad - expected[name].grad).abs().max() <= 1e-5 * scale, name


def test_tensor_parallel_gives_the_one_process_logits_and_gradients():
    """TP x 2: the per-head projections split by heads, the latent ones whole on each rank, every gradient equal."""
    from tests.helpers import run_ranks

    run_ranks(_tp_gradients)


def test_check_refuses_an_fp8_folder_missing_a_scale_in_one_line_with_exit_2(tmp_path):
    """An FP8 folder (tests/unit/test_quantized_folders.py imports them) whose weight lost its scale_inv: exit 2,
    one line naming the tensor, before anything runs."""

    from safetensors.torch import load_file, save_file

    from tests.helpers import titanlite_here

    random_deepseek().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)  # and no o_proj.weight_scale_inv
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    proc = titanlite_here("check", "--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path), "--model.tokenizer",
                          "byte")  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"tensor {name!r} is fp8 but the folder has no '{name}_scale_inv'" in proc.stderr


# The published config.json files (deepseek-ai/DeepSeek-V3 without its quantization_config, and
# moonshotai/Moonlight-16B-A3B), as on the Hub.
PUBLISHED = {
    "deepseek_v3_671b": {
        "architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
        "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    },
    "moonlight_16b_a3b": {
        "architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "bos_token_id": 163584,
        "eos_token_id": 163585, "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 11264, "kv_lora_rank": 512, "max_position_embeddings": 8192,
        "model_type": "deepseek_v3", "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
        "vocab_size": 163840,
    },
}  # fmt: skip


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_json_reads_as_its_flavor(flavor):
    """The flavors leave multi-token prediction out (model.mtp_layers adds it); a folder's config.json says it."""
    mtp = PUBLISHED[flavor]["num_nextn_predict_layers"]
    assert args_from_hf_config(PUBLISHED[flavor]) == dataclasses.replace(FLAVORS[flavor], mtp_layers=mtp)
    assert args_from_hf_config(hf_config(FLAVORS[flavor])) == FLAVORS[flavor]


def test_a_folder_with_routing_biases_is_refused_into_a_model_balanced_otherwise(tmp_path):
    """--moe.balance aux_loss builds routers without a bias: the folder's non-zero biases would be silently lost."""
    from titanlite.components.hf_weights import load_hf_into
    from titanlite.config import parse_config
    from titanlite.models.build import configured_model

    random_deepseek().save_pretrained(tmp_path)
    cfg = parse_config(
        ["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path), "--model.tokenizer", "byte",
         "--training.seq_len", "64", "--moe.balance", "aux_loss"]
    )  # fmt: skip
    model = configured_model(cfg.model, 257, 64, cfg.moe)
    with pytest.raises(ConfigError, match="e_score_correction_bias.*set moe.balance = 'bias'") as e:
        load_hf_into([model], tmp_path)
    assert "\n" not in str(e.value)
