"""Specification of the data pipeline: tokenizers, corpora and their cache, windows, and the loader.
The loader tests pin the property resumption relies on: global batches do not depend on the layout."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import signal
import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import titanlite.data.readers as readers_module
import titanlite.data.sources as sources_module
import titanlite.data.store as store_module
from titanlite.base.errors import ConfigError
from titanlite.data.datasets import MixedWindows, PackedWindows, configured_sources, parse_mixture
from titanlite.data.loader import TokenLoader
from titanlite.data.order import EpochOrder, MixtureOrder, SeededPermutation
from titanlite.data.sources import Source
from titanlite.data.store import TokenStore, open_store
from titanlite.data.tokenizer import ByteTokenizer, GPT2Tokenizer, build_tokenizer, gpt2_encoding

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
    gpt2_encoding.cache_clear()  # build from the rank file inside this test, not from an earlier one
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


# Corpora and the prepared token store


def load(location: str, tokenizer, cache, **kwargs) -> np.ndarray:
    """Every token of a source ('stdlib' or a local path) as one array, through its store."""
    source = (
        Source("stdlib", "", "training.dataset")
        if location == "stdlib"
        else Source("local", str(location), "training.dataset_path")
    )
    store = open_store(source, tokenizer, cache, **kwargs)
    return store.read(0, len(store))


def local(path) -> Source:
    return Source("local", str(path), "training.dataset_path")


def test_stdlib_corpus_is_deterministic_sizable_and_ends_with_eot(tmp_path):
    tok = ByteTokenizer()
    first = load("stdlib", tok, tmp_path / "a")
    second = load("stdlib", tok, tmp_path / "b")
    assert first.dtype == np.uint16
    assert len(first) > 2**20
    assert first[-1] == BYTE_EOT and first[0] != BYTE_EOT
    assert (first == BYTE_EOT).sum() > 50, "one document per standard-library file"
    np.testing.assert_array_equal(first, second)


def test_a_store_is_shards_of_ids_plus_a_manifest_and_reopens_by_memory_map(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    docs = [f"document {i} " * 50 for i in range(40)]
    (data / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    store = open_store(local(data), ByteTokenizer(), tmp_path / "cache", shard_bytes=4096)
    manifest = json.loads((store.path / "manifest.json").read_text())
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"] == "byte" and manifest["documents"] == 40
    assert store.num_shards == len(manifest["shards"]) > 3, "a large file is cut into several shards"
    assert sum(s["tokens"] for s in manifest["shards"]) == len(store) == manifest["tokens"]
    assert manifest["files"] == 1 and manifest["listing"], "the listing's fingerprint: what ranks compare"
    sources = json.loads((store.path / "sources.json").read_text())  # per file: what check compares
    assert [r["path"] for r in sources] == [str(data / "docs.jsonl")] and sources[0]["sha256"]
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in store.arrays)
    assert list(store.read(0, len(store))) == byte_ids(*docs)
    assert not list(store.path.glob("*.tmp")) and not (store.path / "progress.jsonl").exists()


def test_uint32_ids_for_vocabularies_above_65535(tmp_path):
    class Wide(ByteTokenizer):
        name, vocab_size, eot_id = "wide", 70000, 69999

    corpus = tmp_path / "doc.txt"
    corpus.write_text("wide")
    tokens = load(corpus, Wide(), tmp_path / "cache")
    assert tokens.dtype == np.uint32 and list(tokens) == [*b"wide", 69999]


def test_reopening_reads_neither_the_sources_nor_tokenises(tmp_path, monkeypatch):
    """What every training rank does when the store exists: stat the sources, map the shards."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (data / "b.txt").write_text("world")
    tok = ByteTokenizer()
    first = load(data, tok, tmp_path / "cache")
    real_open = open

    def guarded_open(file, *args, **kwargs):
        assert not str(file).startswith(str(data)), f"source text read: {file}"
        return real_open(file, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("tokenised again despite a current store")

    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr(tok, "encode_batch", refuse)
    np.testing.assert_array_equal(load(data, tok, tmp_path / "cache", verify="stat"), first)


def test_changed_sources_are_detected_and_rebuilt(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("first version")
    cache = tmp_path / "cache"
    assert list(load(corpus, ByteTokenizer(), cache)) == byte_ids("first version")
    corpus.write_text("second version!")  # new size and mtime
    assert list(load(corpus, ByteTokenizer(), cache)) == byte_ids("second version!")
    # Same size, mtime put back: only the sampled fingerprint (check, prepare) sees the change.
    info = corpus.stat()
    corpus.write_text("THIRD version!!")
    os.utime(corpus, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert list(load(corpus, ByteTokenizer(), cache, verify="stat")) == byte_ids("second version!")
    assert list(load(corpus, ByteTokenizer(), cache, verify="sample")) == byte_ids("THIRD version!!")
    gpt2 = GPT2Tokenizer()
    assert list(load(corpus, gpt2, cache)) == [*gpt2.encode("THIRD version!!"), gpt2.eot_id]
    assert len(list(cache.glob("store-*/manifest.json"))) == 2, "one store per (source, tokenizer)"
    assert not list(cache.glob("store-*/*.tmp")), "temp files are renamed into place"


def test_full_verification_notices_a_change_the_fingerprint_misses(tmp_path):
    corpus = tmp_path / "doc.txt"
    text = "a" * 200_000
    corpus.write_text(text)
    cache = tmp_path / "cache"
    load(corpus, ByteTokenizer(), cache)
    info = corpus.stat()
    changed = text[:100_000] + "b" + text[100_001:]  # one byte between the fingerprint's samples
    corpus.write_text(changed)
    os.utime(corpus, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert list(load(corpus, ByteTokenizer(), cache, verify="sample")) == byte_ids(text)
    assert list(load(corpus, ByteTokenizer(), cache, verify="full")) == byte_ids(changed)


def test_a_change_to_one_file_rebuilds_only_its_shards(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    for name in "abcd":
        (data / f"{name}.txt").write_text(name * 3000)
    cache = tmp_path / "cache"
    open_store(local(data), ByteTokenizer(), cache, shard_bytes=3000)
    (data / "c.txt").write_text("C" * 3000)
    built = []
    real = store_module.tokenize_piece
    monkeypatch.setattr(store_module, "tokenize_piece", lambda task: built.append(task) or real(task))
    tokens = load(data, ByteTokenizer(), cache, shard_bytes=3000, workers=1)
    assert len(built) == 1 and built[0][2][0].path == str(data / "c.txt")
    assert list(tokens) == byte_ids("a" * 3000, "b" * 3000, "C" * 3000, "d" * 3000)
    assert len(list(cache.glob("store-*/*.bin"))) == 4, "the replaced shard's file is removed"
    built.clear()
    os.utime(data / "a.txt")  # touched, not changed: the store is refreshed without tokenising
    assert list(load(data, ByteTokenizer(), cache, shard_bytes=3000, workers=1)) == list(tokens) and built == []


def test_an_interrupted_prepare_continues_and_gives_the_same_store(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": f"line {i} " + "words " * (i % 13)}) for i in range(3000)]
    (data / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    whole = open_store(local(data), GPT2Tokenizer(), tmp_path / "whole", shard_bytes=8192)
    assert whole.num_shards > 6

    calls = []
    real = store_module.tokenize_piece

    def interrupted(task):
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(task)
        return real(task)

    monkeypatch.setattr(store_module, "tokenize_piece", interrupted)
    with pytest.raises(KeyboardInterrupt):
        open_store(local(data), GPT2Tokenizer(), tmp_path / "resumed", shard_bytes=8192, workers=1)
    (folder,) = (tmp_path / "resumed").glob("store-*")
    assert not (folder / "manifest.json").exists() and len(list(folder.glob("*.bin"))) == 4
    calls.clear()
    monkeypatch.setattr(store_module, "tokenize_piece", lambda task: calls.append(task) or real(task))
    resumed = open_store(local(data), GPT2Tokenizer(), tmp_path / "resumed", shard_bytes=8192, workers=1)
    assert len(calls) == whole.num_shards - 4, "finished shards are not tokenised again"
    assert [a.tobytes() for a in resumed.arrays] == [a.tobytes() for a in whole.arrays]
    manifests = [json.loads((s.path / "manifest.json").read_text()) for s in (whole, resumed)]
    assert manifests[0] == manifests[1]


def test_worker_processes_build_the_same_store_as_one_process(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"{i}.jsonl").write_text("".join(json.dumps({"text": f"doc {i}.{j} é"}) + "\n" for j in range(500)))
    one = open_store(local(data), GPT2Tokenizer(), tmp_path / "one", shard_bytes=2048, workers=1)
    two = open_store(local(data), GPT2Tokenizer(), tmp_path / "two", shard_bytes=2048, workers=2)
    assert one.num_shards > 4
    np.testing.assert_array_equal(one.read(0, len(one)), two.read(0, len(two)))


def test_a_huge_txt_is_cut_where_tokenisation_is_unaffected(tmp_path, monkeypatch):
    monkeypatch.setattr(readers_module, "BATCH_CHARS", 1000)  # fragments of a piece, too
    text = "".join(f"Line {i}: some words,  spaces and\ttabs.\n\n  indented {i % 7}\n" for i in range(2000))
    corpus = tmp_path / "big.txt"
    corpus.write_text(text)
    gpt2 = GPT2Tokenizer()
    store = open_store(local(corpus), gpt2, tmp_path / "cache", shard_bytes=10_000)
    assert store.num_shards > 5
    assert list(store.read(0, len(store))) == [*gpt2.encode(text), gpt2.eot_id]


def _load_in_child(corpus, cache):
    return load(corpus, ByteTokenizer(), cache)


def test_concurrent_builders_agree_on_one_store(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("shared corpus " * 5000)
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.starmap(_load_in_child, [(str(corpus), cache)] * 4)
    for tokens in results:
        assert list(tokens) == byte_ids("shared corpus " * 5000)
    assert len(list(cache.glob("store-*/*.bin"))) == 1
    assert not list(cache.glob("store-*/*.tmp"))


def test_local_txt_jsonl_and_parquet_in_a_folder_load_in_path_order(tmp_path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_bytes("plain\r\ntext é".encode())
    lines = [json.dumps({"text": "line one"}), "", json.dumps({"text": "two", "id": 2})]
    (data / "b.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": ["row0", "row1 ☃"], "n": [0, 1]}), data / "sub" / "c.parquet")
    (data / ".hidden.txt").write_text("hidden files are never corpus")
    tokens = load(data, ByteTokenizer(), tmp_path / "cache")
    assert list(tokens) == byte_ids("plain\r\ntext é", "line one", "two", "row0", "row1 ☃")


def test_parquet_is_read_by_row_group_into_several_shards(tmp_path):
    path = tmp_path / "docs.parquet"
    texts = [f"row {i} " * 20 for i in range(400)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=50)
    store = open_store(local(path), ByteTokenizer(), tmp_path / "cache", shard_bytes=5000)
    assert store.num_shards > 3
    assert list(store.read(0, len(store))) == byte_ids(*texts)


def test_a_shard_of_blank_lines_holds_no_tokens_and_still_opens(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "first"}) + "\n" * 5000 + json.dumps({"text": "last"}) + "\n")
    store = open_store(local(path), ByteTokenizer(), tmp_path / "cache", shard_bytes=1000)
    assert 0 in [len(a) for a in store.arrays]
    assert list(store.read(0, len(store))) == byte_ids("first", "last")
    assert list(open_store(local(path), ByteTokenizer(), tmp_path / "cache").read(0, len(store))) == byte_ids(
        "first", "last"
    )


def test_a_single_local_file_is_accepted(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["x", ""]}), path)
    assert list(load(path, ByteTokenizer(), tmp_path / "cache")) == byte_ids("x", "")


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
        load(path, ByteTokenizer(), tmp_path / "cache")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_folder_mixing_text_and_token_files_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    np.save(tmp_path / "b.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ConfigError, match="mixes text files with pre-tokenized"):
        load(tmp_path, ByteTokenizer(), tmp_path / "cache")


@pytest.mark.parametrize(
    ("line", "message"),
    [('{"text": "ok"', "line 41 is not valid JSON"), ('{"body": "no text"}', 'line 41 has no "text" string')],
)
def test_bad_jsonl_lines_are_config_errors_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' * 40 + line + "\n" + '{"text": "fine"}\n' * 10)
    with pytest.raises(ConfigError, match=message) as info:
        load(path, ByteTokenizer(), tmp_path / "cache", shard_bytes=100)  # the bad line is in a later shard
    assert str(path) in str(info.value)


TOKENIZE_PIECE = store_module.tokenize_piece


def _first_one_killed(task):
    """tokenize_piece, except that the process that starts the first piece is killed (what the kernel's
    out-of-memory killer does)."""
    try:
        (task[0] / "killed").touch(exist_ok=False)
    except FileExistsError:
        return TOKENIZE_PIECE(task)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_tokenising_process_that_dies_is_an_error_not_a_hang(tmp_path, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' * 50)
    monkeypatch.setattr(store_module, "tokenize_piece", _first_one_killed)  # forked workers inherit it
    failed: list[BaseException] = []

    def build():
        try:
            load(path, ByteTokenizer(), tmp_path / "cache", shard_bytes=100, workers=2)
        except BaseException as e:
            failed.append(e)

    # In a process whose SIGTERM handler only notes the signal, as a training run's does (its forked workers start
    # with the default one again). multiprocessing.Pool would wait for the killed piece's result forever.
    before = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        builder = threading.Thread(target=build, daemon=True)
        builder.start()
        builder.join(timeout=60)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not builder.is_alive(), "the build still waits for its tokenising processes after 60 s"
    assert len(failed) == 1 and isinstance(failed[0], RuntimeError), failed
    assert re.search(r"a tokenising process died .*data\.prepare_workers.*it was 2", str(failed[0]))


def test_bad_parquet_and_non_utf8_text_are_config_errors(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"definitely not parquet")
    with pytest.raises(ConfigError, match="not a readable parquet file") as info:
        load(garbage, ByteTokenizer(), tmp_path / "cache")
    assert str(garbage) in str(info.value)
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_text)
    with pytest.raises(ConfigError, match="has no 'text' column"):
        load(no_text, ByteTokenizer(), tmp_path / "cache")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load(latin1, ByteTokenizer(), tmp_path / "cache")


def test_dataset_keys_that_contradict_each_other_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="only used with training.dataset = 'local'"):
        configured_sources("stdlib", str(tmp_path), [])
    with pytest.raises(ConfigError, match="either training.dataset_path or training.dataset_mixture"):
        configured_sources("local", str(tmp_path), ["stdlib:1"])
    with pytest.raises(ConfigError, match="is empty"):
        load("", ByteTokenizer(), tmp_path / "cache")


def test_unreachable_hub_dataset_is_a_one_line_config_error(tmp_path, monkeypatch):
    import datasets as hf_datasets

    def offline(name, subset=None, split="train", streaming=False, **options):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nlong details")

    monkeypatch.setattr(hf_datasets, "load_dataset", offline)
    monkeypatch.setattr(sources_module, "hub_unreachable", lambda: "")  # the hub answers; the dataset fails to load
    with pytest.raises(ConfigError) as info:
        open_store(Source("hub", "someone/corpus", "training.dataset"), ByteTokenizer(), tmp_path / "cache")
    message = str(info.value)
    assert message.startswith("training.dataset='someone/corpus' could not be loaded from the Hugging Face hub (")
    assert "(Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError));" in message
    assert message.endswith(
        "check training.dataset and its keys, or use dataset = 'stdlib' or 'local' with dataset_path"
    )
    assert "\n" not in message
    assert not list((tmp_path / "cache").glob("store-*/*.bin")) and not list((tmp_path / "cache").glob("store-*/*.tmp"))


def test_a_hub_that_cannot_be_reached_is_one_line_at_once_without_retries(tmp_path, monkeypatch, capfd):
    # No network (this machine has none): `datasets` retried each request five times over half a minute, printing
    # each retry. One connection tells instead; the dataset is then read from the cache in offline mode, or refused.
    import datasets as hf_datasets
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hf_datasets.config, "HF_HUB_OFFLINE", False)  # restored afterwards: offline mode is global
    monkeypatch.setattr(hf_datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    reason = "https://huggingface.co cannot be reached ([Errno -2] Name or service not known)"
    monkeypatch.setattr(sources_module, "hub_unreachable", lambda: reason)
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        open_store(Source("hub", "someone/corpus", "training.dataset"), ByteTokenizer(), tmp_path / "cache")
    assert time.monotonic() - start < 10
    assert str(info.value) == (
        f"training.dataset='someone/corpus' is not in this machine's Hugging Face cache, and {reason}; connect this "
        "machine to the hub (or set HF_ENDPOINT or HTTPS_PROXY), or use dataset = 'local' with dataset_path"
    )
    assert "Retry" not in capfd.readouterr().err
    assert hf_datasets.config.HF_HUB_OFFLINE and hub_constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"


def test_the_hub_probe_is_one_connection_with_a_deadline():
    with socket.socket() as closed:  # a port nobody listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    said = sources_module.hub_unreachable(f"http://127.0.0.1:{port}")
    assert said.startswith(f"http://127.0.0.1:{port} cannot be reached ("), said
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert sources_module.hub_unreachable(f"http://127.0.0.1:{server.getsockname()[1]}") == ""


class FakeStream:
    """What datasets.load_dataset(..., streaming=True) returns: an iterable of rows with skip(n)."""

    def __init__(self, texts, fail_after=None):
        self.texts, self.fail_after, self.start, self.skipped = texts, fail_after, 0, 0

    def skip(self, n):
        self.skipped += n
        skipped = FakeStream(self.texts, self.fail_after)
        skipped.start = self.start + n
        return skipped

    def __iter__(self):
        for i in range(self.start, len(self.texts)):
            if self.fail_after is not None and i >= self.fail_after:
                raise ConnectionError("stream broke")
            yield {"text": self.texts[i], "id": i}


def test_hub_datasets_stream_into_shards_and_resume_after_a_break(tmp_path, monkeypatch):
    import datasets as hf_datasets

    texts = [f"hub doc {i}" for i in range(250)]
    streams = []

    def load_dataset(name, subset=None, split="train", streaming=False, **options):
        assert streaming, "hub datasets are streamed, never loaded whole"
        assert subset is None and split == "train" and options == {"data_files": None, "data_dir": None}
        streams.append(FakeStream(texts, fail_after=None if streams else 130))
        return streams[-1]

    monkeypatch.setattr(hf_datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(sources_module, "hub_unreachable", lambda: "")
    monkeypatch.setattr(sources_module, "HUB_PIECE_DOCUMENTS", 50)
    monkeypatch.setattr(store_module, "HUB_PIECE_DOCUMENTS", 50)
    source = Source("hub", "someone/corpus", "training.dataset")
    with pytest.raises(
        ConfigError,
        match=r"stream of training.dataset='someone/corpus' broke after 130 documents \(stream broke\); "
        r"run the same command again",
    ):
        open_store(source, ByteTokenizer(), tmp_path / "cache")
    store = open_store(source, ByteTokenizer(), tmp_path / "cache")
    assert streams[1].skipped == 100, "the second attempt skips the two finished shards"
    assert store.num_shards == 5 and store.documents == 250
    assert list(store.read(0, len(store))) == byte_ids(*texts)


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
    store = open_store(local(corpus), ByteTokenizer(), tmp_path / "cache")
    windows = PackedWindows(store, seq_len=3)
    payload = pickle.dumps(windows)
    assert len(payload) < 1000 < len(store) * 2, "spawned workers reopen the files instead of copying them"
    restored = pickle.loads(payload)
    assert all(isinstance(a, np.memmap) for a in restored.tokens.arrays)
    assert all(torch.equal(restored[i], windows[i]) for i in range(len(windows)))


def test_windows_run_across_shard_boundaries_as_in_one_array():
    flat = np.arange(50, dtype=np.uint16)
    sharded = PackedWindows(TokenStore([flat[:7], flat[7:8], flat[8:31], flat[31:]]), seq_len=6)
    whole = PackedWindows(flat, seq_len=6)
    assert len(sharded) == len(whole) == 8
    assert all(torch.equal(sharded[i], whole[i]) for i in range(len(whole)))


# Pre-tokenized files


def write_llmc(path, ids, magic=20240520, version=1, count=None, dtype=np.uint16):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())


def test_llmc_shards_raw_nanogpt_bins_and_npy_are_read_in_place(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50257, size=3000).astype(np.uint16)
    shards = tmp_path / "fineweb"
    shards.mkdir()
    write_llmc(shards / "train_000.bin", ids[:1000])
    write_llmc(shards / "train_001.bin", ids[1000:])
    raw, npy = tmp_path / "train.bin", tmp_path / "train.npy"
    ids.tofile(raw)
    np.save(npy, ids.astype(np.int32))
    gpt2 = GPT2Tokenizer()
    for path, files in [(shards, ["train_000.bin", "train_001.bin"]), (raw, ["train.bin"]), (npy, ["train.npy"])]:
        store = open_store(local(path), gpt2, tmp_path / "cache")
        np.testing.assert_array_equal(store.read(0, len(store)), ids)
        assert [os.path.basename(a.filename) for a in store.arrays] == files, (
            "memory-mapped from the user's files, not copied"
        )
    assert not list((tmp_path / "cache").glob("store-*")), "no store is built for pre-tokenized files"


def test_uint32_llmc_shards_for_large_vocabularies(tmp_path):
    class Wide(ByteTokenizer):
        name, vocab_size, eot_id = "wide", 128256, 128000

    write_llmc(tmp_path / "llama.bin", [5, 128001, 70000], magic=20240801, version=7, dtype=np.uint32)
    store = open_store(local(tmp_path / "llama.bin"), Wide(), tmp_path / "cache")
    assert list(store.read(0, 3)) == [5, 128001, 70000]


def test_token_files_are_checked_once_and_rechecked_when_they_change(tmp_path, monkeypatch):
    path = tmp_path / "train.npy"
    np.save(path, np.arange(100, dtype=np.uint16))
    open_store(local(path), GPT2Tokenizer(), tmp_path / "cache")
    checked = []
    real = store_module.inspect_token_file
    monkeypatch.setattr(store_module, "inspect_token_file", lambda f, t: checked.append(f) or real(f, t))
    open_store(local(path), GPT2Tokenizer(), tmp_path / "cache")
    assert checked == [], "an unchanged file is not scanned again"
    np.save(path, np.arange(200, dtype=np.uint16))
    store = open_store(local(path), GPT2Tokenizer(), tmp_path / "cache")
    assert len(checked) == 1 and len(store) == 200


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: np.save(p.with_suffix(".npy"), np.array([1, 50257], dtype=np.uint16)),
            "holds token id 50257, outside model.tokenizer 'gpt2'",
        ),
        (lambda p: np.array([3, 60000], dtype=np.uint16).tofile(p), "holds token id 60000"),
        (
            lambda p: write_llmc(p, [1, 2, 3], count=10),
            "is truncated: its header promises 10 tokens but the file holds 3",
        ),
        (lambda p: write_llmc(p, [1, 2, 3], magic=12345), "llm.c-style header with the unknown magic 12345"),
        (lambda p: write_llmc(p, [1, 2, 3], version=2), "has llm.c magic 20240520 but version 2"),
        (lambda p: p.write_bytes(b"\x01\x02\x03"), "odd size"),
        (
            lambda p: np.save(p.with_suffix(".npy"), np.ones(4, dtype=np.float32)),
            "not a contiguous array of integer token ids",
        ),
        (lambda p: p.with_suffix(".npy").write_bytes(b"not numpy"), "not a readable .npy file"),
        (lambda p: write_llmc(p, []), "holds no tokens"),
    ],
    ids=[
        "id-out-of-vocab-npy",
        "id-out-of-vocab-raw",
        "truncated",
        "wrong-magic",
        "wrong-version",
        "odd-size",
        "float-npy",
        "bad-npy",
        "empty",
    ],
)
def test_bad_token_files_are_one_line_config_errors_naming_the_file(tmp_path, make, message):
    folder = tmp_path / "shards"
    folder.mkdir()
    make(folder / "bad.bin")
    (path,) = folder.iterdir()
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        open_store(local(folder), GPT2Tokenizer(), tmp_path / "cache")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# Sample order and mixtures


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_seeded_permutation_is_a_bijection_that_depends_on_its_key(n):
    perm = SeededPermutation(n, key=7)
    order = perm(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm(np.arange(n)), SeededPermutation(n, key=7)(np.arange(n)))
    if n >= 64:
        assert not np.array_equal(order, SeededPermutation(n, key=8)(np.arange(n)))
        assert not np.array_equal(order, np.arange(n))


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    order = EpochOrder(NUM_WINDOWS, seed=7)
    epochs = order.windows(np.arange(2 * NUM_WINDOWS)).reshape(2, NUM_WINDOWS).tolist()
    for epoch in epochs:
        assert sorted(epoch) == list(range(NUM_WINDOWS))
    assert epochs[0] != epochs[1]
    assert (
        epochs == EpochOrder(NUM_WINDOWS, seed=7).windows(np.arange(2 * NUM_WINDOWS)).reshape(2, NUM_WINDOWS).tolist()
    )
    assert epochs[0] != EpochOrder(NUM_WINDOWS, seed=8).windows(np.arange(NUM_WINDOWS)).tolist()
    plain = EpochOrder(NUM_WINDOWS, seed=7, shuffle=False)
    assert plain.windows(np.arange(NUM_WINDOWS + 3)).tolist() == [*range(NUM_WINDOWS), 0, 1, 2]


