"""Hugging Face models of any shape (model.flavor = "hf"): the folder's config.json fields that change the
math are honoured (logits equal transformers' to 1e-5 in fp32) or refused with one line naming the field;
explicit keys that contradict the folder are refused; sharded safetensors go in and out."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.base.hf_config import read_config  # noqa: E402
from titanlite.components.hf_weights import load_hf_into, save_hf  # noqa: E402
from titanlite.config import parse_config  # noqa: E402
from titanlite.models.build import configured_model, model_from_args  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config  # noqa: E402

RTOL = 1e-5


def unusual_llama(**overrides) -> "transformers.LlamaForCausalLM":
    """GQA, untied, head_dim != hidden / heads, rope_theta 10000, rms_norm_eps 1e-6 and llama3 RoPE scaling
    whose original context (16) is shorter than the test's sequences, so every branch of it is used."""
    config = dict(
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=300,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides})).eval()


def unusual_gpt2(**overrides) -> "transformers.GPT2LMHeadModel":
    """256 learned positions, an MLP of 100 (not 4 x 48), exact GELU, layer_norm_epsilon 1e-6."""
    config = dict(
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_positions=256,
        n_inner=100,
        activation_function="gelu",
        layer_norm_epsilon=1e-6,
        vocab_size=300,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides})).eval()


@torch.no_grad()
def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Noise on every parameter, so norms are not all ones nor biases zeros: a swapped tensor shows."""
    gen = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def hf_cfg(folder, *extra: str):
    # model.tokenizer byte: these folders have no tokenizer.json, and byte's 257 ids fit their 300.
    return parse_config(
        ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte", *extra]
    )


def imported(folder, seq_len: int = 32) -> torch.nn.Module:
    """titanlite's own path: configured_model on the meta device's shape, then load_hf_into."""
    cfg = hf_cfg(folder, "--training.seq_len", str(seq_len))
    model = configured_model(cfg.model, 257, cfg.training.seq_len)
    model.init_buffers()
    load_hf_into([model], folder)
    return model.eval()


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    assert diff <= RTOL * scale, (
        f"max logit difference {diff:.3g} is more than {RTOL:g} of the largest logit {scale:.3g}"
    )


@pytest.mark.parametrize("make", [unusual_llama, unusual_gpt2], ids=["llama", "gpt2"])
def test_unusual_shapes_import_with_transformers_logits(tmp_path, make):
    hf = perturb(make())
    hf.save_pretrained(tmp_path)
    seq_len = 48 if make is unusual_llama else 256  # past the llama3 scaling's original context; GPT-2's every position
    model = imported(tmp_path, seq_len)
    tokens = torch.randint(0, 300, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_match(model(tokens), hf(tokens).logits)


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """The scaling is applied, not just accepted: without it the same weights give other logits."""
    hf = perturb(unusual_llama())
    hf.save_pretrained(tmp_path)
    config = read_config(tmp_path)
    config.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    plain = imported(tmp_path, 48)
    tokens = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (plain(tokens) - hf(tokens).logits).abs().max() > 1e-3


def test_export_of_an_unusual_shape_round_trips_through_transformers(tmp_path):
    hf = perturb(unusual_llama())
    hf.save_pretrained(tmp_path / "in")
    model = imported(tmp_path / "in", 48)
    save_hf(tmp_path / "out", model.args, model.state_dict(), max_shard_bytes=100_000)  # several shards
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert back.config.head_dim == 24 and back.config.rms_norm_eps == 1e-6
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_match(back(tokens).logits, hf(tokens).logits)
    assert args_from_hf_config(read_config(tmp_path / "out")) == model.args


def test_the_folder_names_the_family_and_its_math(tmp_path):
    unusual_llama().save_pretrained(tmp_path)
    cfg = hf_cfg(tmp_path)
    assert cfg.model.name == "llama3"  # the default config's gpt2 is not the user's choice: taken from the folder
    args = configured_model(cfg.model, 257, 32).args
    assert (args.head_dim, args.rope_theta, args.norm_eps, args.tie_embeddings, args.vocab_size) == (
        24,
        10000.0,
        1e-6,
        False,
        300,
    )
    assert args.rope_scaling.factor == 8.0


@pytest.mark.parametrize("key,value", [("model.name", "gpt2"), ("model.n_layers", "2")])
def test_explicit_keys_that_contradict_the_folder_are_refused(tmp_path, key, value):
    unusual_llama().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=f"{key}=.*contradicts") as e:
        hf_cfg(tmp_path, f"--{key}", value)
    assert "\n" not in str(e.value)


def test_a_named_flavor_refuses_a_folder_whose_math_differs(tmp_path):
    """rope_theta 10000 into the llama3 debug flavor (500000) used to load silently, 11 % off."""
    unusual_llama(
        hidden_size=64,
        intermediate_size=192,
        num_attention_heads=4,
        head_dim=16,
        num_hidden_layers=4,
        rope_scaling=None,
        rms_norm_eps=1e-5,
    ).save_pretrained(tmp_path)
    cfg = parse_config(["--model.name", "llama3", "--model.tokenizer", "byte"])
    model = configured_model(cfg.model, 257, 32)
    with pytest.raises(ConfigError, match=r"rope_theta=10000.0.*model.flavor = 'hf'"):
        load_hf_into([model], tmp_path)


@pytest.mark.parametrize(
    "family, change, words",
    [
        ("mistral", {"sliding_window": 8}, r"sliding_window=8"),
        ("gpt_oss", {"swiglu_limit": 3.0}, r"swiglu_limit=3.0"),
        ("gemma3", {"query_pre_attn_scalar": 20.0}, r"query_pre_attn_scalar=20.0"),
    ],
)
def test_a_named_flavor_refuses_a_folder_whose_window_or_family_switch_differs(tmp_path, family, change, words):
    """A folder's sliding window, or a family's own switches (gpt-oss's clamp, Gemma 3's score scale), into the
    same family's named flavor without them loaded silently into other math."""
    cfg = parse_config(["--model.name", family, "--model.tokenizer", "byte"])
    named = configured_model(cfg.model, 257, 32)
    folder_args = dataclasses.replace(named.args, **change)
    save_hf(tmp_path, folder_args, model_from_args(folder_args).state_dict())
    with pytest.raises(ConfigError, match=words + r".*model.flavor = 'hf'") as e:
        load_hf_into([named], tmp_path)
    assert "\n" not in str(e.value)


