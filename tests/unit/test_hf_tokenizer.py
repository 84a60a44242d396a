"""Hugging Face tokenizers in (model.tokenizer = 'hf': a tokenizer.json folder) and tokenizer files out
(save_tokenizer: a folder transformers.AutoTokenizer loads offline with exactly titanlite's ids)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from titanlite.base.errors import ConfigError
from titanlite.components.hf_tokenizer import save_tokenizer
from titanlite.data.datasets import split_point
from titanlite.data.sources import Source, stdlib_files
from titanlite.data.store import encode_documents, open_store
from titanlite.data.tokenizer import ByteTokenizer, GPT2Tokenizer, HFTokenizer, build_tokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# Ordinary text of every kind the split pattern treats differently: words, contractions, code with tabs,
# runs of spaces and newlines, trailing whitespace, numbers, accents, CJK, emoji.
TEXT = (
    "Hello world! It's we'll THEY'RE here.\n"
    "def f(x):\n\treturn x  *  2   \n\n   \n  y = 3.14159  # comment\t\n"
    "$1,234,567.89 and 2024-05-01 10:30\r\n"
    "Ünïcode café naïve 日本語のテキスト 😀🎉👍🏽  \u3000 z\n"
    "trailing spaces   "
)
TRAINING_TEXTS = [
    f"The quick brown fox {i} jumps over the lazy dog.\n\tdef f(x): return x * {i}  \nÜnïcode 日本 😀"
    for i in range(200)
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def auto_tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def train_tokenizer(folder: Path, vocab_size: int = 400, config: dict | None = None) -> Path:
    """A byte-level BPE tokenizer trained with the tokenizers library, saved as a Hugging Face folder."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TRAINING_TEXTS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if config is None:
        # A token as transformers writes it: a dict with "content" (it refuses one without "__type").
        eos = {"__type": "AddedToken", "content": "</s>", "special": True, "normalized": False}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": eos}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("trained"))