def test_the_order_needs_no_memory_that_grows_with_the_corpus():
    ten_billion_tokens = 10**10 // 1024  # windows of a 10 B-token corpus at seq 1024
    order = EpochOrder(ten_billion_tokens, seed=3)
    picked = order.windows(np.arange(5 * ten_billion_tokens - 4, 5 * ten_billion_tokens + 4))
    assert ((0 <= picked) & (picked < ten_billion_tokens)).all() and len(set(picked.tolist())) == 8


def test_mixture_shares_match_the_weights_within_2_percent_over_1000_windows():
    sizes, weights = [300, 50, 5000], [0.7, 0.2, 0.1]
    order = MixtureOrder(sizes, weights, seed=11)
    picked = order.windows(np.arange(1000))
    offsets = np.cumsum([0, *sizes])
    source = np.searchsorted(offsets, picked, side="right") - 1
    realised = np.bincount(source, minlength=3) / 1000
    assert np.all(np.abs(realised - weights) <= 0.02), realised
    assert order.shares(1000) == np.bincount(source, minlength=3).tolist()
    many = order.windows(np.arange(20_000))
    small = many[(many >= 300) & (many < 350)]
    counts = np.bincount(small - 300, minlength=50)
    assert counts.max() - counts.min() <= 1, "a repeated source still visits each window once per its epoch"


