"""Continue pretraining a Hugging Face model, as a user would: a folder holding an unusual-shaped Llama and a
tokenizer trained with the `tokenizers` library (vocabulary of its own size, <s> and </s>), with model.flavor =
"hf". The corpus is prepared with that tokenizer, a few steps train on FSDP x 2, and the export loads in
transformers (model and tokenizer, offline) with titanlite's logits and ids; `titanlite generate` continues a
prompt greedily exactly as transformers' generate does."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is an optional test dependency (pip install .[hf])"
)
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers import REPO, VALIDATION_TEXT, env, metrics, train_in_pool  # noqa: E402
from tests.unit.test_hf_shapes import assert_logits_match, perturb, unusual_llama  # noqa: E402

pytestmark = pytest.mark.distributed

CORPUS_TEXT = (REPO / "titanlite" / "config" / "sections.py").read_text() + VALIDATION_TEXT.read_text()


def train_tokenizer(folder) -> "tokenizers.Tokenizer":
    """A byte-level BPE of about 400 ids trained on the corpus, with <s> (BOS) and </s> (EOS)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS_TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    return tok


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """(folder, the transformers model in it, its tokenizers.Tokenizer)."""
    folder = tmp_path_factory.mktemp("hf_model")
    tok = train_tokenizer(folder)
    vocab = tok.get_vocab_size()
    hf = perturb(
        unusual_llama(vocab_size=vocab, bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    )
    hf.save_pretrained(folder, max_shard_size="100KB")
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(CORPUS_TEXT)
    return folder, hf, tok, corpus


def hf_args(folder, corpus) -> list[str]:
    return [
        "--model.flavor",
        "hf",
        "--model.hf_assets_path",
        str(folder),
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(corpus),
        "--training.seq_len",
        "48",
        "--training.local_batch_size",
        "2",
        "--optimizer.lr",
        "1e-3",
    ]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanlite.commands.cli", *args], cwd=REPO, env=env(), capture_output=True, text=True
    )


@pytest.mark.slow  # CI runs it; test_checkpoint.py's export matches titanlite's logits in the default suite
def test_train_then_export_loads_in_transformers(tmp_path, hf_folder):
    from titanlite.builder.data import build_data, run_tokenizer
    from titanlite.components.checkpoint import load_model_only
    from titanlite.config import parse_config
    from titanlite.data.tokenizer import build_tokenizer
    from titanlite.models.build import configured_model

    folder, hf, tok, corpus = hf_folder
    args = hf_args(folder, corpus)
    proc = train_in_pool(
        2,
        [
            *args,
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "3",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(from {folder})" in proc.stdout and f"initial weights from the Hugging Face folder {folder}" in proc.stdout
    assert f"vocab {tok.get_vocab_size()} (tokenizer hf)" in proc.stdout
    assert len(metrics(tmp_path)) == 3

    out = tmp_path / "export"
    # The export names only the run: the checkpoint records its model (no model flags repeated).
    done = cli("convert", "to-hf", "--output", str(out), "--job.dump_folder", str(tmp_path), "--job.name", "run")
    assert done.returncode == 0, done.stderr
    cfg = parse_config(args)
    ours = configured_model(cfg.model, tok.get_vocab_size(), 48)
    ours.init_buffers()
    load_model_only(tmp_path / "run" / "step-3", ours)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, tok.get_vocab_size(), (2, 48), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        trained = ours.eval()(tokens)
        assert_logits_match(trained, theirs(tokens).logits)
        assert (trained - hf(tokens).logits).abs().max() > 1e-4  # the three steps changed the weights

    # AutoTokenizer on the export gives the ids titanlite trained on: the prepared store holds
    # [<s>] + ids + [</s>] per document, and its first document starts the corpus.
    auto = transformers.AutoTokenizer.from_pretrained(out)
    tokenizer = run_tokenizer(cfg)
    corpus_data = build_data(cfg, tokenizer)
    assert tokenizer.vocab_size == tok.get_vocab_size() != 50257
    stored = corpus_data.stores[0].read(0, 200).tolist()
    expected = auto(CORPUS_TEXT, add_special_tokens=False)["input_ids"]
    assert stored == [tokenizer.bos_id, *expected[:199]]
    assert auto.decode(expected) == CORPUS_TEXT
    assert build_tokenizer("hf", str(out)).fingerprint == tokenizer.fingerprint  # the same tokenizer, re-read


@pytest.mark.slow  # tests/unit/test_generate.py checks greedy ids against transformers in the default suite
def test_generate_continues_as_transformers_does(tmp_path, hf_folder):
    folder, hf, tok, corpus = hf_folder
    record = tmp_path / "gen.json"
    proc = cli(
        "generate",
        "--prompt",
        "def parse_config(",
        "--max-new-tokens",
        "12",
        "--output",
        str(record),
        *hf_args(folder, corpus),
        "--job.dump_folder",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(record.read_text())
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert result["prompt_ids"] == [bos, *tok.encode("def parse_config(").ids]
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([result["prompt_ids"]]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos
        )
    assert result["new_ids"] == expected[0, len(result["prompt_ids"]) :].tolist()