def test_gpt2_positions_advice_works(tmp_path):
    unusual_gpt2().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"use training.seq_len <= 256") as e:
        configured_model(hf_cfg(tmp_path, "--training.seq_len", "512").model, 257, 512)
    assert "\n" not in str(e.value)
    assert configured_model(hf_cfg(tmp_path).model, 257, 256).args.max_seq_len == 256  # following it works
    # A named flavor (1024 positions) cannot take the folder; the advice is the hf flavor, which works.
    named = configured_model(parse_config(["--model.tokenizer", "byte"]).model, 257, 128)
    with pytest.raises(ConfigError, match=r"n_positions=256.*model.flavor = 'hf'"):  # config.json's names
        load_hf_into([named], tmp_path)


UNSUPPORTED = {
    "hidden_act": ("llama", {"hidden_act": "gelu"}),
    "sliding_window": ("llama", {"sliding_window": 4096}),
    "layer_types": ("llama", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    "rope_type='dynamic'": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}),
    "rope_type='linear'": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None}),
    "num_local_experts": ("llama", {"num_local_experts": 8}),
    "quantization_config": ("llama", {"quantization_config": {"quant_method": "bitsandbytes"}}),
    "activation_function": ("gpt2", {"activation_function": "relu"}),
    "scale_attn_by_inverse_layer_idx": ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),
    "add_cross_attention": ("gpt2", {"add_cross_attention": True}),
    "model_type='gemma'": ("llama", {"model_type": "gemma"}),
}


@pytest.mark.parametrize("field", UNSUPPORTED)
def test_each_unsupported_field_is_refused_in_one_line_naming_it(field):
    family, change = UNSUPPORTED[field]
    base = (unusual_llama if family == "llama" else unusual_gpt2)().config.to_dict()
    with pytest.raises(ConfigError, match=field.replace("[", r"\[")) as e:
        args_from_hf_config({**base, **change})
    assert "\n" not in str(e.value)


def test_an_unsupported_field_stops_check_with_exit_2(tmp_path):
    from tests.helpers import titanlite_here

    unusual_llama(hidden_act="gelu").save_pretrained(tmp_path)
    proc = titanlite_here("check", "--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "hidden_act='gelu' is not supported" in proc.stderr, proc.stderr


def test_sharded_folders_load_one_tensor_at_a_time(tmp_path, monkeypatch):
    """A sharded folder (model.safetensors.index.json) imports; no safetensors file is read whole."""
    import safetensors.torch

    hf = perturb(unusual_llama())
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("read a whole file"))
    model = imported(tmp_path, 48)
    tokens = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_logits_match(model(tokens), hf(tokens).logits)


def test_plan_offers_only_layouts_the_folders_shape_divides(tmp_path, capsys):
    """6 heads and 2 KV heads: TP 2 is a layout, TP 4 is not (the planner asks the trainer's own check)."""
    from titanlite.tools.plan import plan

    unusual_llama().save_pretrained(tmp_path)
    plan(
        [
            "--ngpu",
            "4",
            "--model.flavor",
            "hf",
            "--model.hf_assets_path",
            str(tmp_path),
            "--model.tokenizer",
            "byte",
            "--training.seq_len",
            "64",
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    out = capsys.readouterr().out
    assert "llama3 hf" in out and "DDP 2 x TP 2" in out and "TP 4 " not in out


def test_a_folder_without_tokenizer_json_needs_model_tokenizer(tmp_path):
    """Its data must not be tokenised with a vocabulary the model never saw: a guess is refused."""
    unusual_llama().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"has no tokenizer.json; set model.tokenizer") as e:
        parse_config(["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path)])
    assert "\n" not in str(e.value)
    assert hf_cfg(tmp_path).model.tokenizer == "byte"  # set explicitly: used
