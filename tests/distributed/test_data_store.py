"""Prepared token stores with real runs: pre-tokenized .bin/.npy files train alike, bad shards stop the launch
with one line, resume on a store mixture is exact on any layout, and ranks reuse a store without reading its text."""

import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import TINY, assert_close, losses, metrics, run_train_sh, titanlite_here, train_in_pool
from tests.pool import Ran

pytestmark = pytest.mark.distributed

STDLIB = Path(sysconfig.get_paths()["stdlib"])
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256
SINGLE = ["--training.local_batch_size", "8"]
GPT2 = ["--model.tokenizer", "gpt2"]  # the token files here hold GPT-2 ids (TINY's tokenizer is the byte one)
TWENTY = [*TINY, "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "5"]
FSDP4 = ["--training.local_batch_size", "2"]
TP2 = ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]


def local(path) -> list[str]:
    return ["--training.dataset", "local", "--training.dataset_path", str(path)]


def llmc_shard(path: Path, ids: np.ndarray, *, magic: int = LLMC_MAGIC, count: int | None = None) -> Path:
    """An llm.c / modded-nanogpt shard: 256 little-endian int32 (magic, version, token count), then uint16 ids."""
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:3] = magic, LLMC_VERSION, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + ids.astype("<u2").tobytes())
    return path


