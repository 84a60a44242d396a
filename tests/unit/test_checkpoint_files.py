"""A checkpoint's files in one process: checksums recorded per rank and merged, verified in shares, a changed
byte or an unreadable folder found; what a resume may change against the saved config."""

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers import logged
from titanlite.base.errors import ConfigError
from titanlite.components import checkpoint_files
from titanlite.components.checkpoint import process_saver_stager, stager_closed
from titanlite.components.checkpoint_files import (
    CHECKSUMS,
    MARKER,
    merge_checksums,
    pick_checkpoint,
    verify,
    write_rank_checksums,
)
from titanlite.components.resume import flat_config, resume_changes
from titanlite.config import parse_config


def saved(run: Path, step: int, ranks: int = 1) -> Path:
    """A complete checkpoint folder as a save leaves it: DCP's files, every rank's checksums merged, the marker."""
    folder = run / f"step-{step}"
    dcp.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, checkpoint_id=str(folder), no_dist=True)
    for rank in range(1, ranks):  # pretend other ranks wrote files too
        (folder / f"__{rank}_0.distcp").write_bytes(bytes(range(rank, rank + 64)))
    for rank in range(ranks):
        write_rank_checksums(folder, rank)
    merge_checksums(folder, ranks)
    (folder / MARKER).write_text(json.dumps({"step": step, "model_only": False, "world_size": ranks}))
    return folder


def test_each_rank_hashes_its_own_files_and_rank_0_merges_them(tmp_path):
    folder = saved(tmp_path, 5, ranks=3)
    recorded = json.loads((folder / CHECKSUMS).read_text())
    assert sorted(recorded) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert not list(folder.glob(".checksums-rank*"))
    assert verify(folder) is None


def test_a_changed_byte_is_found_by_exactly_one_share(tmp_path):
    folder = saved(tmp_path, 5, ranks=3)
    data = bytearray((folder / "__1_0.distcp").read_bytes())
    data[10] ^= 1
    (folder / "__1_0.distcp").write_bytes(bytes(data))
    problems = [verify(folder, share=(rank, 4)) for rank in range(4)]
    assert sum(p is not None for p in problems) == 1
    assert "__1_0.distcp does not match its checksum" in next(p for p in problems if p)
    assert verify(folder, contents=False) is None  # the size check alone cannot see it


def test_pick_skips_a_damaged_checkpoint_and_refuses_when_none_is_usable(tmp_path, caplog):
    saved(tmp_path, 5)
    newest = saved(tmp_path, 10)
    data = bytearray((newest / "__0_0.distcp").read_bytes())
    data[-5] ^= 0xFF
    (newest / "__0_0.distcp").write_bytes(bytes(data))
    caplog.set_level(logging.INFO, logger="titanlite")
    assert pick_checkpoint(tmp_path, -1) == tmp_path / "step-5"
    warnings = logged(caplog)
    assert warnings == [
        f"  checkpoint: WARNING skipping {newest}: __0_0.distcp does not match its checksum (its bytes changed after "
        "the save); resuming from step-5 instead"
    ]
    with pytest.raises(ConfigError, match="checkpoint.load_step=10: cannot load .* does not match its checksum"):
        pick_checkpoint(tmp_path, 10)
    (tmp_path / "step-5" / MARKER).unlink()
    with pytest.raises(
        ConfigError,
        match=r"no usable checkpoint in .*: step-10: .*; step-5: its marker titanlite.json is missing; .*"
        r"checkpoint.start_from_scratch = true",
    ):
        pick_checkpoint(tmp_path, -1)


def test_an_unreadable_checkpoint_is_listed_not_trained_over(tmp_path, monkeypatch):
    saved(tmp_path, 5)

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path / MARKER))

    monkeypatch.setattr(checkpoint_files, "read_marker", denied)  # what chmod 000 does to a non-root user
    with pytest.raises(
        ConfigError,
        match=r"no usable checkpoint .* step-5: its marker titanlite.json cannot be read \(Permission denied\)",
    ):
        pick_checkpoint(tmp_path, -1)


