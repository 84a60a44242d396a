"""`titanlite bench data`: prepare's speed beside raw tiktoken, its peak memory, and the start-up time of a
later run that opens the prepared store, on generated JSONL corpora of --mb MiB each.

Corpus: seeded, so every run gets the same one. Documents of 200-4000 words drawn by frequency from the
standard library's docstrings and comments, with sentences, commas and paragraphs, so that it tokenises at
the speed of English-like text.
Raw: the documents, read into memory untimed, through the project's GPT-2 encoding by tiktoken's
`encode_ordinary_batch` (batches of 1000), with its default threads (the target's baseline) and with one
thread per core (its best on a small machine); each timed before and after prepare and averaged, as a
shared machine's speed drifts.
Prepare: `titanlite prepare` into a fresh cache folder; wall time from launch to exit (interpreter and
imports included); tokens from its manifest. Peak memory: the summed VmRSS of its process tree, sampled
every 20 ms (pages the forked workers share count once per process, so the sum overstates), and the
largest single process's, sampled and as the kernel's high-water mark VmHWM. Not ru_maxrss: Linux records
there the high-water mark of the process that spawned the command, i.e. this one holding the raw
documents, so it would grow with the corpus.
Start-up: a fresh `titanlite check` on the prepared corpus beside one on the built-in corpus (median of
--repeats, alternating), and `open_store` itself in this process (median of 7).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from titanlite.base.command_line import CLI, check_output_file, take_options, write_output
from titanlite.base.errors import ConfigError
from titanlite.base.logs import STDERR
from titanlite.data.sources import Source, stdlib_files
from titanlite.data.store import open_store, read_manifest, store_folder
from titanlite.data.tokenizer import GPT2Tokenizer, gpt2_encoding

USAGE = """usage: titanlite bench data [--mb M[,M...]] [--zst] [--files N[,N...]] [--workers N] [--repeats R]
                            [--output FILE.json] [--keep DIR]
  --mb M,...     corpus sizes in MiB, one table row each (default 300,1000)
  --zst          also prepare each corpus as 8 .jsonl.zst shards (a compressed dump's layout), same documents
  --files N,...  also time a training rank's and check's start-up on folders of N one-document .jsonl files
  --workers N    passed to `titanlite prepare --workers` (default: prepare's own, every core)
  --repeats R    start-ups timed per corpus; the median is reported (default 3)
  --output FILE  also write the figures as JSON
  --keep DIR     generate the corpora in DIR and keep them, reused by later runs (default: a temporary
                 folder, removed afterwards)"""

SEED = 20240601
GENERATOR = "titanlite-bench-data-v1"  # bump when the generated text changes, so kept corpora are remade
WORDS_PER_DOC, VOCAB_WORDS, DOCS_PER_CHUNK = (200, 4000), 5000, 64
BATCH_DOCS, OPEN_REPEATS, ZST_SHARDS = 1000, 7, 8
SAMPLE_SECONDS, SCAN_SECONDS = 0.02, 0.25
logger = logging.getLogger(__name__)

# The prepared-store issue's targets.
MIN_RATIO, MAX_STARTUP_EXCESS_S, MAX_PEAK_MIB, MAX_PEAK_GROWTH = 0.8, 1.5, 1024, 1.10


def bench_data(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    defaults = {"mb": "300,1000", "zst": False, "files": "", "workers": -1, "repeats": 3, "output": "", "keep": ""}
    opts, rest = take_options(argv, defaults, "bench data")
    if rest:
        raise ConfigError(f"bench data does not take '{rest[0]}'; see `titanlite bench data --help`")
    check_output_file(opts["output"], "bench data --output")
    sizes = parse_sizes(opts["mb"])
    file_counts = parse_sizes(opts["files"], "--files", "file counts") if opts["files"] else []
    if opts["repeats"] < 1:
        raise ConfigError(f"bench data --repeats must be at least 1, not {opts['repeats']}")
    folder = Path(opts["keep"] or tempfile.mkdtemp(prefix="titanlite-bench-data-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        rows = [bench_size(mb, folder, opts["workers"], opts["repeats"]) for mb in sizes]
        if opts["zst"]:
            for row in rows:
                row.update(bench_compressed(row, folder, opts["workers"]))
        many = [bench_many_files(n, folder) for n in file_counts]
    finally:
        if not opts["keep"]:
            shutil.rmtree(folder, ignore_errors=True)
    report = {
        "python": sys.version.split()[0],
        "cpus": len(os.sched_getaffinity(0)),
        "workers": opts["workers"],
        "rows": rows,
        "many_files": many,
        "targets": targets(rows),
    }
    print(format_report(report))
    if opts["output"]:
        write_output(opts["output"], json.dumps(report, indent=2) + "\n")
    return 0


def parse_sizes(text: str, option: str = "--mb", what: str = "sizes in MiB") -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"bench data {option} takes {what} (whole numbers >= 1, comma-separated, e.g. 300,1000), not '{text}'"
        )
    return sizes


def bench_size(mb: int, folder: Path, workers: int, repeats: int) -> dict:
    corpus, documents = make_corpus(folder, mb)
    cache = folder / f"cache-{mb}"
    shutil.rmtree(cache, ignore_errors=True)
    texts = read_texts(corpus)
    cores = len(os.sched_getaffinity(0))
    raw_tokens, raw_before = raw_tokens_per_s(texts)
    cores_before = raw_tokens_per_s(texts, cores)[1]
    data = ["--training.dataset", "local", "--training.dataset_path", str(corpus), "--data.cache_dir", str(cache)]
    prep = run_measured(cli("prepare", *data, *(["--workers", str(workers)] if workers >= 0 else [])))
    raw_after, cores_after = raw_tokens_per_s(texts)[1], raw_tokens_per_s(texts, cores)[1]
    del texts
    note(
        f"{mb} MiB: raw {raw_before:,.0f} then {raw_after:,.0f} tokens/s ({cores} threads: {cores_before:,.0f} then "
        f"{cores_after:,.0f}); prepare {prep['seconds']:.1f} s"
    )
    local, stdlib = cli("check", *data), cli("check", "--data.cache_dir", str(cache))
    run_measured(stdlib)  # prepares the built-in corpus's store, untimed
    local_s, stdlib_s = zip(
        *[(run_measured(local)["seconds"], run_measured(stdlib)["seconds"]) for _ in range(repeats)]
    )
    tokens, open_ms = store_figures(corpus, cache)
    raw_rate, cores_rate = (raw_before + raw_after) / 2, (cores_before + cores_after) / 2
    return {
        "mib": mb,
        "bytes": corpus.stat().st_size,
        "documents": documents,
        "tokens": tokens,
        "raw_tokens": raw_tokens,
        "tokens_match": tokens == raw_tokens + documents,
        "raw_tokens_per_s": raw_rate,
        "raw_tokens_per_s_before": raw_before,
        "raw_tokens_per_s_after": raw_after,
        "raw_core_threads_tokens_per_s": cores_rate,
        "raw_core_threads_tokens_per_s_before": cores_before,
        "raw_core_threads_tokens_per_s_after": cores_after,
        "prepare_seconds": prep["seconds"],
        "prepare_tokens_per_s": tokens / prep["seconds"],
        "ratio": tokens / prep["seconds"] / raw_rate,
        "ratio_core_threads": tokens / prep["seconds"] / cores_rate,
        **{k: v for k, v in prep.items() if k != "seconds"},
        "startup_seconds": statistics.median(local_s),
        "stdlib_startup_seconds": statistics.median(stdlib_s),
        "startup_runs": list(local_s),
        "stdlib_startup_runs": list(stdlib_s),
        "open_store_ms": open_ms,
    }


def note(line: str) -> None:
    logger.info(f"bench data: {line}", extra=STDERR)  # stdout is the report's


# ----------------------------------------------------------------------------------------------
# The corpus


def make_corpus(folder: Path, mb: int) -> tuple[Path, int]:
    """corpus-<mb>mib.jsonl in `folder` and its document count; reused when its record says it is the same text."""
    path, record_path = folder / f"corpus-{mb}mib.jsonl", folder / f"corpus-{mb}mib.json"
    want = {"generator": GENERATOR, "seed": SEED, "mib": mb, "python": sys.version.split()[0]}
    try:
        record = json.loads(record_path.read_text())
        if {k: record[k] for k in want} == want and path.stat().st_size == record["bytes"]:
            return path, record["documents"]
    except (OSError, ValueError, KeyError):
        pass
    start = time.perf_counter()
    nbytes, documents = write_corpus(path, mb * 2**20)
    note(f"generated {nbytes / 2**20:,.0f} MiB, {documents:,} documents, in {time.perf_counter() - start:.1f} s")
    record_path.write_text(json.dumps({**want, "bytes": nbytes, "documents": documents}))
    return path, documents


def word_forms() -> tuple[np.ndarray, np.ndarray]:
    """Each of the VOCAB_WORDS commonest words of the standard library's docstrings and comments in 8 forms
    (plain or capitalised; then nothing, '.', ',' or '.' and a paragraph break), and their cumulative frequency."""
    counts: collections.Counter[str] = collections.Counter()
    prose, word = re.compile(r'"""(.*?)"""|#([^\n]*)', re.S), re.compile(r"\b[a-z]{2,14}\b|\ba\b")
    for f in stdlib_files():
        for m in prose.finditer(Path(f.path).read_text(errors="replace")):
            counts.update(word.findall(m.group(1) or m.group(2)))
    words, freq = zip(*sorted(counts.most_common(VOCAB_WORDS), key=lambda wc: (-wc[1], wc[0])))
    forms = [form for end in ("", ".", ",", ".\n\n") for w in words for form in (w + end, w.capitalize() + end)]
    return np.array(forms, dtype=object), np.cumsum(freq) / sum(freq)


def write_corpus(path: Path, target_bytes: int) -> tuple[int, int]:
    """Stream seeded documents as JSONL lines into `path` until it holds `target_bytes`, drawing the words
    of DOCS_PER_CHUNK documents at a time with numpy: bounded memory, and 1 GiB in well under a minute."""
    forms, cdf = word_forms()
    vocab, rng = len(cdf), np.random.default_rng(SEED)
    nbytes = documents = 0
    with open(path, "w", encoding="ascii") as out:
        while nbytes < target_bytes:
            lengths = rng.integers(WORDS_PER_DOC[0], WORDS_PER_DOC[1] + 1, size=DOCS_PER_CHUNK)
            stops = np.cumsum(lengths)
            words = np.minimum(np.searchsorted(cdf, rng.random(stops[-1])), vocab - 1)
            r = rng.random(stops[-1])
            end, para, comma = r < 1 / 14, r < 1 / 84, (r >= 1 / 14) & (r < 1 / 14 + 1 / 16)
            end[stops - 1], para[stops - 1], comma[stops - 1] = True, False, False  # documents end sentences
            ending = np.where(para, 3, np.where(end, 1, np.where(comma, 2, 0)))
            text = forms[(ending * vocab + words) * 2 + np.concatenate([[True], end[:-1]])].tolist()
            for a, b in zip((stops - lengths).tolist(), stops.tolist()):
                line = json.dumps({"text": " ".join(text[a:b]).replace("\n\n ", "\n\n")}) + "\n"
                out.write(line)
                nbytes, documents = nbytes + len(line), documents + 1
                if nbytes >= target_bytes:
                    break
    return nbytes, documents


def read_texts(path: Path) -> list[str]:
    with open(path, "rb") as f:
        return [json.loads(line)["text"] for line in f]


# ----------------------------------------------------------------------------------------------
# Measurements


def raw_tokens_per_s(texts: list[str], threads: int | None = None) -> tuple[int, float]:
    """Tokens of `texts` (no end-of-text ids) and tiktoken's speed on them, in batches of BATCH_DOCS, with
    `threads` threads (None: tiktoken's default)."""
    encoding, tokens = gpt2_encoding(), 0
    options = {} if threads is None else {"num_threads": threads}
    start = time.perf_counter()
    for i in range(0, len(texts), BATCH_DOCS):
        tokens += sum(map(len, encoding.encode_ordinary_batch(texts[i : i + BATCH_DOCS], **options)))
    return tokens, tokens / (time.perf_counter() - start)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", CLI, *args]


def run_measured(cmd: list[str]) -> dict:
    """Run `cmd` to completion: its wall time and peak memory (see the module docstring); a failure is an
    error that quotes the command's last line of output."""
    peaks, stop = [0, 0, 0], threading.Event()
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(target=sample_tree, args=(proc.pid, peaks, stop), daemon=True)
        sampler.start()
        proc.wait()
        seconds = time.perf_counter() - start
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            log.seek(0)
            last = (log.read().strip().splitlines() or ["no output"])[-1]
            raise ConfigError(f"`titanlite {' '.join(cmd[3:])}` failed (exit {proc.returncode}): {last}")
    return {
        "seconds": seconds,
        "peak_tree_rss_mib": peaks[0] / 1024,
        "peak_process_rss_mib": peaks[1] / 1024,
        "peak_process_hwm_mib": peaks[2] / 1024,
    }


def sample_tree(root: int, peaks: list[int], stop: threading.Event) -> None:
    """Keep peaks = [largest summed VmRSS of `root` and its descendants, largest single VmRSS, largest
    VmHWM] in KiB. The process list is rescanned only every SCAN_SECONDS: one scan of /proc costs
    milliseconds of CPU."""
    tree, next_scan = [root], 0.0
    while not stop.is_set():
        if time.perf_counter() >= next_scan:
            tree, next_scan = descendants(root), time.perf_counter() + SCAN_SECONDS
        rss, hwm = zip(*[memory_kib(pid) for pid in tree])
        peaks[:] = max(peaks[0], sum(rss)), max(peaks[1], *rss), max(peaks[2], *hwm)
        stop.wait(SAMPLE_SECONDS)


def descendants(root: int) -> list[int]:
    children = collections.defaultdict(list)
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:  # "pid (comm) state ppid ...", where comm may hold spaces and parentheses
            children[int(Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[1])].append(int(name))
        except (OSError, IndexError, ValueError):
            continue  # it has exited
    found, queue = [], [root]
    while queue:
        found.append(queue.pop())
        queue += children.get(found[-1], [])
    return found


def memory_kib(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of `pid`; zeros once it has exited (a zombie has neither line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    found = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+)", status, re.M))
    return int(found.get("VmRSS", 0)), int(found.get("VmHWM", 0))


def store_figures(corpus: Path, cache: Path) -> tuple[int, float]:
    """The tokens in the prepared store's manifest, and the median milliseconds `open_store` takes to
    open it as a start-up does (verify='stat')."""
    source, tokenizer = Source("local", str(corpus), "training.dataset_path"), GPT2Tokenizer()
    manifest = read_manifest(store_folder(cache, source, tokenizer))
    if manifest is None:
        raise ConfigError(f"prepare left no manifest for {corpus} in {cache}")
    times = []
    for _ in range(OPEN_REPEATS):
        start = time.perf_counter()
        open_store(source, tokenizer, cache, verify="stat")
        times.append(1e3 * (time.perf_counter() - start))
    return manifest["tokens"], statistics.median(times)


def bench_compressed(row: dict, folder: Path, workers: int) -> dict:
    """The row's documents as ZST_SHARDS .jsonl.zst files in corpus order, prepared into a fresh cache: the
    time, and whether the store holds exactly the plain corpus's tokens."""
    corpus = folder / f"corpus-{row['mib']}mib.jsonl"
    shards = folder / f"corpus-{row['mib']}mib-zst"
    if not (shards / ".done").exists():
        write_zst_shards(corpus, shards)
    cache = folder / f"cache-{row['mib']}-zst"
    shutil.rmtree(cache, ignore_errors=True)
    data = ["--training.dataset", "local", "--training.dataset_path", str(shards), "--data.cache_dir", str(cache)]
    prep = run_measured(cli("prepare", *data, *(["--workers", str(workers)] if workers >= 0 else [])))
    tokenizer = GPT2Tokenizer()
    zst = open_store(Source("local", str(shards), "training.dataset_path"), tokenizer, cache)
    plain = open_store(Source("local", str(corpus), "training.dataset_path"), tokenizer, folder / f"cache-{row['mib']}")
    same = len(zst) == len(plain) and all(
        np.array_equal(zst.read(i, min(i + 2**24, len(zst))), plain.read(i, min(i + 2**24, len(zst))))
        for i in range(0, len(zst), 2**24)
    )
    rate = len(zst) / prep["seconds"]
    note(f"{row['mib']} MiB as .jsonl.zst: prepare {prep['seconds']:.1f} s ({rate:,.0f} tokens/s)")
    return {
        "zst_bytes": sum(p.stat().st_size for p in shards.glob("*.zst")),
        "zst_prepare_seconds": prep["seconds"],
        "zst_prepare_tokens_per_s": rate,
        "zst_ratio": rate / row["raw_tokens_per_s"],
        "zst_same_tokens": same,
        "zst_peak_tree_rss_mib": prep["peak_tree_rss_mib"],
    }


def write_zst_shards(corpus: Path, shards: Path) -> None:
    import zstandard  # a declared dependency; only this measurement writes .zst

    shards.mkdir(parents=True, exist_ok=True)
    per_shard = -(-corpus.stat().st_size // ZST_SHARDS)
    with open(corpus, "rb") as source:
        for index in range(ZST_SHARDS):
            with open(shards / f"part-{index:05d}.jsonl.zst", "wb") as raw:
                writer = zstandard.ZstdCompressor(level=3).stream_writer(raw)
                written = 0
                while written < per_shard and (line := source.readline()):
                    writer.write(line)
                    written += len(line)
                writer.close()
    (shards / ".done").touch()  # hidden: not part of the corpus


def bench_many_files(count: int, folder: Path) -> dict:
    """A folder of `count` one-document .jsonl files (1,000 to a subfolder), prepared; then the median
    time of open_store as a training rank opens it (verify='stat': the listing, no stat per file above
    STAT_EACH_FILE_UP_TO files) and as `check` does (verify='sample': a stat and a sampled read per file)."""
    root = folder / f"files-{count}"
    if not (root / ".done").exists():
        for i in range(count):
            path = root / f"{i // 1000:05d}" / f"{i:07d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"text": f"Document {i}: a short text of a few words."}) + "\n")
        (root / ".done").touch()  # hidden: not part of the corpus
    cache = folder / f"cache-files-{count}"
    shutil.rmtree(cache, ignore_errors=True)
    data = ["--training.dataset", "local", "--training.dataset_path", str(root), "--data.cache_dir", str(cache)]
    prep = run_measured(cli("prepare", *data))
    source, tokenizer = Source("local", str(root), "training.dataset_path"), GPT2Tokenizer()
    rank_ms, check_ms = (timed_open(source, tokenizer, cache, verify) for verify in ("stat", "sample"))
    store = store_folder(cache, source, tokenizer)
    note(f"{count:,} files: prepare {prep['seconds']:.1f} s, rank open {rank_ms:.1f} ms, check open {check_ms:.1f} ms")
    return {
        "files": count,
        "prepare_seconds": prep["seconds"],
        "rank_open_ms": rank_ms,
        "check_open_ms": check_ms,
        "manifest_kib": (store / "manifest.json").stat().st_size / 1024,
        "sources_kib": (store / "sources.json").stat().st_size / 1024,
    }


def timed_open(source: Source, tokenizer, cache: Path, verify: str) -> float:
    times = []
    for _ in range(OPEN_REPEATS):
        start = time.perf_counter()
        open_store(source, tokenizer, cache, verify=verify)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------
# Report


def targets(rows: list[dict]) -> dict[str, bool | None]:
    small, large = min(rows, key=lambda r: r["mib"]), max(rows, key=lambda r: r["mib"])
    return {
        f"prepare tokens/s >= {MIN_RATIO} x raw tiktoken (default threads)": all(r["ratio"] >= MIN_RATIO for r in rows),
        f"(stricter) prepare tokens/s >= {MIN_RATIO} x raw tiktoken with one thread per core": all(
            r["ratio_core_threads"] >= MIN_RATIO for r in rows
        ),
        "prepare tokens = raw tokens + one end-of-text per document": all(r["tokens_match"] for r in rows),
        f"start-up within {MAX_STARTUP_EXCESS_S} s of the built-in corpus's": all(
            r["startup_seconds"] - r["stdlib_startup_seconds"] <= MAX_STARTUP_EXCESS_S for r in rows
        ),
        f"prepare peak tree RSS <= {MAX_PEAK_MIB} MiB": all(r["peak_tree_rss_mib"] <= MAX_PEAK_MIB for r in rows),
        f"peak tree RSS not growing with the corpus (largest size <= {MAX_PEAK_GROWTH} x smallest)": None
        if small is large
        else large["peak_tree_rss_mib"] <= MAX_PEAK_GROWTH * small["peak_tree_rss_mib"],
    }


def format_report(report: dict) -> str:
    workers = "default" if report["workers"] < 0 else report["workers"]
    lines = [
        f"bench data: Python {report['python']}, {report['cpus']} CPUs, prepare --workers {workers}",
        "",
        f"| MiB | documents | tokens | raw tok/s (default; {report['cpus']} threads) | prepare tok/s | ratio (default; "
        f"{report['cpus']} threads) | prepare wall s | peak tree RSS MiB | "
        "peak process VmHWM MiB | start-up s (stdlib s) | open_store ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['mib']:,} | {r['documents']:,} | {r['tokens']:,} | {r['raw_tokens_per_s']:,.0f}; "
            f"{r['raw_core_threads_tokens_per_s']:,.0f} | {r['prepare_tokens_per_s']:,.0f} | {r['ratio']:.2f}; "
            f"{r['ratio_core_threads']:.2f} | {r['prepare_seconds']:.1f} | {r['peak_tree_rss_mib']:,.0f} | "
            f"{r['peak_process_hwm_mib']:,.0f} | {r['startup_seconds']:.2f} ({r['stdlib_startup_seconds']:.2f}) | "
            f"{r['open_store_ms']:.1f} |"
        )
    if "zst_prepare_seconds" in report["rows"][0]:
        lines += [
            "",
            "| MiB | .jsonl.zst MiB (8 shards) | prepare tok/s | ratio to raw (default threads) | "
            "prepare wall s | peak tree RSS MiB | same tokens as .jsonl |",
            "|---:|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['mib']:,} | {r['zst_bytes'] / 2**20:,.0f} | {r['zst_prepare_tokens_per_s']:,.0f} | "
            f"{r['zst_ratio']:.2f} | {r['zst_prepare_seconds']:.1f} | {r['zst_peak_tree_rss_mib']:,.0f} | "
            f"{'yes' if r['zst_same_tokens'] else 'NO'} |"
            for r in report["rows"]
        ]
    if report["many_files"]:
        lines += [
            "",
            "| files | prepare s | rank open_store ms | check open_store ms | manifest KiB | sources.json KiB |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {m['files']:,} | {m['prepare_seconds']:.1f} | {m['rank_open_ms']:.1f} | {m['check_open_ms']:.1f} | "
            f"{m['manifest_kib']:.1f} | {m['sources_kib']:,.0f} |"
            for m in report["many_files"]
        ]
    lines.append("")
    lines += [f"{'n/a ' if ok is None else 'PASS' if ok else 'MISS'}  {name}" for name, ok in report["targets"].items()]
    lines += [
        f"token mismatch at {r['mib']} MiB: prepare {r['tokens']:,}, raw {r['raw_tokens']:,} + {r['documents']:,} "
        "documents"
        for r in report["rows"]
        if not r["tokens_match"]
    ]
    return "\n".join(lines)