def assert_one_line_error(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


# Exporting the built-in tokenizers


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("gpt2")
    return folder, save_tokenizer(folder, GPT2Tokenizer(), 1024)


def test_gpt2_export_encodes_and_decodes_exactly_like_titanlite(gpt2_export):
    folder, ids = gpt2_export
    assert ids == {"bos_token_id": 50256, "eos_token_id": 50256}
    ours, theirs = GPT2Tokenizer(), auto_tokenizer(folder)
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (50256, 50256, 50257)
    assert theirs.encode(TEXT) == ours.encode(TEXT)
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    # Real code: the first stdlib files (about 100 KB) tokenise identically, document by document.
    texts = [Path(f.path).read_text(encoding="utf-8") for f in stdlib_files()[:20]]
    assert theirs(texts, add_special_tokens=False)["input_ids"] == ours.encode_batch(texts)
    # Read back as model.tokenizer = 'hf', the export is the GPT-2 tokenizer again (no BOS: it is the EOS).
    back = HFTokenizer(folder)
    assert (back.vocab_size, back.eot_id, back.bos_id) == (50257, 50256, None)
    assert back.encode_batch(texts) == ours.encode_batch(texts) and back.encode("a<|endoftext|>b") == ours.encode(
        "a<|endoftext|>b"
    )


def test_gpt2_export_treats_end_of_text_as_special_unless_asked_not_to(gpt2_export):
    """transformers (as Hugging Face's own gpt2) turns "<|endoftext|>" in text into id 50256; titanlite's
    corpus encoding keeps it text, which split_special_tokens=True reproduces."""
    theirs, ours = auto_tokenizer(gpt2_export[0]), GPT2Tokenizer()
    text = "a<|endoftext|>b"
    assert theirs.encode(text) == [*ours.encode("a"), 50256, *ours.encode("b")]
    assert theirs(text, split_special_tokens=True)["input_ids"] == ours.encode(text)
    assert theirs.decode([50256]) == "<|endoftext|>" == ours.decode([50256])


def test_byte_export_round_trips_bytes(tmp_path):
    ours = ByteTokenizer()
    assert save_tokenizer(tmp_path, ours, 2048) == {"bos_token_id": None, "eos_token_id": 256}
    theirs = auto_tokenizer(tmp_path)
    assert (theirs.eos_token_id, len(theirs)) == (256, 257)
    assert theirs.encode(TEXT) == ours.encode(TEXT) == list(TEXT.encode("utf-8"))
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    assert theirs.decode([0xE2, 0x98]) == ours.decode([0xE2, 0x98]) == "\ufffd"
    assert theirs.convert_ids_to_tokens(256) == "<|endoftext|>"
    back = HFTokenizer(tmp_path)
    assert (back.vocab_size, back.eot_id, back.bos_id, back.encode(TEXT)) == (257, 256, None, ours.encode(TEXT))


def test_builtin_tokenizers_keep_no_bos_and_their_fingerprints():
    for tok, name in ((GPT2Tokenizer(), "gpt2"), (ByteTokenizer(), "byte")):
        assert tok.bos_id is None and tok.fingerprint == name


# Reading a Hugging Face tokenizer folder


def test_hf_tokenizer_reads_ids_and_special_tokens_from_the_folder(trained):
    tok = build_tokenizer("hf", str(trained))
    backend = tokenizers.Tokenizer.from_file(str(trained / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer) and tok.name == "hf"
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True) == 400
    assert (tok.bos_id, tok.eot_id) == (backend.token_to_id("<s>"), backend.token_to_id("</s>")) == (0, 1)
    ids = tok.encode(TEXT)
    assert ids == backend.encode(TEXT, add_special_tokens=False).ids and tok.decode(ids) == TEXT
    assert [a.tolist() for a in tok.encode_batch_arrays([TEXT, "", "x"])] == tok.encode_batch([TEXT, "", "x"])
    # Special-token text in the corpus stays text; a lone surrogate becomes U+FFFD, as for GPT-2.
    assert tok.eot_id not in tok.encode("a</s>b<s>") and tok.decode(tok.encode("a</s>b<s>")) == "a</s>b<s>"
    assert tok.encode("x \ud800 y") == tok.encode("x \ufffd y")


def test_special_ids_fall_back_to_config_files_then_token_names(tmp_path):
    plain = train_tokenizer(tmp_path / "a", config={})  # an empty tokenizer_config.json
    assert (HFTokenizer(plain).eot_id, HFTokenizer(plain).bos_id) == (1, None)  # "</s>" by name; no BOS guessed
    (plain / "tokenizer_config.json").unlink()
    (plain / "config.json").write_text(json.dumps({"eos_token_id": [0, 1], "bos_token_id": 1}))
    tok = HFTokenizer(plain)
    assert (tok.eot_id, tok.bos_id, tok.declared_bos_id) == (0, 1, 1)
    (plain / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 1}))
    tok = HFTokenizer(plain)  # generation_config.json first; a BOS that is also the EOS is not added
    assert (tok.eot_id, tok.bos_id, tok.declared_bos_id) == (1, None, 1)
    declined = train_tokenizer(tmp_path / "b", config={"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False})
    assert (HFTokenizer(declined).bos_id, HFTokenizer(declined).declared_bos_id) == (None, 0)


def test_documents_get_bos_once_and_eos_at_their_end(trained):
    tok = HFTokenizer(trained)
    bos, eos = tok.bos_id, tok.eot_id
    one, two_a, two_b = "first document", "second document, part one\n", "and its part two"
    batch = [(one, True), (two_a, False), (two_b, True)]
    expected = [bos, *tok.encode(one), eos, bos, *tok.encode(two_a), *tok.encode(two_b), eos]
    assert encode_documents(tok, batch, "<u2").tolist() == expected
    # A batch that continues a document from the previous batch begins without a BOS.
    continued = encode_documents(tok, [(two_b, True), (one, True)], "<u2", starts_document=False).tolist()
    assert continued == [*tok.encode(two_b), eos, bos, *tok.encode(one), eos]


def test_store_of_a_cut_text_file_and_jsonl_has_one_bos_per_document(trained, tmp_path):
    tok = HFTokenizer(trained)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    long_text = "".join(f"line {i} of the long text\nword{i}\n" for i in range(400))  # about 12 KB
    docs = ["a jsonl document", "another </s> one"]
    (corpus / "a.txt").write_text(long_text)
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    source = Source("local", str(corpus), "training.dataset_path")
    store = open_store(source, tok, tmp_path / "cache", shard_bytes=2048, workers=2)  # workers: pickled tokenizers
    assert store.num_shards > 3, "the text file must be cut into several pieces"
    expected = [i for doc in [long_text, *docs] for i in [tok.bos_id, *tok.encode(doc), tok.eot_id]]
    assert store.read(0, len(store)).tolist() == expected
    # The held-out tail starts at an end-of-sequence; the next document's BOS belongs to the tail.
    first_eos = len(tok.encode(long_text)) + 1  # after the BOS and the long text
    at = split_point(store, tok.eot_id, (len(store) - first_eos + 5) / len(store))  # 5 tokens before it
    assert at == first_eos
    assert store.read(at, at + 2).tolist() == [tok.eot_id, tok.bos_id]


def test_fingerprint_follows_the_tokenizer_file_and_pickling_rereads_the_folder(trained, tmp_path):
    tok = HFTokenizer(trained)
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    assert HFTokenizer(copy).fingerprint == tok.fingerprint and tok.fingerprint.startswith("hf-")
    clone = pickle.loads(pickle.dumps(HFTokenizer(copy)))
    assert (clone.fingerprint, clone.vocab_size, clone.eot_id, clone.bos_id) == (tok.fingerprint, 400, 1, 0)
    assert clone.encode(TEXT) == tok.encode(TEXT)
    stale = pickle.loads(pickle.dumps(HFTokenizer(copy)))
    train_tokenizer(copy, vocab_size=350)
    assert HFTokenizer(copy).fingerprint != tok.fingerprint
    with pytest.raises(ConfigError) as error:
        stale.encode("x")  # unpickled before the change, used after it
    assert_one_line_error(error, "changed while in use")


def test_hf_export_copies_the_tokenizer_files_and_gives_the_same_ids(trained, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(trained, source)
    (source / "model.safetensors").write_bytes(b"not copied")
    tok = HFTokenizer(source)
    out = tmp_path / "out"
    assert save_tokenizer(out, tok, 512) == {"bos_token_id": 0, "eos_token_id": 1}
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    theirs = auto_tokenizer(out)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)
    assert theirs.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT)
    assert theirs.decode(tok.encode(TEXT)) == TEXT
    assert HFTokenizer(out).fingerprint == tok.fingerprint
    # Without a tokenizer_config.json, a minimal one names the special tokens.
    (source / "tokenizer_config.json").unlink()
    (source / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    bare = tmp_path / "bare"
    save_tokenizer(bare, HFTokenizer(source), 512)
    theirs = auto_tokenizer(bare)
    assert (theirs.bos_token, theirs.eos_token, theirs.model_max_length) == ("<s>", "</s>", 512)
    assert theirs.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT)
    assert HFTokenizer(bare).fingerprint == tok.fingerprint  # read back: the same ids, BOS included


# Errors


def test_hf_needs_a_folder_with_a_tokenizer_json(tmp_path):
    for path in ("", str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(ConfigError) as error:
            build_tokenizer("hf", path)
        assert_one_line_error(error, "model.hf_assets_path")


def test_corrupt_tokenizer_json_is_one_line_naming_the_file(trained, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(trained, broken)
    for content in ("{not json", '{"version": "1.0"}', "\xff\xfe"):
        (broken / "tokenizer.json").write_text(content, encoding="latin-1")
        with pytest.raises(ConfigError) as error:
            HFTokenizer(broken)
        assert_one_line_error(error, str(broken / "tokenizer.json"))


def test_a_tokenizer_without_end_of_sequence_is_refused(tmp_path):
    from tokenizers import models

    folder = tmp_path / "no-eos"
    folder.mkdir()
    tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(folder / "tokenizer.json"))
    with pytest.raises(ConfigError) as error:
        HFTokenizer(folder)
    assert_one_line_error(error, str(folder), "add an eos_token to")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError) as error:
        HFTokenizer(folder)
    assert_one_line_error(error, "names eos_token '</s>', which tokenizer.json lacks")
