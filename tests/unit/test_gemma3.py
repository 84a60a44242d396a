"""Gemma 3 (text) against `transformers`' Gemma3ForCausalLM: a saved folder imports with its logits to 1e-5 (fp32)
and greedy ids, on prompts longer than the sliding window, with both RoPE bases and linear scaling of the full
layers; a trained model exports as Gemma3ForCausalLM with our logits and reads back equal; the published
config.json fields read as our flavors; what Gemma 3 does not use is refused in one line; tensor parallelism
(2 ranks) gives the one-process logits; `titanlite check` takes the debug flavor."""

import subprocess

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
from tests.helpers import run_ranks, titanlite_here  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.models.build import build_model  # noqa: E402
from titanlite.models.common.attention import FlexAttention  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.gemma3.args import FLAVORS  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402

VOCAB = 300
# GQA (6 query heads, 2 key/value heads), head_dim 24 (not 96 / 6), a window of 8 under 48-token prompts,
# every third layer full (rope_theta 1e6, linear factor 8), the others sliding (rope_local_base_freq 1e4).
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    sliding_window=8,
    sliding_window_pattern=3,
    query_pre_attn_scalar=20,
    max_position_embeddings=128,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CASES = {"tied": {}, "untied-bias": {"tie_word_embeddings": False, "attention_bias": True}}


def random_gemma3(**changes):
    """transformers' Gemma3ForCausalLM, its weights moved off their init (the zero norms too)."""
    return random_hf(lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**SHAPE, **changes})))


@pytest.mark.parametrize("case", CASES)
def test_a_transformers_gemma3_imports_with_its_logits(tmp_path, case):
    ours = imports_with_its_logits(random_gemma3(**CASES[case]), tmp_path, tokens(VOCAB))
    assert ours.args.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2


def test_gemma3_on_the_flex_backend_gives_transformers_logits_and_sdpas_gradients(tmp_path):
    """Gemma 3's windows, softmax scale and alternating layers through flex's core (its CPU path, keys in
    chunks of 16, so a 48-token prompt spans several): transformers' logits, and SDPA's gradients."""
    hf = random_gemma3()
    hf.save_pretrained(tmp_path)
    batch = tokens(VOCAB)
    grads = {}
    for backend in ("sdpa", "flex"):
        ours = imported(tmp_path, 64, "--model.attn_backend", backend)
        assert isinstance(ours.layers["0"].attention.core, FlexAttention) == (backend == "flex")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(FlexAttention, "CHUNK", 16)
            logits = ours(batch)
        with torch.no_grad():
            assert_logits_match(logits, hf(batch).logits)
        logits.square().mean().backward()
        grads[backend] = {name: p.grad for name, p in ours.named_parameters()}
    for name, grad in grads["flex"].items():
        torch.testing.assert_close(grad, grads["sdpa"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_greedy_generation_equals_transformers_past_the_window(tmp_path):
    hf = random_gemma3()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), tokens(VOCAB, (12,), seed=2).tolist(), 20, VOCAB)


def test_a_trained_gemma3_exports_as_gemma3_for_causal_lm_with_our_logits(tmp_path):
    args = debug_args(FLAVORS)
    ours, batch = trained(args, length=41)
    assert ours.layers["0"].post_ffn_norm.weight.abs().max() > 0  # the (1 + w) norms leave their zeros
    exports_as(ours, args, tmp_path, "Gemma3ForCausalLM", batch, model_type="gemma3_text")


# The text fields of google/gemma-3-*-pt's config.json (the 4B, 12B and 27B ones under text_config), in
# transformers 4.x's form: top-level rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern.
PUBLISHED = {
    "gemma3_1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                      max_position_embeddings=32768, vocab_size=262144, rope_scaling=None),
    "gemma3_4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                      max_position_embeddings=131072, vocab_size=262208),
    "gemma3_12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                       max_position_embeddings=131072, vocab_size=262208),
    "gemma3_27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                       max_position_embeddings=131072, vocab_size=262208),
}  # fmt: skip


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_reads_as_its_flavor(flavor):
    """(Their parameter counts against transformers': tests/unit/test_hf_families.py, every published flavor.)"""
    config = {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        **PUBLISHED[flavor],
    }
    assert args_from_hf_config(config) == FLAVORS[flavor]


REFUSED = {
    "final_logit_softcapping=30.0": {"final_logit_softcapping": 30.0},
    "attn_logit_softcapping=50.0": {"attn_logit_softcapping": 50.0},
    "use_bidirectional_attention=True": {"use_bidirectional_attention": True},
    "hidden_activation='gelu'": {"hidden_activation": "gelu"},
    "rope_type='yarn'": {
        "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    },
}


@pytest.mark.parametrize("field", REFUSED)
def test_what_gemma3_does_not_use_is_refused_in_one_line(field):
    config = {**transformers.Gemma3TextConfig(**SHAPE).to_dict(), **REFUSED[field]}
    with pytest.raises(ConfigError, match=field) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value)


def check(*args: str) -> subprocess.CompletedProcess:
    return titanlite_here("check", *args)


def test_check_takes_the_debug_flavor_and_refuses_a_softcapped_folder_with_exit_2(tmp_path, cli):
    proc = cli("check", "--model.name", "gemma3", "--model.flavor", "debug")  # passes: in this process
    assert proc.returncode == 0, proc.stderr[-2000:]
    random_gemma3(final_logit_softcapping=30.0).save_pretrained(tmp_path)
    # The refusal: a process of its own, whose exit status and one line are what the user gets.
    proc = check("--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path), "--model.tokenizer", "byte")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "final_logit_softcapping=30.0 is not supported" in proc.stderr


def _tp_logits(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.parallel.parallelize import materialize
    from titanlite.parallel.tensor_parallel import apply_tp

    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(4))
    whole = build_model("gemma3", "debug", 320, 64)
    init_weights(whole, 0)
    with torch.device("meta"):
        split = build_model("gemma3", "debug", 320, 64)
    apply_tp(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), loss_parallel=False, chunked_loss=False)
    materialize(split, torch.device("cpu"), seed=0)
    with torch.no_grad():
        torch.testing.assert_close(split(tokens), whole(tokens), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_gives_the_one_process_logits():
    run_ranks(_tp_logits)