def test_every_prefix_of_a_mixture_holds_the_shares_to_one_sample():
    weights = np.array([0.5, 0.3, 0.2])
    order = MixtureOrder([1000, 1000, 1000], list(weights), seed=4)
    source = order.windows(np.arange(3 * 4096)) // 1000
    seen = np.cumsum(np.eye(3, dtype=np.int64)[source], axis=0)  # seen[j, s]: samples of s among the first j+1
    expected = np.outer(np.arange(1, len(source) + 1), np.array(order.counts) / 4096)  # weights to 1/4096
    assert order.counts == [2048, 1229, 819]
    assert np.abs(seen - expected).max() <= 1.0, "so every global batch holds each share to within two samples"


def test_mixture_order_is_seeded_and_its_weights_are_checked():
    a = MixtureOrder([10, 10], [1, 1], seed=1).windows(np.arange(100))
    np.testing.assert_array_equal(a, MixtureOrder([10, 10], [1, 1], seed=1).windows(np.arange(100)))
    assert not np.array_equal(a, MixtureOrder([10, 10], [1, 1], seed=2).windows(np.arange(100)))
    with pytest.raises(ConfigError, match="below 1/4096 of the total"):
        MixtureOrder([10, 10], [1, 1e-5], seed=1)


@pytest.mark.parametrize(
    "entry", ["data/web", "data/web:0", "data/web:-1", "data/web:x", ":0.5", "data/web:inf", "a:nan"]
)
def test_bad_mixture_entries_are_config_errors(entry):
    with pytest.raises(ConfigError, match="is not SOURCE:WEIGHT with a positive, finite weight"):
        parse_mixture([entry])


