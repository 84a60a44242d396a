"""The corpora users bring, each written by the library that produces it (gzip, zstandard, bz2, lzma, datasets,
pyarrow, Megatron's documented layout): every one gives the same tokens as the same text as plain JSON lines,
and every case that used to be silently wrong is now right or one line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import titanlite.data.sources as sources_module
from titanlite.base.errors import ConfigError
from titanlite.builder.data import build_data, build_validation_data, run_tokenizer, training_sources
from titanlite.config import parse_config
from titanlite.data.datasets import split_point
from titanlite.data.sources import Source
from titanlite.data.store import TokenStore, describe, open_store
from titanlite.data.tokenizer import ByteTokenizer, GPT2Tokenizer

TEXTS = [f"document {i}: caf\u00e9 \u2603 " + "words " * (i % 7) for i in range(40)]
COMPRESS = {
    "gz": gzip.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
    "bz2": bz2.compress,
    "xz": lzma.compress,
}


def jsonl(texts: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def tokens(path, tmp_path, tokenizer=None, **options) -> list[int]:
    store = open_store(
        Source("local", str(path), "training.dataset_path", **options), tokenizer or GPT2Tokenizer(), tmp_path / "c"
    )
    return store.read(0, len(store)).tolist()


def reference(texts: list[str], tmp_path) -> list[int]:
    plain = tmp_path / "reference" / "plain.jsonl"
    plain.parent.mkdir(exist_ok=True)
    plain.write_bytes(jsonl(texts))
    return tokens(plain, tmp_path / "reference")


@pytest.mark.parametrize("codec", sorted(COMPRESS))
@pytest.mark.parametrize("inner", ["jsonl", "json"])
def test_compressed_json_lines_give_the_tokens_of_the_plain_file(tmp_path, codec, inner):
    path = tmp_path / f"docs.{inner}.{codec}"
    path.write_bytes(COMPRESS[codec](jsonl(TEXTS)))
    assert tokens(path, tmp_path) == reference(TEXTS, tmp_path)


def test_compressed_txt_is_one_document_like_the_plain_txt(tmp_path, monkeypatch):
    monkeypatch.setattr("titanlite.data.readers.BATCH_CHARS", 200)  # many fragments, cut where it is safe
    text = "".join(f"Line {i}: some words,  spaces\n\n  indented {i % 7}\n" for i in range(300))
    (tmp_path / "plain.txt").write_text(text)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "same.txt.gz").write_bytes(gzip.compress(text.encode()))
    gpt2 = GPT2Tokenizer()
    assert tokens(tmp_path / "z" / "same.txt.gz", tmp_path) == tokens(tmp_path / "plain.txt", tmp_path)
    assert tokens(tmp_path / "plain.txt", tmp_path) == [*gpt2.encode(text), gpt2.eot_id]


def test_a_folder_of_compressed_shards_is_read_whole_in_parallel_and_named(tmp_path):
    folder = tmp_path / "dolma"
    folder.mkdir()
    (folder / "part-0.json.gz").write_bytes(gzip.compress(jsonl(TEXTS[:20])))
    (folder / "part-1.jsonl.zst").write_bytes(COMPRESS["zst"](jsonl(TEXTS[20:])))
    store = open_store(
        Source("local", str(folder), "training.dataset_path"), GPT2Tokenizer(), tmp_path / "c", workers=2, shard_bytes=1
    )
    assert store.read(0, len(store)).tolist() == reference(TEXTS, tmp_path)
    assert store.num_shards == 2 and store.documents == 40
    assert "(2 files: 1 .json.gz, 1 .jsonl.zst)" in describe(store)


def test_a_damaged_compressed_file_is_one_line_naming_it(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    full = gzip.compress(jsonl(TEXTS))
    path.write_bytes(full[:12] + b"\xff" * 40 + full[52:])  # bytes changed mid-stream (a cut one says truncated)
    with pytest.raises(ConfigError, match=r"bad.jsonl.gz is not a readable .gz file \(.*\); re-create or remove it"):
        tokens(path, tmp_path)


def test_files_titanlite_does_not_read_are_refused_by_name_or_left_out_on_request(tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    for i in range(2):
        (folder / f"shard-{i}.jsonl.gz").write_bytes(gzip.compress(jsonl(TEXTS[i * 20 : (i + 1) * 20])))
    (folder / "urls.csv").write_text("https://example.org\n")
    (folder / ".DS_Store").write_bytes(b"\0\1")  # hidden files are never corpus
    with pytest.raises(ConfigError) as info:
        tokens(folder, tmp_path)
    assert str(info.value) == (
        f"training.dataset_path='{folder}' holds 1 file(s) titanlite does not read (urls.csv); remove them, or "
        "set data.skip_unsupported_files = true to leave them out"
    )
    store = open_store(
        Source("local", str(folder), "training.dataset_path", skip_unsupported=True), GPT2Tokenizer(), tmp_path / "c"
    )
    assert store.read(0, len(store)).tolist() == reference(TEXTS, tmp_path)
    assert "1 unsupported file(s) left out (urls.csv)" in describe(store)


def test_the_text_field_is_named_for_json_lines_and_parquet(tmp_path):
    (tmp_path / "stack.jsonl").write_bytes(jsonl(TEXTS, field="content"))
    pq.write_table(pa.table({"content": TEXTS, "size": list(range(40))}), tmp_path / "stack.parquet", row_group_size=7)
    expected = reference(TEXTS, tmp_path)
    assert tokens(tmp_path / "stack.jsonl", tmp_path, text_field="content") == expected
    assert tokens(tmp_path / "stack.parquet", tmp_path, text_field="content") == expected
    with pytest.raises(ConfigError) as info:
        tokens(tmp_path / "stack.jsonl", tmp_path)
    assert str(info.value) == (
        f'{tmp_path / "stack.jsonl"} line 1 has no "text" string (it has: content, id); set '
        "training.dataset_text_field to the field that holds the text"
    )
    with pytest.raises(ConfigError, match=r"has no 'text' column \(columns: content, size\); set training.dataset_"):
        tokens(tmp_path / "stack.parquet", tmp_path)


def test_a_json_array_is_not_taken_for_json_lines(tmp_path):
    (tmp_path / "array.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    with pytest.raises(ConfigError, match=r"array.json is one JSON array, not JSON lines"):
        tokens(tmp_path / "array.json", tmp_path)
    (tmp_path / "pretty.json").write_text(json.dumps([{"text": t} for t in TEXTS], indent=1))  # one array, many lines
    with pytest.raises(ConfigError, match=r"pretty.json is one JSON array, not JSON lines"):
        tokens(tmp_path / "pretty.json", tmp_path)


@pytest.mark.parametrize(
    "first, third, message",
    [
        ('["a", "b",, "c"]', '{"text": "x"}', "line 1 is not valid JSON (Expecting value); fix or remove that line"),
        ('{"text": "x"}', '["a", "b"]', 'line 3 is a JSON list, not an object with a "text" string'),
        ('["a"]', '{"text": "x"}', 'line 1 is a JSON list, not an object with a "text" string'),
    ],
)
def test_one_bad_row_of_json_lines_is_named_by_its_line_not_taken_for_an_array(tmp_path, first, third, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([first, '{"text": "y"}', third]) + "\n")
    with pytest.raises(ConfigError) as info:
        tokens(path, tmp_path)
    assert str(info.value).startswith(f"{path} {message}"), str(info.value)


def test_the_text_field_changes_the_store(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"text": "a" + t, "content": "b" + t}) + "\n" for t in TEXTS))
    assert tokens(path, tmp_path, ByteTokenizer()) != tokens(path, tmp_path, ByteTokenizer(), text_field="content")


# Pre-tokenised folders: validation files, globs, Megatron


def raw_bin(path: Path, ids) -> Path:
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def test_a_nanogpt_folder_trains_on_train_bin_and_validates_on_val_bin(tmp_path):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    raw_bin(folder / "train.bin", range(500))
    raw_bin(folder / "val.bin", range(1000, 1100))
    cfg = parse_config(
        ["--training.dataset", "local", "--training.dataset_path", str(folder), "--training.seq_len", "8",
         "--model.tokenizer", "gpt2", "--data.cache_dir", str(tmp_path / "c")]
    )  # fmt: skip
    tokenizer = run_tokenizer(cfg)
    corpus = build_data(cfg, tokenizer)
    assert corpus.stores[0].read(0, len(corpus.stores[0])).tolist() == list(range(500))
    assert corpus.split == [500], "nothing held out: val.bin is the validation set"
    assert "1 validation file(s) kept out of training (val.bin)" in corpus.describe(8)[0]
    windows = build_validation_data(cfg, tokenizer, corpus)
    assert windows[0].tolist() == list(range(1000, 1009))


def test_llmc_globs_are_accepted_and_leave_the_val_shards_out(tmp_path):
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, 50
    for name, base in [("fineweb_train_000001", 0), ("fineweb_train_000002", 100), ("fineweb_val_000000", 900)]:
        with open(tmp_path / f"{name}.bin", "wb") as f:
            f.write(header.tobytes() + np.arange(base, base + 50, dtype=np.uint16).tobytes())
    train = tokens(tmp_path / "fineweb_train_*.bin", tmp_path)
    assert train == [*range(50), *range(100, 150)]
    assert tokens(tmp_path / "*.bin", tmp_path) == train, "a glob over all shards leaves the val shard out too"
    with pytest.raises(ConfigError, match=r"matches no file; fix the pattern"):
        tokens(tmp_path / "fineweb_test_*.bin", tmp_path)


def megatron_files(prefix: Path, documents: list[list[int]], dtype, code: int) -> None:
    """Megatron-LM's MMapIndexedDataset layout (one sequence per document)."""
    ids = np.concatenate([np.asarray(d, dtype=dtype) for d in documents])
    ids.tofile(f"{prefix}.bin")
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * np.dtype(dtype).itemsize]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + np.array([code], "<u1").tobytes())
        f.write(np.array([len(documents), len(documents) + 1], "<u8").tobytes())
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(len(documents) + 1, dtype=np.int64).tobytes())


