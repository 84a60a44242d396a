"""A prepare that fails (a bad file, Ctrl-C) leaves only what the next prepare continues from: the shards it finished
and the journal (progress.jsonl) that lists them, said in a line; otherwise nothing, not even its folder."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

import titanlite.data.store as store_module
from titanlite.base.errors import ConfigError
from titanlite.commands import cli
from titanlite.data.sources import Source
from titanlite.data.store import JOURNAL, LOCK, open_store
from titanlite.data.tokenizer import ByteTokenizer


def lines(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"document {i} " + "words " * 20}) + "\n" for i in range(start, start + n))


def test_a_prepare_that_fails_on_a_bad_file_writes_nothing(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(lines(5))
    (data / "b.jsonl").write_text('{"txt": "no text field"}\n')
    (tmp_path / "cache").mkdir()
    for cache in (tmp_path / "cache", tmp_path / "new" / "cache"):  # a cache folder that was there, one that was not
        argv = ["prepare", "--training.dataset", "local", "--training.dataset_path", str(data), "--workers", "1"]
        assert cli.main([*argv, "--data.cache_dir", str(cache), "--model.tokenizer", "byte"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f'titanlite: error: {data / "b.jsonl"} line 1 has no "text" string (it has: txt); set '
            "training.dataset_text_field to the field that holds the text"
        ]
    assert list((tmp_path / "cache").iterdir()) == [] and not (tmp_path / "new").exists()


def test_a_failure_after_finished_shards_keeps_them_for_the_next_prepare_and_says_so(tmp_path, caplog, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    for i, name in enumerate("abc"):
        (data / f"{name}.jsonl").write_text(lines(40, 40 * i))
    (data / "z.jsonl").write_text("not json\n")
    source = Source("local", str(data), "training.dataset_path")
    with caplog.at_level(logging.INFO, logger="titanlite.data.store"), pytest.raises(ConfigError, match="z.jsonl"):
        open_store(source, ByteTokenizer(), tmp_path / "cache", shard_bytes=4096, workers=1)
    (folder,) = (tmp_path / "cache").glob("store-*")
    kept = sorted(p.name for p in folder.glob("*.bin"))
    assert len(kept) == 3 and sorted(p.name for p in folder.iterdir()) == sorted([LOCK, JOURNAL, *kept])
    assert sorted(json.loads(line)["file"] for line in (folder / JOURNAL).read_text().splitlines()) == kept
    assert f"kept 3 finished shard(s) of this corpus in {folder} (listed in {JOURNAL}): the next" in caplog.text

    (data / "z.jsonl").write_text(lines(1))
    built = []
    real = store_module.tokenize_piece
    monkeypatch.setattr(store_module, "tokenize_piece", lambda task: built.append(task) or real(task))
    store = open_store(source, ByteTokenizer(), tmp_path / "cache", shard_bytes=4096, workers=1)
    assert len(built) == 1 and store.num_shards == 4 and not (folder / JOURNAL).exists()


def test_a_builder_waiting_on_a_lock_whose_file_was_removed_takes_a_new_one(tmp_path):
    path = tmp_path / "store-x" / LOCK
    order = []
    with store_module._exclusive_lock(path):

        def second() -> None:
            with store_module._exclusive_lock(path):
                order.append(path.exists())

        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.2)  # the waiter opened the old file and waits on it
        path.unlink()
        path.parent.rmdir()  # what a failed build with nothing to keep does, before it lets go
    waiter.join(5)
    assert order == [True], "the waiter holds a lock on the file now at the path, not on the removed one"