def test_mixture_weights_whose_sum_overflows_are_one_line():
    with pytest.raises(ConfigError, match=r"weights 1e\+308, 1e\+308 overflow their sum; give them on a smaller scale"):
        parse_mixture(["data/web:1e308", "stdlib:1e308"])


def test_mixture_entries_name_paths_stdlib_or_hub_datasets():
    mixture = parse_mixture(["data/web:0.7", "stdlib:0.2", "hub:someone/corpus:0.1"])
    assert [(s.kind, s.location, w) for s, w in mixture] == [
        ("local", "data/web", 0.7),
        ("stdlib", "", 0.2),
        ("hub", "someone/corpus", 0.1),
    ]


# Loader


NUM_WINDOWS = 20
SEQ_LEN = 4


@pytest.fixture
def windows() -> PackedWindows:
    # Window i starts with token i * SEQ_LEN, so a window's identity is visible in its first token.
    return PackedWindows(np.arange(NUM_WINDOWS * SEQ_LEN + 1, dtype=np.uint16), seq_len=SEQ_LEN)


def make_loaders(windows, dp_degree, local_batch_size, grad_accum_steps, num_workers=0, prefetch=2, order=None):
    """One loader per data-parallel rank, shuffled with a shared seed."""
    order = order or EpochOrder(len(windows), seed=1234)
    return [
        TokenLoader(
            windows,
            order,
            local_batch_size=local_batch_size,
            grad_accum_steps=grad_accum_steps,
            dp_rank=rank,
            dp_degree=dp_degree,
            num_workers=num_workers,
            prefetch=prefetch,
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


def test_batches_built_ahead_in_the_background_are_the_same_batches(windows):
    direct = run_steps(make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2, prefetch=0), 5)
    ahead = make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2, prefetch=3)
    for got, want in zip(run_steps(ahead, 5), direct):
        assert torch.equal(got, want)
    assert ahead[0].state_dict() == {"sample_index": 5 * GLOBAL_BATCH}, "batches built ahead are not counted"
    ahead[0].load_state_dict({"sample_index": 8})
    assert torch.equal(global_step_windows([ahead[0]]), direct[1][:4])


