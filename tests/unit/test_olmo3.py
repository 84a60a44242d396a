"""OLMo 3 against `transformers`' Olmo3ForCausalLM: a saved folder imports with its logits to 1e-5 (fp32) on prompts
longer than the sliding window, with YaRN on the full layers only (the sliding ones unscaled) and without; 4.x's
top-level rope_scaling reads the same; greedy ids equal; a trained model exports as Olmo3ForCausalLM with our logits
and reads back equal; the published config.json fields read as our flavors (their parameter counts:
tests/unit/test_hf_families.py); what OLMo 3 does not use is refused in one line."""

import json

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
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402
from titanlite.models.olmo3 import FLAVORS  # noqa: E402

VOCAB = 300
THETA = 1e4
# GQA (6 query heads, 2 key/value heads), head_dim 24 (not 96 / 6), a window of 8 under 48-token prompts, layers
# 0-2 sliding and layer 3 full (transformers' default pattern); YaRN stretching 16 positions 4 times on layer 3.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    sliding_window=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": THETA}
ROPE = {
    "yarn": {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": THETA}},
    "plain": {kind: {"rope_type": "default", "rope_theta": THETA} for kind in ("full_attention", "sliding_attention")},
}


def random_olmo3(rope: str = "yarn", **changes):
    """transformers' Olmo3ForCausalLM, its weights moved off their init (the norms too)."""
    config = transformers.Olmo3Config(**{**SHAPE, "rope_parameters": ROPE[rope], **changes})
    return random_hf(lambda: transformers.Olmo3ForCausalLM(config))


TOKENS = tokens(VOCAB)


@pytest.mark.parametrize("rope", ["yarn", pytest.param("plain", marks=pytest.mark.slow)])
def test_a_transformers_olmo3_imports_with_its_logits(tmp_path, rope):
    ours = imports_with_its_logits(random_olmo3(rope), tmp_path, TOKENS)
    assert ours.args.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert (ours.args.sliding_window, ours.args.qk_norm, ours.args.norm_position) == (8, "full", "post")
    full, sliding = ours.args.layer_rope["full_attention"], ours.args.layer_rope["sliding_attention"]
    assert (full.scaling is not None, sliding.scaling) == (rope == "yarn", None)


@pytest.mark.slow
def test_the_older_top_level_rope_scaling_applies_to_the_full_layers_only(tmp_path):
    """transformers 4.x's form: rope_theta and rope_scaling at the top level; Olmo3Config puts the scaling on the
    full layers only. (Its sliding layers then keep the default base, 500000, whatever rope_theta says: so here
    rope_theta is that default, and any other is refused below.)"""
    hf = random_olmo3(rope_parameters={"full_attention": {**YARN, "rope_theta": 500000.0}})
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    yarn = {k: v for k, v in YARN.items() if k != "rope_theta"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": yarn}))
    ours = imported(tmp_path)
    assert ours.args.layer_rope["sliding_attention"].scaling is None
    assert ours.args.layer_rope["full_attention"].scaling is not None
    with torch.no_grad():
        assert_logits_match(ours(TOKENS), hf(TOKENS).logits)


@pytest.mark.slow
def test_greedy_generation_equals_transformers_past_the_window(tmp_path):
    hf = random_olmo3()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), tokens(VOCAB, (12,), seed=2).tolist(), 20, VOCAB)


@pytest.mark.slow
def test_a_trained_olmo3_exports_as_olmo3_for_causal_lm_with_our_logits(tmp_path):
    args = debug_args(FLAVORS)
    ours, batch = trained(args, length=41)  # the norms leave their ones
    exports_as(ours, args, tmp_path, "Olmo3ForCausalLM", batch, model_type="olmo3")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"]["full_attention"]["rope_type"] == "yarn"


# allenai/Olmo-3-1025-7B's and Olmo-3-1125-32B's config.json (transformers 4.x's form, as published).
PUBLISHED = {
    "olmo3_7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32),
    "olmo3_32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                      num_key_value_heads=8),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_reads_as_its_flavor(flavor):
    n_layers = PUBLISHED[flavor]["num_hidden_layers"]
    config = {
        "model_type": "olmo3",
        "architectures": ["Olmo3ForCausalLM"],
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000,
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                         "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079441541679836},
        "sliding_window": 4096,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)],
        "tie_word_embeddings": False,
        "vocab_size": 100278,
        **PUBLISHED[flavor],
    }  # fmt: skip
    assert args_from_hf_config(config) == FLAVORS[flavor]


REFUSED = {
    "partial_rotary_factor": {"rope_parameters": {"full_attention": {**YARN, "partial_rotary_factor": 0.5}}},
    "rope_type='longrope'": {"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": THETA}}},
    "rope_theta=10000.0": {"rope_theta": 1e4, "rope_parameters": None, "rope_scaling": {"rope_type": "linear"}},
    "rope_parameters=['rope_theta', 'rope_type']": {"rope_parameters": {"rope_type": "default", "rope_theta": THETA}},
    "sliding_window=None": {"sliding_window": None},
    "mlp_bias=True": {"mlp_bias": True},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
}


@pytest.mark.slow
@pytest.mark.parametrize("field", REFUSED)
def test_what_olmo3_does_not_use_is_refused_in_one_line(field):
    config = {**transformers.Olmo3Config(**SHAPE, rope_parameters=ROPE["yarn"]).to_dict(), **REFUSED[field]}
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value)
