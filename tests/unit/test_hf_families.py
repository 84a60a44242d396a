"""The families the Llama decoder builds by switches (Qwen2/2.5, Qwen3, SmolLM3, Mistral, OLMo2, and Llama's own
biases) against `transformers` itself: random models of unusual shapes (GQA, head_dim != hidden / heads, tied
and untied) import with transformers' logits to 1e-5 (fp32), both RoPE forms of config.json; greedy generation
equals transformers'; a few training steps, then an export that transformers loads as the same class, with our
logits; what is not implemented is refused in one line; the published shapes count transformers' parameters."""

import dataclasses
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
from titanlite.config import parse_config  # noqa: E402
from titanlite.models.build import model_from_args  # noqa: E402
from titanlite.models.common.rope_args import YarnRopeScaling  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, folder_args, hf_config  # noqa: E402
from titanlite.models.registry import names, spec_named  # noqa: E402
from titanlite.parallel.tensor_parallel import check_tp_degree  # noqa: E402

FLAVORS = {name: spec_named(name).flavors for name in names()}  # every family's sizes, by model.name
VOCAB = 300
# GQA (6 query heads, 2 key/value heads) and head_dim 24, not 96 / 6 = 16; untied; 4 layers.
SHAPE = dict(
    hidden_size=96,
    intermediate_size=200,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**{k: v for k, v in SHAPE.items() if k != "head_dim"}),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE),
    "qwen3-tied-bias": lambda: transformers.Qwen3Config(**{**SHAPE, "tie_word_embeddings": True}, attention_bias=True),
    "smollm3": lambda: transformers.SmolLM3Config(**SHAPE, no_rope_layer_interval=2),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
    "olmo2": lambda: transformers.Olmo2Config(**{**SHAPE, "num_key_value_heads": 6}),
    "llama-biases": lambda: transformers.LlamaConfig(**SHAPE, attention_bias=True, mlp_bias=True),
    # Sliding windows shorter than the prompts (48 tokens; 5 + 12 in generation): every layer (Mistral), the
    # layers from max_window_layers on (Qwen2), the layers layer_types names (Qwen3).
    "mistral-window": lambda: transformers.MistralConfig(**SHAPE, sliding_window=8),
    "qwen2-window": lambda: transformers.Qwen2Config(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"},
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=2,
    ),  # fmt: skip
    "qwen3-window": lambda: transformers.Qwen3Config(
        **SHAPE,
        use_sliding_window=True,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),  # fmt: skip
    # YaRN stretching an original context of 16 positions 4 times (the prompts run past it).
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **SHAPE,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4},
    ),  # fmt: skip
}
CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "olmo_hybrid": "OlmoHybridForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}


def random_model(case: str):
    """A transformers model of the case's family, its weights moved off their init (norms and biases too)."""
    return random_hf(lambda: transformers.AutoModelForCausalLM.from_config(FAMILIES[case]()))


@pytest.mark.parametrize("case", FAMILIES)
def test_a_family_imports_with_transformers_logits(tmp_path, case):
    imports_with_its_logits(random_model(case), tmp_path, tokens(VOCAB))


@pytest.mark.parametrize("case", ["qwen3", "smollm3"])
def test_the_older_top_level_rope_form_reads_the_same(tmp_path, case):
    """transformers 4.x folders keep rope_theta (and rope_scaling) at the top level, not in rope_parameters."""
    hf = random_model(case)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    theta = config["rope_parameters"]["rope_theta"]
    config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": theta, "rope_scaling": None}))
    assert args_from_hf_config(config | {"rope_theta": theta}).rope_theta == theta
    batch = tokens(VOCAB, (1, 40), seed=2)
    with torch.no_grad():
        assert_logits_match(imported(tmp_path)(batch), hf(batch).logits)


@pytest.mark.parametrize("case", FAMILIES)
def test_greedy_generation_equals_transformers(tmp_path, case):
    hf = random_model(case)
    hf.save_pretrained(tmp_path)
    greedy_ids_match(hf, imported(tmp_path), [5, 17, 42, 7, 99], 12, VOCAB)


@pytest.mark.parametrize("case", ["qwen3", pytest.param("smollm3", marks=pytest.mark.slow)])
def test_the_generate_command_continues_like_transformers(tmp_path, case, monkeypatch, cli):
    """`titanlite generate` itself on the folder. The command picks among the tokenizer's ids only, so the
    model's vocabulary here is the byte tokenizer's 257 ids, where transformers' argmax picks among the same."""
    monkeypatch.setitem(SHAPE, "vocab_size", 257)
    hf = random_model(case)
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out.json"
    folder = ["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path / "hf"), "--model.tokenizer", "byte"]
    proc = cli("generate", "--prompt", "Hello, world", "--max-new-tokens", "12", *folder, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert record["stop"] == "max-new-tokens"
    assert record["new_ids"] == theirs[0, len(record["prompt_ids"]) :].tolist()


WINDOWS = {  # the windowed exports: every layer (Mistral), the layers layer_types names (Qwen2, Qwen3)
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": (
        "qwen2",
        {"sliding_window": 8, "layer_types": ("full_attention",) * 2 + ("sliding_attention",) * 2},
    ),
    "qwen3-window": ("qwen3", {"sliding_window": 8, "layer_types": ("sliding_attention", "full_attention") * 2}),
    "llama3-yarn": ("llama3", {"rope_scaling": YarnRopeScaling(factor=8.0, original_max_position_embeddings=8)}),
}


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "smollm3", "olmo2", "mistral", *WINDOWS])
def test_a_trained_model_exports_as_its_own_class_with_our_logits(tmp_path, family):
    family, changes = WINDOWS.get(family, (family, {}))
    args = debug_args(FLAVORS[family], **changes)
    ours, batch = trained(args)
    exports_as(ours, args, tmp_path, CLASSES[family], batch)


