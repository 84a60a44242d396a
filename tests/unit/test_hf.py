"""Hugging Face interop: exported folders load in transformers with the same logits, HF models import
into ours with the same logits, the name/layout mapping round-trips exactly. CPU, fp32, random weights."""

import dataclasses
import json
import tempfile

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)

from safetensors.torch import load_file  # noqa: E402  (a dependency of transformers)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from tests.helpers import run_ranks  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.components.hf_weights import from_hf, load_hf, load_hf_into, save_hf, to_hf  # noqa: E402
from titanlite.models.build import build_model  # noqa: E402
from titanlite.models.common.decoder import Transformer as Llama  # noqa: E402
from titanlite.models.common.init import init_weights  # noqa: E402
from titanlite.models.gpt2.model import GPT2  # noqa: E402
from titanlite.models.hf_config import args_from_hf_config, hf_config  # noqa: E402

VOCAB = 300  # padded to 320 by build_model
ATOL = RTOL = 1e-5


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Add noise to every parameter, so norm weights are not all ones and biases not all zeros:
    a swapped or mis-transposed tensor then changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def titanlite_model(name: str, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    model = build_model(name, "debug", VOCAB, 64)
    if tie and not model.args.tie_embeddings:
        model = Llama(dataclasses.replace(model.args, tie_embeddings=True))
    init_weights(model, seed)
    perturb(model, seed + 1)
    return model.eval()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert torch.allclose(ours, theirs, atol=ATOL, rtol=RTOL), f"max abs logit diff {diff}"


EXPORT_CASES = [("gpt2", False), ("llama3", False), ("llama3", True)]


@pytest.mark.parametrize("name,tie", EXPORT_CASES, ids=["gpt2", "llama", "llama-tied"])
def test_export_matches_transformers_logits(tmp_path, name, tie):
    model = titanlite_model(name, tie)
    save_hf(tmp_path, model.args, model.state_dict(), torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.vocab_size == model.args.vocab_size == 320
    assert hf.config.tie_word_embeddings == model.args.tie_embeddings
    if tie:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    x = tokens()
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)


def test_export_tied_file_has_no_lm_head_and_records_dtype(tmp_path):
    model = titanlite_model("gpt2")
    save_hf(tmp_path, model.args, model.state_dict(), torch.bfloat16)
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == hf_config(model.args, "bfloat16")
    assert config["dtype"] == "bfloat16" and config["n_positions"] == model.args.max_seq_len


def hf_gpt2(seed: int):
    config = transformers.GPT2Config(
        n_embd=48,
        n_layer=2,
        n_head=4,
        n_positions=40,
        vocab_size=VOCAB,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        layer_norm_epsilon=1e-5,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def hf_llama(seed: int, n_kv_heads: int, tie: bool):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


IMPORT_CASES = {
    "gpt2": lambda: hf_gpt2(0),
    "llama-gqa": lambda: hf_llama(1, n_kv_heads=2, tie=False),
    "llama-mha-tied": lambda: hf_llama(2, n_kv_heads=4, tie=True),
}


@pytest.mark.parametrize("case", IMPORT_CASES)
@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_import_matches_transformers_logits(tmp_path, case, shard):
    hf = IMPORT_CASES[case]()
    perturb(hf, 7)
    hf.eval()
    # A tiny shard size forces model-0000x-of-0000y.safetensors plus model.safetensors.index.json.
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB" if shard else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard

    config, hf_sd = load_hf(tmp_path)
    args = args_from_hf_config(config)
    model = (Llama if config["model_type"] == "llama" else GPT2)(args)
    model.load_state_dict(from_hf(args, hf_sd), strict=True)
    if args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    model.eval()
    x = tokens(1)
    with torch.no_grad():
        assert_close(model(x), hf(x).logits)


@pytest.mark.parametrize("name,tie", EXPORT_CASES, ids=["gpt2", "llama", "llama-tied"])
def test_round_trip_is_exact(name, tie):
    model = titanlite_model(name, tie)
    sd = model.state_dict()
    back = from_hf(model.args, to_hf(model.args, sd))
    assert back.keys() == sd.keys()
    for key, value in sd.items():
        assert torch.equal(back[key], value), key


def test_export_then_import_restores_args(tmp_path):
    model = titanlite_model("llama3")
    save_hf(tmp_path, model.args, model.state_dict(), torch.float32)
    config, hf_sd = load_hf(tmp_path)
    assert args_from_hf_config(config) == model.args
    back = from_hf(model.args, hf_sd)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_an_export_replaces_only_its_own_files_and_refuses_a_folder_holding_another_model(tmp_path):
    model = titanlite_model("llama3")
    out = tmp_path / "out"
    save_hf(out, model.args, model.state_dict(), torch.float32, max_shard_bytes=20_000)  # several shards
    first = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in first and "titanlite_export.json" in first
    save_hf(out, model.args, model.state_dict(), torch.float32)  # again, one file: no shard of the first is left
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "titanlite_export.json"]
    )
    # Another model's folder (transformers' save_pretrained, or anything else): refused, and left as it was.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model-00001-of-00002.safetensors").write_bytes(b"their weights")
    (theirs / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds files no titanlite export wrote \(config.json, model-00001"):
        save_hf(theirs, model.args, model.state_dict(), torch.float32)
    assert (theirs / "model-00001-of-00002.safetensors").read_bytes() == b"their weights"
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "model-00001-of-00002.safetensors"]
    (tmp_path / "a_file").write_text("x")
    for bad, why in ((tmp_path / "a_file", "is a file"), (tmp_path / "a_file" / "hf", "which is a file")):
        with pytest.raises(ConfigError, match=why):
            save_hf(bad, model.args, model.state_dict(), torch.float32)


def load_into_ddp(rank: int) -> None:
    """One gloo rank: a Hugging Face folder's weights go into a DDP-wrapped model, as `checkpoint.initial_load_path`
    does into a run's parts under DDP (DDP hides `args` and names every parameter module.*)."""
    source, target = titanlite_model("gpt2"), titanlite_model("gpt2", seed=7)
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, source.args, source.state_dict(), torch.float32)
        load_hf_into([DistributedDataParallel(target)], folder)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


@pytest.mark.distributed
def test_import_into_a_ddp_wrapped_model():
    run_ranks(load_into_ddp, nprocs=1)


def test_bad_folders_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        load_hf(tmp_path / "missing")
    with pytest.raises(ConfigError, match="config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model.safetensors"):
        load_hf(tmp_path)


def test_unsupported_configs_raise_config_error():
    with pytest.raises(ConfigError, match="model_type='bert'"):
        args_from_hf_config({"model_type": "bert"})
    llama = hf_config(titanlite_model("llama3").args)
    with pytest.raises(ConfigError, match="rope_type 'llama3' lacks 'factor'"):
        args_from_hf_config({**llama, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ConfigError, match="lacks 'hidden_size'"):
        args_from_hf_config({"model_type": "llama"})
    with pytest.raises(ConfigError, match="unexpected tensors"):
        args = titanlite_model("gpt2").args
        from_hf(args, {**to_hf(args, titanlite_model("gpt2").state_dict()), "extra.weight": torch.zeros(1)})
