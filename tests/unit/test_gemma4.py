"""Gemma 4 (text) against `transformers`' Gemma4ForCausalLM and Gemma4ForConditionalGeneration: random tiny models
with every switch on (per-layer embeddings, layers reusing keys and values with double-wide MLPs, keys equal to
values on the full layers, wider full heads with fewer key/value heads, sliding and full layers with proportional
partial rotary, the logit softcap, a mixture of experts beside each MLP, layer scalars off one) import with their
logits to 1e-5 (fp32) and greedy ids past the window; a trained model exports as Gemma4ForCausalLM with our logits;
a multimodal folder imports its text model and exports back with its vision and audio towers bit for bit; the
published text_config fields read as our flavors; what titanlite does not build is refused in one line. (Published
flavors' parameter counts against transformers': tests/unit/test_hf_families.py.)"""

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
    trained,
)
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import WeightReader, save_hf  # noqa: E402
from titanlite.models.gemma4.args import FLAVORS, MOE_FLAVORS, layer_types  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402

VOCAB = 300
# 6 layers (sliding, sliding, full) x 2; sliding heads 16 wide over 2 key/value heads, full ones 32 wide over 1 with
# keys equal to values, a quarter of their pairs rotating; the last 2 layers reuse layers 3's and 4's keys and values
# (the last sliding and full ones before them) with MLPs twice as wide; per-layer inputs of 8; 4 experts, top 2.
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
    use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=128, pad_token_id=None,
    bos_token_id=None, eos_token_id=None, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=24,
)  # fmt: skip
CASES = {
    "moe": {},
    "dense-untied-bias": {"enable_moe_block": False, "num_experts": None, "top_k_experts": None,
                          "moe_intermediate_size": None, "tie_word_embeddings": False, "attention_bias": True},
    "no-sharing-full-rotary": {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "attention_k_eq_v": False,
                               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}},
}  # fmt: skip


def moved_off_init(model):
    """The model (built under seed 0) with every weight moved off its init (norms and scales too, seeded with 0
    again) and its layer scalars off one."""
    model = random_hf(lambda: model)
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.fill_(0.9)
    return model


def random_gemma4(**changes):
    torch.manual_seed(0)
    return moved_off_init(transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**TEXT, **changes})))


def tokens(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_transformers_gemma4_with_every_switch_imports_with_its_logits(tmp_path):
    ours = imports_with_its_logits(random_gemma4(), tmp_path, tokens())
    assert ours.layers["4"].attention.wk is None and ours.layers["2"].attention.wv is None
    assert ours.layers["5"].feed_forward.w1.out_features == 192


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "moe"])
def test_other_switches_import_with_their_logits(tmp_path, case):
    imports_with_its_logits(random_gemma4(**CASES[case]), tmp_path, tokens())


@pytest.mark.slow
def test_greedy_generation_equals_transformers_past_the_window(tmp_path):
    """The KV cache: layers that reuse keys and values keep the new tokens' in their own cache."""
    hf = random_gemma4()
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path, 64), tokens(1, 12, 2)[0].tolist(), 20, VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_a_trained_gemma4_exports_as_gemma4_for_causal_lm_with_our_logits(tmp_path, family):
    args = debug_args(FLAVORS if family == "gemma4" else MOE_FLAVORS, per_layer_dim=8)
    ours, batch = trained(args, steps=2, length=41)
    for layer in ours.layers.values():
        layer.layer_scalar.fill_(0.75)  # a buffer: exported too
    # transformers' own save (per_layer_config), read by the one reader as family gemma4
    gemma4 = dataclasses.replace(args, family="gemma4")
    exports_as(ours, args, tmp_path, "Gemma4ForCausalLM", batch, model_type="gemma4_text", reads_back=gemma4)


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16, patch_size=4, position_embedding_size=64)  # fmt: skip
AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
             subsampling_conv_channels=[8, 4])  # fmt: skip


@pytest.mark.slow
def test_a_multimodal_folder_imports_its_text_model_and_exports_its_towers_back(tmp_path, caplog):
    torch.manual_seed(0)
    text = {**TEXT, "pad_token_id": 0}  # the multimodal model pads image and audio ids with it
    config = transformers.Gemma4Config(text_config=text, vision_config=VISION, audio_config=AUDIO)
    hf = moved_off_init(transformers.Gemma4ForConditionalGeneration(config))
    hf.save_pretrained(tmp_path / "hf")  # the towers' clipping bounds infinite (transformers' fresh ones): carried too
    with caplog.at_level(logging.INFO):
        ours = imported(tmp_path / "hf", 64)
    said = [r.getMessage() for r in caplog.records if "does not train" in r.getMessage()]
    assert (
        len(said) == 1
        and "model.audio_tower.*, model.embed_audio.*, model.embed_vision.*, model.vision_tower.*" in said[0]
    )
    with torch.no_grad():
        assert_logits_match(ours(tokens()), hf(input_ids=tokens()).logits)
        ours.layers["0"].feed_forward.w1.weight.add_(0.01)  # "trained"
    save_hf(tmp_path / "out", ours.args, ours.state_dict(), carry_from=tmp_path / "hf")
    source, export = WeightReader(tmp_path / "hf"), WeightReader(tmp_path / "out")
    towers = [k for k in source.keys() if not k.startswith("model.language_model.")]
    assert towers and set(export.keys()) == set(source.keys())
    assert any(source.stored(name).isinf().any() for name in towers)
    for name in towers:
        assert torch.equal(export.stored(name), source.stored(name)), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        written["model_type"] == "gemma4"
        and written["vision_config"] == json.loads((tmp_path / "hf" / "config.json").read_text())["vision_config"]
    )
    # The export is the source model with the "training" applied, bit for bit: transformers reading it back gives the
    # logits of the source model given the same change, bit for bit (ours against transformers is the import's 1e-5
    # check above; ours against this changed model differs by float32 noise alone, 1.1e-5 of its largest logit).
    back = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        hf.model.language_model.layers[0].mlp.gate_proj.weight.add_(0.01)
        assert torch.equal(back(input_ids=tokens()).logits, hf(input_ids=tokens()).logits)


