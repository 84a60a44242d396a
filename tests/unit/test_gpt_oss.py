"""gpt-oss against `transformers`' GptOssForCausalLM: a saved folder imports with its logits to 1e-5 (fp32) on prompts
longer than the sliding window (sinks, biases, YaRN, the biased router, the clamped SwiGLU with a limit the
activations reach), and greedy generation equals transformers' past the window; a trained model exports as
GptOssForCausalLM with our logits and reads back equal; the published config.json fields read as our flavors;
what titanlite does not implement is refused in one line; the experts' biases and activation on the grouped and the
loop paths equal their definition; the flex backend gives SDPA's logits; tensor parallelism (2 ranks) gives the
one-process logits."""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from tests.conformance import (  # noqa: E402
    debug_args,
    exports_as,
    greedy_ids_match,
    imported,
    imports_with_its_logits,
    random_hf,
    tokens,
    trained,
)
from tests.helpers import run_ranks, titanlite_here  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.build import build_model  # noqa: E402
from titanlite.models.common.attention import FlexAttention, build_core  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.common.moe.layer import ClampedSwiGLU, GroupedExperts  # noqa: E402
from titanlite.models.gpt_oss.args import FLAVORS  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402

VOCAB = 300
# GQA (6 query heads, 2 key/value heads), head_dim 24 (not 96 / 6), a window of 8 on every other layer under
# 48-token prompts, 8 experts of width 40 (2 per token), YaRN stretching 16 positions 4 times, untruncated.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=40,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=128,
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0,
    },
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
# A limit the experts' gate and up activations (about +-0.5 here) cross, and another alpha: both clamps count.
CASES = {"published-activation": {}, "clamped": {"swiglu_limit": 0.3, "swiglu_alpha": 1.5}}


def random_gpt_oss(**changes):
    """transformers' GptOssForCausalLM, its weights moved off their init (biases and sinks too)."""
    return random_hf(lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**SHAPE, **changes})))


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_gpt_oss_imports_with_its_logits(tmp_path, case):
    hf = random_gpt_oss(**CASES[case])
    experts = hf.model.layers[0].mlp.experts
    if case == "clamped" and (experts.alpha, experts.limit) != (1.5, 0.3):  # transformers 5.17 (an H100's, 2026-11-28)
        pytest.skip(f"transformers {transformers.__version__} reads neither swiglu_alpha nor swiglu_limit from the "
                    f"config (it keeps alpha {experts.alpha}, limit {experts.limit})")  # fmt: skip
    ours = imports_with_its_logits(hf, tmp_path, tokens(VOCAB))
    assert ours.args.layer_types == ("sliding_attention", "full_attention") * 2 and ours.args.sliding_window == 8


def test_greedy_generation_equals_transformers_past_the_window(tmp_path):
    hf = random_gpt_oss()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), tokens(VOCAB, (12,), seed=2).tolist(), 20, VOCAB)


def test_a_trained_gpt_oss_exports_as_gpt_oss_for_causal_lm_with_our_logits(tmp_path):
    args = debug_args(FLAVORS)
    ours, batch = trained(args, length=41)  # the biases and sinks leave their initial values
    assert ours.layers["0"].feed_forward.experts.b1.abs().max() > 0
    exports_as(ours, args, tmp_path, "GptOssForCausalLM", batch, model_type="gpt_oss")


def test_the_flex_backend_gives_sdpas_logits():
    ours, batch = trained(debug_args(FLAVORS), steps=1, length=41)
    with torch.no_grad():
        sdpa = ours(batch)
        for block in ours.layers.values():
            block.attention.core = build_core("flex", **block.attention.core.options())
        assert all(isinstance(b.attention.core, FlexAttention) and b.attention.core.sinks for b in ours.layers.values())
        torch.testing.assert_close(ours(batch), sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_with_biases_and_the_clamped_swiglu_follow_their_definition(grouped):
    torch.manual_seed(0)
    activation = ClampedSwiGLU(alpha=1.702, limit=0.4)
    experts = GroupedExperts(16, 8, 3, use_grouped_mm=grouped, bias=True, activation=activation)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(7, 16, requires_grad=True)
    out = experts(x, counts)
    expected = []
    for row, e in zip(x, [0, 0, 0, 2, 2, 2, 2]):
        gate = (experts.w1[e] @ row + experts.b1[e]).clamp(max=0.4)
        up = (experts.w3[e] @ row + experts.b3[e]).clamp(-0.4, 0.4)
        expected.append(experts.w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + experts.b2[e])
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-6)
    weights = torch.randn(7, 16)  # (a plain sum's gradient, stride 0, is one grouped_mm's backward refuses)
    grads = []
    for result in (out, torch.stack(expected)):  # both paths differentiate the biases, as the definition does
        (result * weights).sum().backward()
        grads.append([t.grad.clone() for t in (x, *experts.parameters())])
        x.grad = None
        experts.zero_grad()
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert grads[0][-1].abs().max() > 0  # b2's


