"""What a crash, a reused pid, a read-only disk or a wrong path leaves in or around a run folder never blocks or
misleads the next start: each is kept where whole, or said in one line (the in-process half of
scripts/fault_survey.py's cases, cheap enough for every test run)."""

import json
import logging
import socket

from titanlite.builder.run import keep_metrics_up_to
from titanlite.components import run_lock
from titanlite.components.metrics import read_records


def metrics_with_torn_last_line(path, steps: int) -> list[str]:
    lines = [json.dumps({"step": s, "loss": 10.0 - s}) for s in range(1, steps + 1)]
    path.write_text("".join(line + "\n" for line in lines) + '{"step": 9, "lo')  # a crash mid-write
    return lines


def test_a_torn_metrics_line_is_dropped_in_one_line_and_the_whole_records_kept(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    lines = metrics_with_torn_last_line(path, 8)
    assert read_records(path) == ([json.loads(line) for line in lines], [9])
    with caplog.at_level(logging.WARNING):
        keep_metrics_up_to(path, 4)  # resumed from step 4
    assert path.read_text() == "".join(line + "\n" for line in lines[:4])
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and f"{path}: dropped 1 line(s) that are not whole records (line 9;" in notes[0], notes
    assert not list(tmp_path.glob("*.tmp"))


def test_a_torn_lock_is_taken_over_with_a_note(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / run_lock.LOCK_FILE).write_text(f'{{"host": "{socket.gethostname()}", "pid": 12')
    with caplog.at_level(logging.WARNING):
        lock = run_lock.acquire(run_dir, "launcher 7")
    assert lock.mine and run_lock.read_holder(run_dir / run_lock.LOCK_FILE)["job"] == "launcher 7"
    assert [r.getMessage() for r in caplog.records] == [
        f"titanlite: note: {run_dir / run_lock.LOCK_FILE} is not a whole lock record (a torn write); taking it over"
    ]
    lock.release()
    assert sorted(p.name for p in run_dir.iterdir()) == []  # no temporary file left either