# The text fields of google/gemma-4-{E2B,E4B,31B,26B-A4B}'s config.json (text_config), as published; the other fields
# are transformers' defaults there (rope_parameters: sliding default 1e4, full proportional 0.25 of 1e6).
PUBLISHED = {
    "gemma4_e2b": dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
                       hidden_size_per_layer_input=256, num_kv_shared_layers=20, use_double_wide_mlp=True,
                       max_position_embeddings=131072, layer_types=list(layer_types(35, 5))),
    "gemma4_e4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
                       hidden_size_per_layer_input=256, num_kv_shared_layers=18, use_double_wide_mlp=False,
                       max_position_embeddings=131072, layer_types=list(layer_types(42, 6))),
    "gemma4_31b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, num_attention_heads=32,
                       num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
                       attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=0,
                       max_position_embeddings=262144, layer_types=list(layer_types(60, 6))),
    "gemma4_26b_a4b": dict(hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
                           num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
                           attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=0,
                           enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                           max_position_embeddings=262144, layer_types=list(layer_types(30, 6))),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flavor", PUBLISHED)
def test_a_published_config_reads_as_its_flavor(flavor):
    text = {"model_type": "gemma4_text", "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
            "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision", **PUBLISHED[flavor]}  # fmt: skip
    config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    ours = MOE_FLAVORS[flavor] if flavor in MOE_FLAVORS else FLAVORS[flavor]
    assert args_from_hf_config(config) == dataclasses.replace(ours, family="gemma4")  # one reader: family gemma4


REFUSED = {
    "use_bidirectional_attention": lambda c: {**c, "use_bidirectional_attention": "all"},
    "hidden_activation": lambda c: {**c, "hidden_activation": "silu"},
    "rope_parameters full_attention rope_type": lambda c: {
        **c, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}, "sliding_attention": {}}},
    "layer_types": lambda c: {**c, "layer_types": ["full_attention", "sliding_attention"] * 3},
    "vocab_size_per_layer_input": lambda c: {**c, "vocab_size_per_layer_input": 128},
    "per_layer_config": lambda c: {**c, "per_layer_config": {"2": {"head_dim": 32}, "5": {"head_dim": 64}}},
    "num_experts": lambda c: {**c, "enable_moe_block": False},
    "num_kv_shared_layers": lambda c: {**c, "num_kv_shared_layers": 5},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("key", REFUSED)
def test_what_titanlite_does_not_build_is_refused_in_one_line(key):
    """In a published folder's text_config (use_bidirectional_attention "vision" is read there: it changes the
    attention of image tokens only; "all" is refused)."""
    config = {"model_type": "gemma4", "text_config": REFUSED[key]({"model_type": "gemma4_text", **TEXT})}
    with pytest.raises(ConfigError) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value) and f"text_config {key}=" in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flavor, options, refusal",
    [
        ("debug", ["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree=2 cannot cut the layers "
         "reusing earlier layers' keys and values (num_kv_shared_layers), which a later stage would lack; use 1"),
        ("gemma4_e2b", ["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree=2 cannot split the "
         "per-layer embeddings (hidden_size_per_layer_input), which every layer reads for the whole sequence; use 1"),
    ],
)  # fmt: skip
def test_the_layouts_a_model_cannot_take_are_refused_before_launch(flavor, options, refusal):
    from titanlite.builder.plan import plan_run
    from titanlite.config import parse_config

    cfg = parse_config(["--model.name", "gemma4", "--model.flavor", flavor, "--model.tokenizer", "byte", *options])
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace(")", r"\)")) as e:
        plan_run(cfg, 2)  # what `titanlite train` plans before it launches a worker
    assert "\n" not in str(e.value)


def test_an_export_refuses_the_routing_a_gemma4_config_json_cannot_say():
    """Routing biases (moe.balance 'bias') have no place in a Gemma 4 folder: left out, the export would route
    otherwise than the model trained."""
    from titanlite.components.hf_weights import hf_config

    args = dataclasses.replace(MOE_FLAVORS["debug"], vocab_size=VOCAB, family="gemma4_moe")
    hf_config(args, "float32", {})  # as trained by default (no biases): expressible
    biased = dataclasses.replace(args, moe=dataclasses.replace(args.moe, balance="bias"))
    with pytest.raises(ConfigError, match="a gemma4 config.json cannot express moe.balance='bias'"):
        hf_config(biased, "float32", {})