# The fields of openai/gpt-oss-20b's and gpt-oss-120b's config.json (transformers 4.55's form: top-level
# rope_theta and rope_scaling) that shape the model; their quantization_config is dropped, as a dequantized copy's.
PUBLISHED = {
    "gpt_oss_20b": {"num_hidden_layers": 24, "num_local_experts": 32},
    "gpt_oss_120b": {"num_hidden_layers": 36, "num_local_experts": 128},
}


def published(flavor: str) -> dict:
    n_layers = PUBLISHED[flavor]["num_hidden_layers"]
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (n_layers // 2),
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_key_value_heads": 8, "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088, **PUBLISHED[flavor],
    }  # fmt: skip


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_reads_as_its_flavor(flavor):
    """(Their parameter counts against transformers': tests/unit/test_hf_families.py, every published flavor.)"""
    assert args_from_hf_config(published(flavor)) == FLAVORS[flavor]


def test_a_config_without_the_optional_keys_takes_transformers_defaults():
    config = transformers.GptOssConfig(num_hidden_layers=4).to_dict()
    theirs = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters", "sliding_window")}
    assert args_from_hf_config(theirs) == args_from_hf_config(config)


REFUSED = {
    "quantization_config \\(quant_method 'awq'\\)": {"quantization_config": {"quant_method": "awq"}},
    "experts_per_token=3": {"experts_per_token": 3},
    "mlp_bias=True": {"mlp_bias": True},
    "rope_type='longrope'": {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
    "layer_types=['chunked_attention']": {"layer_types": ["chunked_attention"] * 4},
    "num_experts_per_tok=9": {"num_experts_per_tok": 9},
}


@pytest.mark.parametrize("field", REFUSED)
def test_what_titanlite_does_not_implement_is_refused_in_one_line(field):
    config = {**transformers.GptOssConfig(**SHAPE).to_dict(), **REFUSED[field]}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value)
    if field.startswith("quantization_config"):
        assert "titanlite reads fp8 (block-scaled e4m3) and mxfp4 folders" in str(e.value)


def test_check_refuses_a_quantization_it_does_not_read_with_exit_2(tmp_path):
    random_gpt_oss().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bnb"}}))
    proc = titanlite_here("check", "--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path), "--model.tokenizer",
                          "byte")  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "quant_method 'bnb'" in proc.stderr and "titanlite reads fp8" in proc.stderr


def _tp_logits(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titanlite.parallel.parallelize import materialize
    from titanlite.parallel.tensor_parallel import apply_tp

    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = build_model("gpt_oss", "debug", 320, 64)
    init_weights(whole, 0)
    with torch.device("meta"):
        split = build_model("gpt_oss", "debug", 320, 64)
    apply_tp(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), loss_parallel=False, chunked_loss=False)
    materialize(split, torch.device("cpu"), seed=0)
    sinks = split.layers["0"].attention.sinks
    assert isinstance(sinks, DTensor) and sinks.to_local().shape == (2,)  # 4 heads, 2 per rank
    torch.testing.assert_close(split(tokens), whole(tokens), rtol=1e-5, atol=1e-5)
    split(tokens).square().mean().backward()
    whole(tokens).square().mean().backward()
    for block in ("0", "1"):
        ours, theirs = split.layers[block].attention.sinks.grad, whole.layers[block].attention.sinks.grad
        torch.testing.assert_close(ours.full_tensor(), theirs, rtol=1e-4, atol=1e-7)


def test_tensor_parallel_gives_the_one_process_logits_and_sink_gradients():
    run_ranks(_tp_logits)
