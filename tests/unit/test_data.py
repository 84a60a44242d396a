"""Specification of the data pipeline: tokenizers, corpora and their cache, windows, and the loader.
The loader tests pin the property resumption relies on: global batches do not depend on the layout."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from titanlite.data.datasets import PackedWindows, load_tokens
from titanlite.data.loader import GlobalBatchSampler, TokenLoader
from titanlite.data.tokenizer import ByteTokenizer, GPT2Tokenizer, _gpt2_encoding, build_tokenizer
from titanlite.errors import ConfigError

BYTE_EOT = 256


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def byte_ids(*docs: str) -> list[int]:
    """What the byte tokenizer stores for `docs`: each document's UTF-8 bytes then end-of-text."""
    return [i for doc in docs for i in [*doc.encode("utf-8"), BYTE_EOT]]


# Tokenizers


def test_gpt2_tokenizer_works_offline_with_known_ids(no_network, monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    _gpt2_encoding.cache_clear()  # build from the rank file inside this test, not from an earlier one
    tok = build_tokenizer("gpt2")
    assert isinstance(tok, GPT2Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    text = "Ünïcode, tabs\tand  spaces\n€ 123"
    assert tok.decode(tok.encode(text)) == text
    assert not (tmp_path / "tiktoken").exists(), "building the tokenizer must not write a tiktoken cache"


def test_gpt2_treats_special_token_text_in_the_corpus_as_plain_text():
    tok = GPT2Tokenizer()
    ids = tok.encode("a<|endoftext|>b")
    assert tok.eot_id not in ids
    assert tok.decode(ids) == "a<|endoftext|>b"
    assert tok.encode_batch(["Hello world", "a"]) == [[15496, 995], tok.encode("a")]


def test_byte_tokenizer_round_trips_non_ascii_and_skips_eot_when_decoding():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    text = "héllo wörld ☃ 日本"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode([*tok.encode(text), 256]) == text
    assert tok.decode([0xE2, 0x98]) == "\ufffd"


def test_unknown_tokenizer_is_a_config_error_listing_the_choices():
    with pytest.raises(ConfigError, match=r"model.tokenizer='llama' is unknown; use one of: byte, gpt2"):
        build_tokenizer("llama")


# Corpora and cache


def test_stdlib_corpus_is_deterministic_sizable_and_ends_with_eot(tmp_path):
    tok = ByteTokenizer()
    first = load_tokens("stdlib", None, tok, tmp_path / "a")
    second = load_tokens("stdlib", None, tok, tmp_path / "b")
    assert isinstance(first, np.memmap) and first.dtype == np.uint16
    assert not first.flags.writeable
    assert len(first) > 2**20
    assert first[-1] == BYTE_EOT and first[0] != BYTE_EOT
    assert (first == BYTE_EOT).sum() > 50, "one document per standard-library file"
    np.testing.assert_array_equal(first, second)


def test_second_load_reuses_the_cache_without_tokenising(tmp_path, monkeypatch):
    tok = ByteTokenizer()
    first = np.array(load_tokens("stdlib", None, tok, tmp_path))
    assert len(list(tmp_path.glob("*.bin"))) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("tokenised again despite a cached file")

    monkeypatch.setattr(tok, "encode", refuse)
    monkeypatch.setattr(tok, "encode_batch", refuse)
    np.testing.assert_array_equal(load_tokens("stdlib", None, tok, tmp_path), first)


def test_changed_source_or_tokenizer_gets_its_own_cache_file(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("first version")
    cache = tmp_path / "cache"
    assert list(load_tokens("local", str(corpus), ByteTokenizer(), cache)) == byte_ids("first version")
    corpus.write_text("second version")
    assert list(load_tokens("local", str(corpus), ByteTokenizer(), cache)) == byte_ids("second version")
    gpt2 = GPT2Tokenizer()
    assert list(load_tokens("local", str(corpus), gpt2, cache)) == [*gpt2.encode("second version"), gpt2.eot_id]
    assert len(list(cache.glob("*.bin"))) == 3
    assert not list(cache.glob("*.tmp")), "temp files are renamed into place"


def _load_in_child(corpus, cache):
    return np.array(load_tokens("local", corpus, ByteTokenizer(), cache))


def test_concurrent_builders_agree_on_one_cache_file(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("shared corpus " * 5000)
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.starmap(_load_in_child, [(str(corpus), cache)] * 4)
    for tokens in results:
        assert list(tokens) == byte_ids("shared corpus " * 5000)
    assert len(list(cache.glob("*.bin"))) == 1
    assert not list(cache.glob("*.tmp"))


def test_local_txt_jsonl_and_parquet_in_a_folder_load_in_path_order(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_bytes("plain\r\ntext é".encode())
    lines = [json.dumps({"text": "line one"}), "", json.dumps({"text": "two", "id": 2})]
    (data / "b.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": ["row0", "row1 ☃"], "n": [0, 1]}), data / "sub" / "c.parquet")
    (data / "ignored.csv").write_text("not,a,corpus")
    tokens = load_tokens("local", str(data), ByteTokenizer(), tmp_path / "cache")
    assert list(tokens) == byte_ids("plain\r\ntext é", "line one", "two", "row0", "row1 ☃")


def test_a_single_local_file_is_accepted(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["x", ""]}), path)
    assert list(load_tokens("local", str(path), ByteTokenizer(), tmp_path / "cache")) == byte_ids("x", "")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "holds no usable files"),
        (lambda p: p.write_text("x"), "unsupported suffix"),
    ],
    ids=["missing", "empty-folder", "wrong-suffix"],
)
def test_unusable_local_paths_are_config_errors_naming_the_path(tmp_path, make, message):
    path = tmp_path / "corpus.csv"
    make(path)
    with pytest.raises(ConfigError, match=message) as info:
        load_tokens("local", str(path), ByteTokenizer(), tmp_path / "cache")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"text": "ok"', "line 2 is not valid JSON"), ('{"body": "no text"}', 'line 2 has no "text" string')],
)
def test_bad_jsonl_lines_are_config_errors_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_tokens("local", str(path), ByteTokenizer(), tmp_path / "cache")
    assert str(path) in str(info.value)


