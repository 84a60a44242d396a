"""`titanlite bench data`: on a small generated corpus, the figures it prints and writes agree with each
other and with the store prepare wrote. (Whether prepare reaches 0.8 x raw tiktoken, or the start-up
and memory targets, is a measurement recorded in BENCHMARKS.md, not asserted here.)"""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env
from titanlite.tools.bench_data import make_corpus


def bench_data(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "bench", "data", *args]
    return subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~13 s of a benchmark tool; its bad-option checks stay in the default suite
def test_bench_data_prints_and_writes_figures(tmp_path):
    out, keep = tmp_path / "bench.json", tmp_path / "keep"
    proc = bench_data("--mb", "2", "--repeats", "1", "--output", str(out), "--keep", str(keep))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert row["mib"] == 2 and 2 * 2**20 <= row["bytes"] < 2 * 2**20 + 100_000
    # Every document is one JSONL line of the kept corpus.
    lines = (keep / "corpus-2mib.jsonl").read_text().splitlines()
    assert len(lines) == row["documents"] > 10 and all(json.loads(line)["text"] for line in lines)
    # Prepare's store holds the raw tiktoken tokens plus one end-of-text id per document.
    assert row["tokens"] == row["raw_tokens"] + row["documents"] and row["tokens_match"]
    assert row["prepare_tokens_per_s"] == row["tokens"] / row["prepare_seconds"]
    assert row["ratio"] == row["prepare_tokens_per_s"] / row["raw_tokens_per_s"]
    assert row["ratio_core_threads"] == row["prepare_tokens_per_s"] / row["raw_core_threads_tokens_per_s"]
    assert 50 < row["peak_process_rss_mib"] <= min(row["peak_tree_rss_mib"], row["peak_process_hwm_mib"])
    assert len(row["startup_runs"]) == 1 and row["startup_seconds"] == row["startup_runs"][0] > 0
    assert row["stdlib_startup_seconds"] > 0 and row["open_store_ms"] > 0
    assert report["targets"]["prepare tokens = raw tokens + one end-of-text per document"] is True
    table_row = f"| 2 | {row['documents']:,} | {row['tokens']:,} | {row['raw_tokens_per_s']:,.0f}; "
    assert any(line.startswith(table_row) for line in proc.stdout.splitlines()), proc.stdout
    assert "PASS  prepare tokens = raw tokens + one end-of-text per document" in proc.stdout
    # A later run reuses the kept corpus instead of generating it again.
    assert "generated" in proc.stderr
    corpus = keep / "corpus-2mib.jsonl"
    mtime = corpus.stat().st_mtime_ns
    assert make_corpus(keep, 2) == (corpus, row["documents"]) and corpus.stat().st_mtime_ns == mtime


def test_bench_data_refuses_bad_options_in_one_line():
    proc = bench_data("--mb", "x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("titanlite: error: bench data --mb") and proc.stderr.count("\n") == 1
    proc = bench_data("--workers", "two")
    assert proc.stderr.strip() == "titanlite: error: bench data --workers takes a whole number, not 'two'"