@pytest.fixture
def mixture():
    """Three sources of 7, 20 and 3 windows, weighted 0.5 / 0.3 / 0.2; source s's tokens count up from 1000 s."""
    parts = [
        PackedWindows((1000 * s + np.arange(n * SEQ_LEN + 1)).astype(np.uint16), seq_len=SEQ_LEN)
        for s, n in enumerate([7, 20, 3])
    ]
    return MixedWindows(parts), MixtureOrder([7, 20, 3], [0.5, 0.3, 0.2], seed=5)


def test_a_mixture_gives_the_same_global_batches_on_every_layout_and_resumes_on_another(mixture):
    windows, order = mixture
    reference = run_steps(make_loaders(windows, *LAYOUTS[0], order=order), 6)
    for layout in LAYOUTS[1:]:
        for step, (got, want) in enumerate(zip(run_steps(make_loaders(windows, *layout, order=order), 6), reference)):
            assert torch.equal(got, want), f"layout {layout} differs at step {step}"
    before = make_loaders(windows, dp_degree=4, local_batch_size=2, grad_accum_steps=1, order=order)
    run_steps(before, 2)
    after = make_loaders(windows, dp_degree=2, local_batch_size=2, grad_accum_steps=2, order=order)
    for loader in after:
        loader.load_state_dict(before[0].state_dict())
    for got, want in zip(run_steps(after, 4), reference[2:]):
        assert torch.equal(got, want)


def test_invalid_layouts_are_refused(windows):
    order = EpochOrder(len(windows), seed=0)
    with pytest.raises(ConfigError, match="local_batch_size=0"):
        TokenLoader(windows, order, local_batch_size=0, grad_accum_steps=1, dp_rank=0, dp_degree=1)
    with pytest.raises(ValueError, match="dp_rank=2"):
        TokenLoader(windows, order, local_batch_size=1, grad_accum_steps=1, dp_rank=2, dp_degree=2)