REFUSED = {
    "model_type='gemma'": lambda c: {**c, "model_type": "gemma"},
    "mlp_bias=True": lambda c: {**c, "mlp_bias": True},
    "rope_type='longrope'": lambda c: {**c, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
    "layer_types=['chunked_attention']": lambda c: {**c, "layer_types": ["chunked_attention"] * 4},
    "num_experts=8": lambda c: {**c, "num_experts": 8},
}


@pytest.mark.parametrize("field", REFUSED)
def test_what_titanlite_does_not_implement_is_refused_in_one_line(field):
    config = REFUSED[field](random_model("qwen3").config.to_dict())
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        args_from_hf_config(config)
    assert "\n" not in str(e.value)


def test_a_sliding_window_shorter_than_the_sequence_is_read_with_the_whole_context(tmp_path):
    """The window is attention's (each layer's, FAMILIES' window cases check the logits); the context stays the
    folder's max_position_embeddings, and a longer training.seq_len extends RoPE as without a window."""
    config = transformers.Qwen2Config(
        **{k: v for k, v in SHAPE.items() if k != "head_dim"}, use_sliding_window=True, sliding_window=32,
        max_window_layers=3,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    args = folder_args(tmp_path, 48)
    assert (args.max_seq_len, args.sliding_window) == (128, 32)
    assert args.layer_types == ("full_attention",) * 3 + ("sliding_attention",)
    assert folder_args(tmp_path, 256).max_seq_len == 256


def test_whole_projection_qk_norms_take_tensor_parallelism():
    """The shared plan shards qk_norm 'full' with the heads (titanlite/models/common/parallelize.py
    WholeProjectionNorm; the losses on TP x 2: tests/distributed/test_olmo3.py): the launch check takes TP 2."""
    for family in ("olmo2", "olmo3", "olmo_hybrid"):
        check_tp_degree(2, FLAVORS[family]["debug"], 32)


def test_a_switch_its_family_cannot_express_is_not_exported(tmp_path):
    args = dataclasses.replace(FLAVORS["qwen2"]["debug"], vocab_size=320, qk_norm="head")
    with pytest.raises(ConfigError, match="a qwen2 config.json cannot express qk_norm='head'"):
        hf_config(args)


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen3_moe"])
def test_full_layers_among_sliding_ones_are_not_exported_where_every_layer_slides(family):
    """Mistral's, Mixtral's and Qwen3-MoE's attention slides on every layer once sliding_window is set: a model
    whose layer_types keep some layers full would load there as another model."""
    mixed = ("sliding_attention", "full_attention") * 2
    args = dataclasses.replace(FLAVORS[family]["debug"], vocab_size=320, sliding_window=8, layer_types=mixed)
    with pytest.raises(ConfigError, match=r"cannot express layer_types=.*full layers among sliding ones"):
        hf_config(args)
    every = dataclasses.replace(args, layer_types=("sliding_attention",) * 4)
    assert hf_config(every)["sliding_window"] == 8


PUBLISHED = [
    (family, flavor)
    for family, flavors in FLAVORS.items()
    for flavor in flavors
    # DeepSeek-V2-Lite's shape scores with softmax, which a deepseek_v3 config.json cannot say: its count is
    # DeepseekV2ForCausalLM's (tests/unit/test_deepseek_v3.py).
    # The debug flavors (debug_full, debug_moe, ...) are no published shape (their vocabulary: the tokenizer's).
    if family not in ("gpt2", "llama3") and not flavor.startswith("debug") and flavor != "deepseek_v2_lite"
]


@pytest.mark.parametrize("family, flavor", PUBLISHED)
def test_a_published_shape_counts_transformers_parameters(family, flavor):
    """Built from our config.json of the flavor, transformers' model (on the meta device) has our parameters."""
    with torch.device("meta"):
        ours = model_from_args(FLAVORS[family][flavor])
        config = transformers.AutoConfig.for_model(**hf_config(FLAVORS[family][flavor]))
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert type(theirs).__name__ == CLASSES[family]
    count = lambda m: sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())  # noqa: E731
    assert count(ours) == count(theirs), (count(ours), count(theirs))


def test_plan_of_smollm3_3b_counts_transformers_parameters(cli):
    proc = cli("plan", "--model.flavor", "smollm3_3b", "--ngpu", "4", "--training.seq_len", "8192")
    assert proc.returncode == 0, proc.stderr
    config = transformers.SmolLM3Config(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.SmolLM3ForCausalLM(config).parameters())
    assert f"titanlite plan: smollm3 smollm3_3b, {expected:,} parameters" in proc.stdout, proc.stdout[:400]
    assert "recommended:" in proc.stdout and "ZeRO-3 4 (config)" in proc.stdout


def test_a_flavor_only_one_family_has_selects_it():
    assert parse_config(["--model.flavor", "qwen3_8b"]).model.name == "qwen3"
    with pytest.raises(ConfigError, match="model.flavor='qwen3_8b' is a qwen3 flavor, not a gpt2 one"):
        parse_config(["--model.name", "gpt2", "--model.flavor", "qwen3_8b"])