def test_bad_parquet_and_non_utf8_text_are_config_errors(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"definitely not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file") as info:
        load_tokens("local", str(garbage), ByteTokenizer(), tmp_path / "cache")
    assert str(garbage) in str(info.value)
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_text)
    with pytest.raises(ConfigError, match="has no 'text' column"):
        load_tokens("local", str(no_text), ByteTokenizer(), tmp_path / "cache")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_tokens("local", str(latin1), ByteTokenizer(), tmp_path / "cache")


def test_dataset_path_with_a_non_local_dataset_and_local_without_path_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="only used with training.dataset = 'local'"):
        load_tokens("stdlib", str(tmp_path), ByteTokenizer(), tmp_path / "cache")
    with pytest.raises(ConfigError, match="needs training.dataset_path"):
        load_tokens("local", None, ByteTokenizer(), tmp_path / "cache")


def test_unreachable_hub_dataset_is_a_one_line_config_error(tmp_path, monkeypatch):
    import datasets as hf_datasets

    def offline(name, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nlong details")

    monkeypatch.setattr(hf_datasets, "load_dataset", offline)
    with pytest.raises(ConfigError) as info:
        load_tokens("someone/corpus", None, ByteTokenizer(), tmp_path / "cache")
    message = str(info.value)
    assert message.startswith("training.dataset='someone/corpus' could not be loaded from the Hugging Face hub (")
    assert "(Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError));" in message
    assert message.endswith("use training.dataset = 'stdlib' or 'local' with training.dataset_path")
    assert "\n" not in message
    assert not list((tmp_path / "cache").glob("*.bin")) and not list((tmp_path / "cache").glob("*.tmp"))


# Windows


def test_windows_overlap_by_exactly_one_token_and_cover_the_corpus():
    tokens = np.arange(23, dtype=np.uint16)
    windows = PackedWindows(tokens, seq_len=5)
    assert len(windows) == 4  # (23 - 1) // 5
    assert windows[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert windows[0].dtype == torch.int64
    for i in range(len(windows) - 1):
        assert windows[i][-1] == windows[i + 1][0]
    labels = torch.cat([windows[i][1:] for i in range(len(windows))])
    assert labels.tolist() == list(range(1, 21)), "every token after the first is predicted once"
    with pytest.raises(IndexError):
        windows[4]


def test_too_short_corpus_is_a_config_error_naming_the_sizes():
    with pytest.raises(ConfigError, match=r"the corpus has 8 tokens, too few for training.seq_len=8"):
        PackedWindows(np.arange(8), seq_len=8)


def test_windows_pickle_a_memmap_by_reference(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("abcdefghij" * 1000)
    tokens = load_tokens("local", str(corpus), ByteTokenizer(), tmp_path / "cache")
    windows = PackedWindows(tokens, seq_len=3)
    payload = pickle.dumps(windows)
    assert len(payload) < 1000 < tokens.nbytes, "spawned workers reopen the file instead of copying it"
    restored = pickle.loads(payload)
    assert isinstance(restored.tokens, np.memmap)
    assert all(torch.equal(restored[i], windows[i]) for i in range(len(windows)))


# Loader


NUM_WINDOWS = 20
SEQ_LEN = 4


@pytest.fixture
def windows() -> PackedWindows:
    # Window i starts with token i * SEQ_LEN, so a window's identity is visible in its first token.
    return PackedWindows(np.arange(NUM_WINDOWS * SEQ_LEN + 1, dtype=np.uint16), seq_len=SEQ_LEN)


def make_loaders(windows, dp_degree, local_batch_size, grad_accum_steps, num_workers=0):
    """One loader per data-parallel rank, shuffled with a shared seed."""
    return [
        TokenLoader(
            windows,
            local_batch_size=local_batch_size,
            grad_accum_steps=grad_accum_steps,
            dp_rank=rank,
            dp_degree=dp_degree,
            seed=1234,
            num_workers=num_workers,
        )
        for rank in range(dp_degree)
    ]


def global_step_windows(loaders) -> torch.Tensor:
    """One optimizer step's windows across ranks: rank order, then micro-batch order, rebuilt from (inputs, labels)."""
    pieces = []
    for loader in loaders:
        for _ in range(loader.grad_accum_steps):
            inputs, labels = next(loader)
            assert inputs.shape == labels.shape == (loader.local_batch_size, SEQ_LEN)
            assert inputs.dtype == labels.dtype == torch.int64
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            pieces.append(torch.cat([inputs, labels[:, -1:]], dim=1))
    return torch.cat(pieces)


def run_steps(loaders, steps) -> list[torch.Tensor]:
    return [global_step_windows(loaders) for _ in range(steps)]


GLOBAL_BATCH = 8
# (dp_degree, local_batch_size, grad_accum_steps), all with 8 windows per step.
LAYOUTS = [(1, 8, 1), (1, 4, 2), (2, 4, 1), (2, 2, 2), (4, 2, 1), (4, 1, 2)]


def test_global_batches_do_not_depend_on_layout(windows):
    steps = 6  # 48 samples: crosses two epoch boundaries of 20 windows, one of them mid-step
    reference = run_steps(make_loaders(windows, *LAYOUTS[0]), steps)
    for layout in LAYOUTS[1:]:
        batches = run_steps(make_loaders(windows, *layout), steps)
        for step, (got, want) in enumerate(zip(batches, reference)):
            assert torch.equal(got, want), f"layout {layout} differs at step {step}"


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    layout = dict(local_batch_size=4, grad_accum_steps=1, dp_rank=0, dp_degree=1, seed=7)
    stream = iter(GlobalBatchSampler(NUM_WINDOWS, **layout))
    epochs = [[next(stream) for _ in range(NUM_WINDOWS)] for _ in range(2)]
    for epoch, order in enumerate(epochs):
        assert order == torch.randperm(NUM_WINDOWS, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
    assert epochs[0] != epochs[1]
    stream = iter(GlobalBatchSampler(NUM_WINDOWS, **layout, shuffle=False))
    assert [next(stream) for _ in range(NUM_WINDOWS + 3)] == [*range(NUM_WINDOWS), 0, 1, 2]


def test_resume_mid_stream_on_another_layout(windows):
    uninterrupted = run_steps(make_loaders(windows, dp_degree=1, local_batch_size=8, grad_accum_steps=1), 7)

    before = make_loaders(windows, dp_degree=4, local_batch_size=2, grad_accum_steps=1)
    for got, want in zip(run_steps(before, 3), uninterrupted[:3]):
        assert torch.equal(got, want)
    states = [loader.state_dict() for loader in before]
    assert states == [{"sample_index": 3 * GLOBAL_BATCH}] * 4

    after = make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2)
    for loader in after:
        loader.load_state_dict(states[0])
    for got, want in zip(run_steps(after, 4), uninterrupted[3:]):
        assert torch.equal(got, want)
    assert after[0].state_dict() == {"sample_index": 7 * GLOBAL_BATCH}


def test_state_is_refused_mid_step(windows):
    (loader,) = make_loaders(windows, dp_degree=1, local_batch_size=2, grad_accum_steps=2)
    assert loader.state_dict() == {"sample_index": 0}
    next(loader)
    with pytest.raises(RuntimeError, match="mid-step"):
        loader.state_dict()
    next(loader)
    assert loader.state_dict() == {"sample_index": 4}


def test_worker_processes_give_the_same_batches(windows):
    in_process = run_steps(make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2), 4)
    with_workers = make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2, num_workers=2)
    for got, want in zip(run_steps(with_workers, 4), in_process):
        assert torch.equal(got, want)
    assert with_workers[1].state_dict() == {"sample_index": 4 * GLOBAL_BATCH}


def test_invalid_layouts_are_refused(windows):
    with pytest.raises(ConfigError, match="local_batch_size=0"):
        TokenLoader(windows, local_batch_size=0, grad_accum_steps=1, dp_rank=0, dp_degree=1, seed=0)
    with pytest.raises(ValueError, match="dp_rank=2"):
        TokenLoader(windows, local_batch_size=1, grad_accum_steps=1, dp_rank=2, dp_degree=2, seed=0)