def stdlib_texts(folder: str, limit_bytes: int) -> list[str]:
    """Texts of the standard library's .py files in `folder`, sorted, about `limit_bytes` in all."""
    texts, total = [], 0
    for path in sorted((STDLIB / folder).glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


@pytest.fixture(scope="module")
def corpus_jsonl(tmp_path_factory):
    """A few hundred documents (the standard library's own tests, which the 'stdlib' corpus leaves out)."""
    docs = [text[:6000] for text in stdlib_texts("test", 2**40)][:400]
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
    assert len(docs) >= 300 and path.stat().st_size > 500_000
    return path


# ----------------------------------------------------------------------------------------------
# 1. Pre-tokenized files are read in place


def test_pretokenized_formats_give_bitwise_identical_losses(tmp_path):
    from titanlite.data.tokenizer import GPT2Tokenizer

    tokenizer = GPT2Tokenizer()
    ids = np.array([i for text in stdlib_texts("email", 600_000) for i in [*tokenizer.encode(text), tokenizer.eot_id]])
    assert 100_000 < len(ids) < 1_000_000 and ids.max() < tokenizer.vocab_size
    shards = tmp_path / "llmc"
    shards.mkdir()
    for i, part in enumerate(np.array_split(ids, 3)):  # three shards; the corpus is their concatenation
        llmc_shard(shards / f"train_{i:06d}.bin", part)
    (tmp_path / "raw.bin").write_bytes(ids.astype("<u2").tobytes())  # nanoGPT: a bare uint16 array
    np.save(tmp_path / "tokens.npy", ids.astype(np.int32))
    paths = {"llmc": (shards, 3), "raw": (tmp_path / "raw.bin", 1), "npy": (tmp_path / "tokens.npy", 1)}

    def train(name: str) -> list[float]:
        path, count = paths[name]
        proc = train_in_pool(1, [*TINY, *GPT2, *SINGLE, *local(path)], tmp_path / name)
        files = " (3 files: 3 .bin)" if count > 1 else ""
        assert f"data: {path}{files}: {len(ids):,} tokens in {count} shard" in proc.stdout, (
            proc.stdout[-2000:] + proc.stderr[-3000:]
        )
        return losses(proc, tmp_path / name)

    results = {name: train(name) for name in paths}  # one after another on the pool's rank
    assert len(results["llmc"]) == 5 and all(np.isfinite(results["llmc"]))
    assert results["raw"] == results["llmc"]  # bitwise
    assert results["npy"] == results["llmc"]


# ----------------------------------------------------------------------------------------------
# 2. Bad shards stop the launch with one line


def bad_shard(kind: str, folder: Path) -> Path:
    ids = np.arange(1000) % 50000
    if kind == "npy_id_too_large":
        ids[500] = 50257
        np.save(folder / "bad.npy", ids.astype(np.int32))
        return folder / "bad.npy"
    if kind == "raw_id_too_large":
        ids[999] = 60000
        (folder / "bad.bin").write_bytes(ids.astype("<u2").tobytes())
        return folder / "bad.bin"
    if kind == "truncated":
        return llmc_shard(folder / "bad.bin", ids, count=5000)
    return llmc_shard(folder / "bad.bin", ids, magic=12345, count=0)  # version 1, the rest of the header zero


# what the error line must say besides the file's path
BAD_SHARDS = {
    "npy_id_too_large": "50257",
    "raw_id_too_large": "60000",
    "truncated": "truncated",
    "unknown_magic": "12345",
}


# One case in the default suite; the others (each also a unit test of its message) run with --slow.
@pytest.mark.parametrize(
    "kind", [k if k == "truncated" else pytest.param(k, marks=pytest.mark.slow) for k in BAD_SHARDS]
)
def test_bad_shard_stops_the_launch_with_one_line(tmp_path, kind):
    data = tmp_path / "data"
    data.mkdir()
    path = bad_shard(kind, data)
    proc = run_train_sh([*TINY, *GPT2, *local(data)], tmp_path / "out", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("titanlite: error:") and str(path) in last and BAD_SHARDS[kind] in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "run" / "metrics.jsonl").exists()  # no worker trained


# ----------------------------------------------------------------------------------------------
# 3-4. Resume on a store mixture: exact on the same layout, close on another


@pytest.fixture(scope="module")
def mixture_runs(tmp_path_factory, corpus_jsonl):
    """FSDP x 4 on a 0.7/0.3 mixture of the .jsonl corpus (a prepared store) and stdlib: 20 steps straight,
    and a run stopped after step 10 (its step-10 checkpoint is reused)."""
    mixture = ["--training.dataset_mixture", f"{corpus_jsonl}:0.7,stdlib:0.3"]
    straight, stopped = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("stopped")
    for run_dir, extra in ((straight, []), (stopped, ["--training.stop_after_step", "10"])):
        proc = fsdp4(run_dir, mixture, *extra)
        assert f"data: {corpus_jsonl}: " in proc.stdout and "data: the standard-library corpus: " in proc.stdout, (
            proc.stdout[-3000:]
        )
    return straight, stopped, mixture


def fsdp4(run_dir: Path, mixture: list[str], *extra: str) -> Ran:
    proc = train_in_pool(4, [*TWENTY, *FSDP4, *mixture, *extra], run_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def resume_copy(stopped: Path, dest: Path) -> Path:
    """A run folder holding only what the stopped run left at step 10 (as in test_checkpoint.py)."""
    (dest / "run").mkdir(parents=True)
    shutil.copytree(stopped / "run" / "step-10", dest / "run" / "step-10")
    shutil.copy(stopped / "run" / "metrics.jsonl", dest / "run" / "metrics.jsonl")
    return dest


# ~45 s; exact resume stays in the default suite through test_checkpoint.py, mixtures through unit tests
@pytest.mark.slow
def test_resume_on_a_store_mixture_is_bitwise_exact(mixture_runs):
    straight, stopped, mixture = mixture_runs
    assert [r["step"] for r in metrics(stopped)] == list(range(1, 11))
    assert sorted(p.name for p in (stopped / "run").glob("step-*")) == ["step-10", "step-5"]
    proc = fsdp4(stopped, mixture)  # the same command again
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    resumed, expected = metrics(stopped), metrics(straight)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed[10:]] == [r["loss"] for r in expected[10:]]  # bitwise
    assert [r["grad_norm"] for r in resumed[10:]] == [r["grad_norm"] for r in expected[10:]]


# ~9-14 s more would take the file past its ~90 s default budget; cross-layout resume on the built-in
# corpus is in test_checkpoint.py's default set.
@pytest.mark.slow
def test_resume_on_a_store_mixture_on_another_layout(mixture_runs, tmp_path):
    straight, stopped, mixture = mixture_runs
    dest = resume_copy(stopped, tmp_path)
    proc = train_in_pool(2, [*TWENTY, *TP2, *mixture], dest)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    resumed = metrics(dest)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert_close([r["loss"] for r in resumed[10:]], [r["loss"] for r in metrics(straight)[10:]], 1e-5)


# ----------------------------------------------------------------------------------------------
# 5. Ranks trust a store by size and mtime; `titanlite check` also samples the content


# the in-process test_reopening_reads_neither_the_sources_nor_tokenises proves it in the default suite
@pytest.mark.slow
def test_ranks_reuse_the_store_without_reading_the_source(tmp_path, corpus_jsonl):
    source = tmp_path / "docs.jsonl"
    source.write_bytes(corpus_jsonl.read_bytes())
    args = [*TINY, *SINGLE, *local(source), "--data.cache_dir", str(tmp_path / "cache")]
    before = losses(train_in_pool(1, args, tmp_path / "before"), tmp_path / "before")  # prepares the store
    (store,) = [m.parent for m in (tmp_path / "cache").glob("store-*/manifest.json")]
    manifest = json.loads((store / "manifest.json").read_text())
    recorded = json.loads((store / "sources.json").read_text())  # each source file's size, mtime and hashes
    old_tokens = b"".join((store / s["file"]).read_bytes() for s in manifest["shards"])

    # The same bytes in another order (documents reversed): same size, and the mtime put back.
    stat = source.stat()
    lines = source.read_bytes().splitlines(keepends=True)
    source.write_bytes(b"".join(reversed(lines)))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    after = losses(train_in_pool(1, args, tmp_path / "after"), tmp_path / "after")
    assert after == before  # bitwise: the rank used the store and never read the changed text

    check = titanlite_here("check", "--world-size", "1", *args)
    said = check.stdout + check.stderr
    assert check.returncode == 0, said[-3000:]
    assert f"prepare {source}:" in said, said[-3000:]  # it noticed and re-tokenised
    rebuilt = json.loads((store / "manifest.json").read_text())
    assert json.loads((store / "sources.json").read_text())[0]["fingerprint"] != recorded[0]["fingerprint"]
    assert rebuilt["tokens"] == manifest["tokens"]  # the same documents...
    new_tokens = b"".join((store / s["file"]).read_bytes() for s in rebuilt["shards"])
    assert new_tokens != old_tokens  # ...in another order: a rank that read the text would have trained on these
