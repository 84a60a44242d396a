"""A compressed corpus file cut short (an interrupted download or copy) beside good ones: every codec the reader
takes (.gz, .zst, .bz2, .xz) refuses it in one line naming it, wherever the cut lands (mid-stream, right after the
header, one byte short, nothing left), and nothing is written; a whole stream of JSON lines whose text stops
mid-line names the file and that line; a corpus with no documents names its files."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
import re
from pathlib import Path

import pytest
import zstandard

from titanlite.base.errors import ConfigError
from titanlite.commands import cli
from titanlite.data.sources import Source
from titanlite.data.store import open_store
from titanlite.data.tokenizer import ByteTokenizer

COMPRESS = {
    "gz": gzip.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
    "bz2": bz2.compress,
    "xz": lambda data: lzma.compress(data, preset=1),  # the format as any preset writes it, quickly
}
# Where a stream's header ends: cut there, a file starts as its format does and decodes to nothing.
HEADER = {"gz": lambda full: 10, "zst": zstandard.frame_header_size, "bz2": lambda full: 4, "xz": lambda full: 12}


def rows(n: int, seed: int = 0) -> bytes:
    """`n` JSON lines of varied words: a few hundred KiB compress into several blocks, so a cut halfway leaves some
    text that decodes."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    return "".join(json.dumps({"text": " ".join(rng.choices(words, k=40))}) + "\n" for _ in range(n)).encode()


def store(folder: Path, cache: Path):
    return open_store(Source("local", str(folder), "training.dataset_path"), ByteTokenizer(), cache, workers=1)


def truncated(path: Path, codec: str, size: int) -> str:
    return (
        f"{path} is truncated: its .{codec} stream ends after {size:,} bytes, before its end marker (an interrupted "
        "download or copy); download or compress it again, or remove it from the corpus"
    )


@pytest.mark.parametrize("codec", sorted(COMPRESS))
def test_a_truncated_compressed_file_beside_good_ones_is_one_line_naming_it(tmp_path, codec):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(rows(20, seed=1))
    good = COMPRESS[codec](rows(20, seed=2))
    (data / f"c.jsonl.{codec}").write_bytes(good + COMPRESS[codec](rows(10, seed=3)))  # two streams, as `cat` makes
    assert store(data, tmp_path / "cache").documents == 50, "the good files are read whole"
    full = COMPRESS[codec](rows(1000))
    cuts = {"half": len(full) // 2, "header": HEADER[codec](full), "one byte short": len(full) - 1, "empty": 0}
    for inner, cut in [("jsonl", "half"), ("txt", "half"), ("jsonl", "header"), ("txt", "one byte short"),
                       ("jsonl", "empty")]:  # fmt: skip
        path = data / f"b.{inner}.{codec}"
        path.write_bytes(full[: cuts[cut]])
        cache = tmp_path / f"cache-{inner}-{cut}"
        with pytest.raises(ConfigError) as info:
            store(data, cache)
        assert str(info.value) == truncated(path, codec, cuts[cut]), (inner, cut)
        assert not cache.exists(), f"{inner}, {cut}: nothing is written"
        path.unlink()
    damaged = data / f"d.jsonl.{codec}"
    damaged.write_bytes(b"not compressed at all\n" * 10)  # not cut short: damaged, said as such
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(damaged))} is not a readable \.{codec} file \(.+\); re-create or remove it$",
    ):
        store(data, tmp_path / "cache-damaged")


@pytest.mark.parametrize("codec", ["", *sorted(COMPRESS)])
def test_json_lines_whose_text_stops_mid_line_name_the_file_and_that_line(tmp_path, codec):
    path = tmp_path / ("cut.jsonl" + f".{codec}" * bool(codec))
    text = b'{"text": "one"}\n{"text": "two"}\n{"text": "thr'
    path.write_bytes(COMPRESS[codec](text) if codec else text)
    with pytest.raises(ConfigError) as info:
        store(path, tmp_path / "cache")
    assert str(info.value) == (
        f"{path} line 3 is not valid JSON (Unterminated string starting at), and it is the file's "
        "last line, with no line break after it: the file looks cut short; download or compress it again, or fix or "
        "remove that line"
    )


def test_a_corpus_with_no_documents_names_its_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"")
    (data / "b.jsonl.gz").write_bytes(gzip.compress(b"\n\n"))
    with pytest.raises(ConfigError) as info:
        store(data, tmp_path / "cache")
    assert str(info.value) == (
        f"training.dataset_path='{data}' has no documents (its 2 files hold no text: a.txt, b.jsonl.gz); point it at "
        "data with some text"
    )


def test_prepare_refuses_a_truncated_zst_in_one_line(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(rows(20))
    full = COMPRESS["zst"](rows(1000))
    (data / "b.jsonl.zst").write_bytes(full[: len(full) // 2])
    argv = ["prepare", "--training.dataset", "local", "--training.dataset_path", str(data), "--workers", "1"]
    assert cli.main([*argv, "--data.cache_dir", str(tmp_path / "cache"), "--model.tokenizer", "byte"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"titanlite: error: {truncated(data / 'b.jsonl.zst', 'zst', len(full) // 2)}"
    ]
    assert not (tmp_path / "cache").exists()
