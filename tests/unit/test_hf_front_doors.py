"""The commands around a Hugging Face run take what it is from where it is recorded: `convert to-hf` from the
checkpoint (no model flags repeated; one that contradicts it is refused), `prepare` from the same flags as the
run, building the store the run then opens and naming its tokenizer."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)
pytest.importorskip("tokenizers")

from tests.unit.test_hf_shapes import unusual_llama  # noqa: E402
from tests.unit.test_hf_tokenizer import TRAINING_TEXTS, train_tokenizer  # noqa: E402
from titanlite.base.errors import ConfigError  # noqa: E402
from titanlite.base.hf_config import read_config  # noqa: E402
from titanlite.builder.data import build_data  # noqa: E402
from titanlite.builder.model import plain_model  # noqa: E402
from titanlite.builder.plan import plan_model  # noqa: E402
from titanlite.commands.convert import convert  # noqa: E402
from titanlite.components.checkpoint import save_model_only  # noqa: E402
from titanlite.components.checkpoint_files import MARKER  # noqa: E402
from titanlite.components.hf_weights import load_hf_into  # noqa: E402
from titanlite.components.resume import flat_config  # noqa: E402
from titanlite.config import parse_config  # noqa: E402
from titanlite.tools.prepare import prepare  # noqa: E402


@pytest.fixture
def hf_run(tmp_path):
    """(the flags of a run of a Hugging Face Llama folder, its checkpoint step-3): the checkpoint's marker records
    the run's config as the checkpointer's does."""
    folder = tmp_path / "llama"
    unusual_llama().save_pretrained(folder)  # no tokenizer.json: the run names model.tokenizer
    flags = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--model.tokenizer", "byte"]
    flags += ["--training.seq_len", "48", "--job.dump_folder", str(tmp_path), "--job.name", "run"]
    cfg = parse_config(flags)
    model = plain_model(cfg, plan_model(cfg))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    step = save_model_only(tmp_path / "run", 3, model.state_dict())
    marker = json.loads((step / MARKER).read_text())
    (step / MARKER).write_text(json.dumps({**marker, "config": flat_config(cfg)}))
    return flags, model


def test_convert_takes_the_model_from_the_checkpoint(tmp_path, hf_run):
    """Without the model flags it used to build the debug GPT-2 and fail with a raw 'Size mismatch'."""
    flags, trained = hf_run
    out = tmp_path / "export"
    assert convert(["to-hf", "--output", str(out), "--job.dump_folder", str(tmp_path), "--job.name", "run"]) == 0
    config = read_config(out)
    assert (config["model_type"], config["hidden_size"], config["num_key_value_heads"]) == ("llama", 96, 2)
    back_cfg = parse_config(flags)
    back = plain_model(back_cfg, plan_model(back_cfg))
    load_hf_into([back], out)
    for (name, ours), theirs in zip(trained.state_dict().items(), back.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_convert_refuses_a_model_flag_the_checkpoint_contradicts(tmp_path, hf_run):
    argv = ["to-hf", "--output", str(tmp_path / "x"), "--job.dump_folder", str(tmp_path), "--job.name", "run"]
    with pytest.raises(ConfigError, match=r"model.tokenizer='gpt2' contradicts .*step-3.*model.tokenizer='byte'") as e:
        convert([*argv, "--model.tokenizer", "gpt2"])
    assert "\n" not in str(e.value)
    assert convert([*argv, "--model.tokenizer", "byte"]) == 0  # agreeing is fine


def test_prepare_builds_the_store_the_run_opens_and_names_its_tokenizer(tmp_path, caplog):
    folder = train_tokenizer(tmp_path / "model")
    unusual_llama(vocab_size=400).save_pretrained(folder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TRAINING_TEXTS))
    flags = ["--model.flavor", "hf", "--model.hf_assets_path", str(folder), "--training.seq_len", "32"]
    flags += ["--training.dataset", "local", "--training.dataset_path", str(corpus)]
    flags += ["--data.cache_dir", str(tmp_path / "cache")]
    with caplog.at_level(logging.INFO, logger="titanlite"):
        assert prepare(flags) == 0
        assert [r for r in caplog.records if r.getMessage().lstrip().startswith("prepare ")]  # it built the store
        assert (
            f"tokenising with hf ({folder / 'tokenizer.json'}, 400 ids), the tokenizer of model llama3 hf"
            in caplog.text
        )
        assert "with tokenizer hf in" in caplog.text and "default config" not in caplog.text
        caplog.clear()
        cfg = parse_config(flags)
        tokenizer = plan_model(cfg).tokenizer
        build_data(cfg, tokenizer)  # the run's data, as a rank opens it
        assert tokenizer.vocab_size == 400
        assert not [r for r in caplog.records if r.getMessage().lstrip().startswith("prepare ")]  # none built again
        # Without the run's model flags prepare uses the default config's tokenizer: it says so.
        assert prepare(flags[6:]) == 0
        assert "tokenising with gpt2 (50,257 ids)" in caplog.text
        assert "the default config's (train_configs/debug_model.toml): give prepare the run's" in caplog.text
