"""Symlinks and every other entry of a dataset folder that is not a plain file: a dangling link is named with its
target (not blamed on the cache), a symlinked folder is read like a real one (a loop is refused), and whatever the
listing leaves out is said."""

from __future__ import annotations

import os
import socket

import pytest

from titanlite.base.errors import ConfigError
from titanlite.commands import cli
from titanlite.data.sources import Source, local_listing
from titanlite.data.store import describe, open_store
from titanlite.data.tokenizer import ByteTokenizer


def source(path, **options) -> Source:
    return Source("local", str(path), "training.dataset_path", **options)


def prepare(folder, cache) -> int:
    argv = ["prepare", "--training.dataset", "local", "--training.dataset_path", str(folder)]
    return cli.main([*argv, "--data.cache_dir", str(cache), "--model.tokenizer", "byte", "--workers", "1"])


def test_a_dangling_symlink_is_named_with_its_target_and_nothing_is_written(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    os.symlink(tmp_path / "gone.txt", folder / "b.txt")
    assert prepare(folder, tmp_path / "cache") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"titanlite: error: training.dataset_path='{folder}': {folder / 'b.txt'} is a symlink, but its target "
        f"{tmp_path / 'gone.txt'} does not exist; remove the link or restore its target"
    ]
    assert not (tmp_path / "cache").exists()
    os.symlink("../nowhere", folder / "sub")  # a relative target is shown resolved too
    os.unlink(folder / "b.txt")
    with pytest.raises(ConfigError, match=r"sub is a symlink, but its target \.\./nowhere \(.*/nowhere\) does not"):
        local_listing(source(folder))


def test_a_dangling_or_looping_link_named_by_the_key_itself(tmp_path):
    os.symlink(tmp_path / "moved", tmp_path / "corpus")
    with pytest.raises(ConfigError) as info:
        local_listing(source(tmp_path / "corpus"))
    assert str(info.value) == (
        f"training.dataset_path='{tmp_path / 'corpus'}' is a symlink, but its target {tmp_path / 'moved'} does not "
        "exist; restore its target or point the key at the data"
    )
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(ConfigError, match="is a symlink, but it leads back to itself through"):
        local_listing(source(tmp_path / "loop"))


def test_a_symlinked_folder_is_read_like_a_real_one_and_watched(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("bbb")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("aaa")
    os.symlink(elsewhere, folder / "linked")
    listing = local_listing(source(folder))
    assert listing.paths == (str(folder / "a.txt"), str(folder / "linked" / "b.txt"))
    assert str(folder / "linked") in listing.watched
    store = open_store(source(folder), ByteTokenizer(), tmp_path / "cache")
    assert store.read(0, len(store)).tolist() == [*b"aaa", 256, *b"bbb", 256]  # 256: the end-of-text id
    before = listing.fingerprint
    (elsewhere / "c.txt").write_text("ccc")  # a file added behind the link changes what the listing is named by
    os.utime(elsewhere, ns=(10**18, 10**18))
    after = local_listing(source(folder))
    assert after.fingerprint != before and str(folder / "linked" / "c.txt") in after.paths


def test_a_symlink_loop_is_refused_in_one_line(tmp_path):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("aaa")
    os.symlink("..", folder / "sub" / "up")
    with pytest.raises(ConfigError) as info:
        local_listing(source(folder))
    assert str(info.value) == (
        f"training.dataset_path='{folder}': {folder / 'sub' / 'up'} is a symlink to {folder}, a folder it is inside "
        "of (a loop); remove the link or point it elsewhere"
    )


def test_what_the_listing_leaves_out_is_said(tmp_path):
    folder = tmp_path / "data"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref")
    (folder / "a.txt").write_text("aaa")
    (folder / ".DS_Store").write_bytes(b"\0")
    os.symlink(tmp_path / "gone", folder / ".#a.txt")  # an editor's lock link: hidden, so left out (and said)
    store = open_store(source(folder), ByteTokenizer(), tmp_path / "cache")
    assert "3 hidden file(s) or folder(s) left out (.#a.txt, .DS_Store, .git)" in describe(store)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "part-0.txt").write_text("text")
    (tmp_path / "g" / "part-1").mkdir()
    listing = local_listing(source(tmp_path / "g" / "part-*"))
    assert listing.paths == (str(tmp_path / "g" / "part-0.txt"),)
    assert "1 folder(s) the pattern matched left out (part-1)" in listing.summary()


def test_a_special_file_or_unreadable_folder_in_a_folder_is_named(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("aaa")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(folder / "feed.txt"))
        with pytest.raises(ConfigError, match=r"data/feed.txt is a socket, not a file; remove it$"):
            local_listing(source(folder))
        with pytest.raises(ConfigError, match=r"matches .*feed.txt, which is a socket, not a file; remove it$"):
            local_listing(source(folder / "*.txt"))
    os.unlink(folder / "feed.txt")
    os.symlink(tmp_path / "gone.txt", folder / "b.txt")
    with pytest.raises(ConfigError, match=r"b.txt is a symlink, but its target .*gone.txt does not exist"):
        local_listing(source(folder / "*.txt"))


def test_a_folder_that_cannot_be_listed_is_named(tmp_path):
    locked = tmp_path / "data" / "locked"
    locked.mkdir(parents=True)
    (tmp_path / "data" / "a.txt").write_text("aaa")
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):
            pytest.skip("this user reads any folder (root)")
        with pytest.raises(ConfigError, match=r"cannot list its folder .*locked \(Permission denied\); fix its"):
            local_listing(source(tmp_path / "data"))
    finally:
        locked.chmod(0o755)