def test_megatron_int32_ids_are_read_by_their_index_never_as_raw_uint16(tmp_path):
    gpt2 = GPT2Tokenizer()
    documents = [[37811, 40000, 23739, gpt2.eot_id], [5, 6, gpt2.eot_id], [50000, gpt2.eot_id]]
    folder = tmp_path / "megatron"
    folder.mkdir()
    megatron_files(folder / "corpus_text_document", documents, np.int32, 4)
    expected = [t for d in documents for t in d]
    assert tokens(folder / "corpus_text_document", tmp_path) == expected, "the prefix form"
    assert tokens(folder / "corpus_text_document.bin", tmp_path) == expected, "the .bin beside its .idx"
    store = open_store(Source("local", str(folder), "training.dataset_path"), gpt2, tmp_path / "c")
    assert store.read(0, len(store)).tolist() == expected and store.documents == 3, "a folder: .idx goes with .bin"


def test_megatron_uint16_documents_without_eod_are_said_to_run_together(tmp_path):
    megatron_files(tmp_path / "noeod", [[1, 2, 3], [4, 5]], np.uint16, 8)
    store = open_store(Source("local", str(tmp_path / "noeod"), "training.dataset_path"), GPT2Tokenizer(), tmp_path)
    assert store.read(0, 5).tolist() == [1, 2, 3, 4, 5] and store.documents == 2
    assert "not followed by the end-of-text id (made without --append-eod)" in describe(store)