def test_a_resume_takes_optimizer_changes_and_refuses_data_and_model_ones():
    base = parse_config([])
    facts = {"model": {"dim": 64, "n_layers": 4}, "tokenizer": "t", "windows": 100}
    same = dict(facts)
    changed = parse_config(
        [
            "--optimizer.lr",
            "1e-4",
            "--lr_scheduler.warmup_steps",
            "3",
            "--training.max_norm",
            "0.5",
            "--job.description",
            "x",
            "--checkpoint.enable",  # (a resume is a run with checkpoints on)
            "--checkpoint.interval",
            "7",
        ]
    )
    changes = resume_changes(flat_config(base), facts, changed, same, set(), "step-5")
    assert changes == [
        "training.max_norm 1.0 -> 0.5",
        "optimizer.lr 0.003 -> 0.0001",
        "lr_scheduler.warmup_steps 10 -> 3",
    ]
    with pytest.raises(ConfigError, match="training.seed=1 differs from the 42 that step-5 was saved with"):
        resume_changes(flat_config(base), facts, parse_config(["--training.seed", "1"]), same, set(), "step-5")
    assert resume_changes(flat_config(base), facts, parse_config(["--training.seed", "1"]), same, {"dataloader"}, "s")
    with pytest.raises(ConfigError, match="the training corpus has 99 windows, not the 100 of step-5"):
        resume_changes(flat_config(base), facts, base, {**facts, "windows": 99}, set(), "step-5")
    # Another model in this run folder: the fix is a run folder of its own, not excluding parts of the load.
    with pytest.raises(
        ConfigError, match=r"model.n_layers=2 differs .*another model, .*own run folder \(set job.name\)"
    ):
        resume_changes(flat_config(base), facts, parse_config(["--model.n_layers", "2"]), same, set(), "step-5")
    with pytest.raises(ConfigError, match="the model's n_layers is 2, not the 4 that step-5 was saved with"):
        resume_changes(flat_config(base), facts, base, {**facts, "model": {"dim": 64, "n_layers": 2}}, set(), "step-5")
    with pytest.raises(ConfigError, match="tokenizer's vocabulary differs"):
        resume_changes(flat_config(base), facts, base, {**facts, "tokenizer": "u"}, set(), "step-5")
    fresh_weights = {"model", "optimizer"}
    assert resume_changes(flat_config(base), facts, base, {**facts, "tokenizer": "u"}, fresh_weights, "s") == []


def test_the_run_facts_a_checkpoint_records_compare_equal_after_its_json():
    """Tuples in the model's arguments (SmolLM3's NoPE layers) come back from JSON as lists: the facts a run
    compares with a checkpoint's must be in that form already, or every resume would be refused."""
    from types import SimpleNamespace

    from titanlite.builder.plan import ModelPlan
    from titanlite.builder.run import run_facts

    cfg = parse_config(["--config", "train_configs/qwen3_debug.toml", "--model.name", "smollm3"])
    model = ModelPlan.of(cfg, SimpleNamespace(vocab_size=50257, fingerprint="t"))
    facts = run_facts(model, SimpleNamespace(windows=[0] * 7))
    assert facts["model"]["nope_layers"] == [3]
    assert json.loads(json.dumps(facts)) == facts
    assert resume_changes(flat_config(cfg), json.loads(json.dumps(facts)), cfg, facts, set(), "step-5") == []


def test_a_stager_closed_by_dcp_is_noticed_so_the_next_save_gets_a_fresh_one():
    """torch 2.11 closes a DefaultStager's inner stager after every stage; the next async_with_pinned_mem save
    then failed on an H100 with "KeyError: <class 'type'>". The checkpointer replaces a closed stager."""
    stager = process_saver_stager(pinned=False)
    state = {"w": torch.arange(4.0), "meta": {"step": 3}}
    assert not stager_closed(stager)
    assert torch.equal(stager.stage(state)["w"], state["w"])
    stager._state_dict_stager.close()  # what torch 2.11's DefaultStager does at the end of every stage
    assert stager_closed(stager)
    fresh = process_saver_stager(pinned=False)
    assert not stager_closed(fresh)
    assert fresh.stage(state)["meta"] == {"step": 3}
