"""Training on the corpora users bring (the worker's own train() in the pool, tests/pool.py): a zstandard-compressed
JSON-lines dump, and the same text as .jsonl.gz, parquet, a `datasets` save_to_disk folder, one of its .arrow files
and Megatron int32 .bin/.idx, train with the losses of the same text as plain .jsonl, the start-up names the real
source, and a nanoGPT folder validates on its val.bin instead of training on it; a dump folder holding a file
titanlite cannot read stops ./run_train.sh before launch, in one line."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.helpers import TINY, last_wins, losses, metrics, run_train_sh, train_in_pool
from tests.unit.test_corpora import megatron_files
from titanlite.data.tokenizer import GPT2Tokenizer

# The files here hold GPT-2 ids (Megatron's, nanoGPT's), and every format is compared with the plain file's losses:
# GPT-2's tokenizer throughout (TINY's is the byte one).
TINY = last_wins([*TINY, "--model.tokenizer", "gpt2"])
# A corpus of about 10,000 GPT-2 tokens: enough windows of 32 for 5 steps of 8 and a held-out split.
TEXTS = [f"Document {i}. " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(40)) for i in range(120)]


@pytest.mark.slow  # two runs; tests/unit/test_corpora.py checks the same tokens without training
def test_a_zstandard_dump_trains_like_the_plain_jsonl_and_the_banner_names_it(tmp_path):
    data = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    (tmp_path / "plain.jsonl").write_bytes(data)
    (tmp_path / "dump.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    runs = {}
    for name in ("plain.jsonl", "dump.jsonl.zst"):
        run_dir = tmp_path / name.replace(".", "_")
        args = [*TINY, "--training.dataset", "local", "--training.dataset_path", str(tmp_path / name)]
        proc = train_in_pool(1, args, run_dir)
        runs[name] = losses(proc, run_dir)
        assert f"titanlite: run tiny GPT-2 on {tmp_path / name}\n" in proc.stdout, proc.stdout[:2000]
    assert runs["dump.jsonl.zst"] == runs["plain.jsonl"] and len(runs["plain.jsonl"]) == 5


def write_format(kind: str, folder) -> tuple[str, list[str]]:
    """TEXTS written as `kind` by the library that produces it; returns the dataset_path and the keys it needs."""
    if kind == "jsonl.gz":
        path = folder / "dump.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()))
        return str(path), []
    content = ["--training.dataset_text_field", "content"]
    if kind == "parquet":
        path = folder / "stack.parquet"
        pq.write_table(pa.table({"content": TEXTS, "n": list(range(len(TEXTS)))}), path, row_group_size=25)
        return str(path), content
    if kind in ("datasets", "arrow"):
        import datasets

        datasets.Dataset.from_dict({"content": TEXTS}).save_to_disk(str(folder / "saved"))
        arrow = sorted((folder / "saved").glob("*.arrow"))
        return str(folder / "saved" if kind == "datasets" else arrow[0]), content
    # Megatron, int32 ids (the builder's default): the GPT-2 ids of each text and its end-of-text, as
    # megatron-core's preprocess_data.py --append-eod writes them
    gpt2 = GPT2Tokenizer()
    documents = [[*gpt2.encode(t), gpt2.eot_id] for t in TEXTS]
    megatron_files(folder / "corpus_text_document", documents, np.int32, 4)
    return str(folder / "corpus_text_document"), []


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plain")
    (folder / "plain.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = [*TINY, "--training.dataset", "local", "--training.dataset_path", str(folder / "plain.jsonl")]
    return losses(train_in_pool(1, args, folder / "run"), folder / "run")


@pytest.mark.slow  # one run each; tests/unit/test_corpora.py checks the same tokens without training
@pytest.mark.parametrize("kind", ["jsonl.gz", "parquet", "datasets", "arrow", "megatron"])
def test_each_format_trains_like_the_plain_jsonl(tmp_path, plain_losses, kind):
    path, keys = write_format(kind, tmp_path)
    args = [*TINY, "--training.dataset", "local", "--training.dataset_path", path, *keys]
    proc = train_in_pool(1, args, tmp_path / "run")
    assert losses(proc, tmp_path / "run") == plain_losses and len(plain_losses) == 5
    assert f"titanlite: run tiny GPT-2 on {path}\n" in proc.stdout, proc.stdout[:2000]


@pytest.mark.slow  # tests/unit/test_corpora.py checks the same split without a run
def test_a_nanogpt_folder_validates_on_val_bin_and_never_trains_on_it(tmp_path):
    folder = tmp_path / "nanogpt"
    folder.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, 4000, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, 50257, 700, dtype=np.uint16).tofile(folder / "val.bin")
    args = [
        *TINY,
        "--training.dataset",
        "local",
        "--training.dataset_path",
        str(folder),
        "--validation.enable",
        "--validation.freq",
        "5",
    ]
    proc = train_in_pool(1, args, tmp_path / "run")
    assert len(losses(proc, tmp_path / "run")) == 5
    assert "(1 validation file(s) kept out of training (val.bin)): 4,000 tokens in 1 shard" in proc.stdout
    assert "validation: 21 windows of 32 tokens (672 targets) from the training folders' validation files" in (
        proc.stdout
    )
    assert [r["step"] for r in metrics(tmp_path / "run") if "val_loss" in r] == [5]


def test_a_dump_folder_names_every_file_it_reads_and_refuses_one_it_cannot(tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    for i in range(2):
        part = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[i * 60 : (i + 1) * 60]).encode()
        (folder / f"part-{i}.jsonl.gz").write_bytes(gzip.compress(part))
    (folder / "urls.txt").write_text("https://example.org/a\n")
    args = [*TINY, "--training.dataset", "local", "--training.dataset_path", str(folder)]
    proc = train_in_pool(1, args, tmp_path / "ok")
    assert len(losses(proc, tmp_path / "ok")) == 5
    assert f"data: {folder} (3 files: 2 .jsonl.gz, 1 .txt): 121 documents" in proc.stdout, proc.stdout[:3000]
    (folder / "README.md").write_text("# the dump\n")
    proc = run_train_sh(args, tmp_path / "refused")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"titanlite: error: training.dataset_path='{folder}' holds 1 file(s) titanlite does not read (README.md); "
        "remove them, or set data.skip_unsupported_files = true to leave them out"
    )
    assert "Traceback" not in proc.stderr