# The held-out split, the banner's source, start-up cost


def test_a_long_last_document_is_cut_rather_than_holding_out_one_token():
    ids = np.zeros(10_000, dtype=np.uint16)
    ids[[100, 2_000, 5_000, 9_999]] = 7  # the last document is 50 % of the corpus
    at = split_point(TokenStore([ids]), eot_id=7, fraction=0.01)
    assert at == 10_000 - 100, "inside the last document, not at its final end-of-text"
    ids[9_920] = 7  # an end-of-text within half the share: documents stay whole
    assert split_point(TokenStore([ids]), eot_id=7, fraction=0.01) == 9_920
    ids[9_920], ids[9_870] = 0, 7  # only one behind the nominal point
    assert split_point(TokenStore([ids]), eot_id=7, fraction=0.01) == 9_870


def test_ranks_trust_an_unchanged_listing_of_many_files_without_a_stat_each(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_module, "STAT_EACH_FILE_UP_TO", 5)
    monkeypatch.setattr("titanlite.data.store.STAT_EACH_FILE_UP_TO", 5)
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(12):
        (folder / f"{i:03d}.jsonl").write_bytes(jsonl(TEXTS[i : i + 3]))
    source = Source("local", str(folder), "training.dataset_path")
    built = open_store(source, ByteTokenizer(), tmp_path / "c")
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(sources_module.os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
    rank = open_store(source, ByteTokenizer(), tmp_path / "c", verify="stat")
    assert rank.path == built.path and len(rank) == len(built)
    assert not [p for p in stats if p.endswith(".jsonl")], "no file is stat'ed, only its folder"
    stats.clear()
    open_store(source, ByteTokenizer(), tmp_path / "c", verify="sample")
    assert len([p for p in stats if p.endswith(".jsonl")]) == 12, "check compares every file"
    (folder / "012.jsonl").write_bytes(jsonl(["a new document"]))
    grown = open_store(source, ByteTokenizer(), tmp_path / "c", verify="stat")
    assert len(grown) > len(built), "a new file changes the listing: the store is rebuilt"


# Hub datasets as people name them (a local dataset repository stands in for the hub: datasets reads both alike)


@pytest.fixture
def hub_repo(tmp_path):
    repo = tmp_path / "repo"
    configs = []
    for sub in ("sub_a", "sub_b"):
        (repo / "data" / sub).mkdir(parents=True)
        files = []
        for split in ("train", "validation"):
            (repo / "data" / sub / f"{split}.jsonl").write_bytes(
                jsonl([f"{sub} {split} {t}" for t in TEXTS[:10]], field="content")
            )
            files.append(f"  - split: {split}\n    path: data/{sub}/{split}.jsonl\n")
        configs.append(f"- config_name: {sub}\n  data_files:\n" + "".join(files))
    (repo / "README.md").write_text("---\nconfigs:\n" + "".join(configs) + "---\n")
    return repo


def hub_texts(repo, tmp_path, **options) -> str:
    store = open_store(Source("hub", str(repo), "training.dataset", **options), ByteTokenizer(), tmp_path / "c")
    return bytes(t for t in store.read(0, len(store)).tolist() if t < 256).decode()


def test_hub_subsets_splits_data_files_and_text_fields(hub_repo, tmp_path):
    text = hub_texts(hub_repo, tmp_path, subset="sub_b", split="validation", text_field="content")
    assert text.startswith("sub_b validation document 0") and "sub_a" not in text and " train " not in text
    files = hub_texts(hub_repo, tmp_path, data_files=("data/sub_a/train.jsonl",), text_field="content")
    assert files.startswith("sub_a train document 0") and "validation" not in files
    with pytest.raises(ConfigError) as info:
        hub_texts(hub_repo, tmp_path, text_field="content")
    assert str(info.value).endswith("set training.dataset_subset (one of ['sub_a', 'sub_b'])")
    with pytest.raises(ConfigError) as info:
        hub_texts(hub_repo, tmp_path, subset="sub_a", split="test", text_field="content")
    assert str(info.value).endswith("set training.dataset_split (one of ['train', 'validation'])")
    with pytest.raises(ConfigError, match=r"has no 'text' text column \(columns: content, id\); set training.data"):
        hub_texts(hub_repo, tmp_path, subset="sub_a")


def test_a_hub_validation_dataset_reads_its_own_split(hub_repo, tmp_path):
    cfg = parse_config(
        ["--training.dataset", str(hub_repo), "--training.dataset_subset", "sub_a", "--training.dataset_text_field",
         "content", "--validation.dataset", str(hub_repo), "--validation.dataset_subset", "sub_a",
         "--validation.enable", "--training.seq_len", "16", "--model.tokenizer", "byte",
         "--data.cache_dir", str(tmp_path / "c")]
    )  # fmt: skip
    tokenizer = run_tokenizer(cfg)
    corpus = build_data(cfg, tokenizer)
    windows = build_validation_data(cfg, tokenizer, corpus)
    first = bytes(t for t in windows[0].tolist() if t < 256).decode()
    assert first.startswith("sub_a validation"), first
    assert "hub:" in corpus.stores[0].label and "split train" in corpus.stores[0].label


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.dataset_subset", "x"], "training.dataset_subset applies only to a hub dataset"),
        (["--training.dataset_data_files", '["a"]'], "training.dataset_data_files applies only to a hub dataset"),
        (["--validation.dataset_subset", "x"], "validation.dataset_subset applies only to a hub dataset"),
        (["--training.dataset_split", ""], "training.dataset_split is empty"),
        (["--training.dataset_text_field", ""], "training.dataset_text_field is empty"),
    ],
)
def test_hub_keys_elsewhere_are_refused_not_ignored(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(args)


def test_training_sources_carry_the_keys(tmp_path):
    cfg = parse_config(
        ["--training.dataset", "local", "--training.dataset_path", str(tmp_path), "--training.dataset_text_field",
         "content", "--data.skip_unsupported_files"]
    )  # fmt: skip
    ((source, weight),) = training_sources(cfg)
    assert (source.text_field, source.split, source.skip_unsupported, weight) == ("content", "train", True, 1.0)


# datasets folders and arrow files


def test_datasets_save_to_disk_folders_and_arrow_files_give_the_tokens_of_the_jsonl(tmp_path):
    import datasets

    expected = reference(TEXTS, tmp_path)
    whole = datasets.Dataset.from_dict({"content": TEXTS, "n": list(range(40))})
    whole.save_to_disk(str(tmp_path / "saved"))
    assert tokens(tmp_path / "saved", tmp_path, text_field="content") == expected
    splits = datasets.DatasetDict(
        {"train": whole, "validation": datasets.Dataset.from_dict({"content": ["held out"], "n": [0]})}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    assert tokens(tmp_path / "dict", tmp_path, text_field="content") == expected
    gpt2 = GPT2Tokenizer()
    held = tokens(tmp_path / "dict", tmp_path, text_field="content", split="validation")
    assert held == [*gpt2.encode("held out"), gpt2.eot_id]
    with pytest.raises(ConfigError, match=r"has no split 'test' \(splits: train, validation\); set training.dataset"):
        tokens(tmp_path / "dict", tmp_path, text_field="content", split="test")
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))
    assert tokens(arrow[0], tmp_path, text_field="content") == expected, "one .arrow file, read in place"
