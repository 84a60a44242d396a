"""What a crash, a reused pid, a read-only disk or a wrong path leaves in or around a run folder never blocks or
misleads the next start: each is kept where whole, or said in one line (the in-process half of
scripts/fault_survey.py's cases, cheap enough for every test run)."""

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import time

import pytest
import torch

from titanlite.base.errors import ConfigError
from titanlite.base.failures import (
    FAILURE_DIR_ENV,
    explain,
    mark_progress,
    process_state,
    record,
    stalled_peers,
)
from titanlite.builder.run import keep_metrics_up_to
from titanlite.components import run_lock
from titanlite.components.metrics import read_records
from titanlite.components.resilience import StopOnSignal
from titanlite.config import parse_config, refuse_repeated_keys
from titanlite.data.sources import Source, local_listing


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


def lock_of(run_dir, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "job": "launcher 1", "started": "2026-11-24 06:00:00", **holder}
    (run_dir / run_lock.LOCK_FILE).write_text(json.dumps(record))


def test_a_lock_whose_pid_a_later_process_reuses_is_taken_over(tmp_path, caplog):
    me = run_lock.process_identity(os.getpid())
    assert me["pid_start"] is not None and me["boot_id"]  # Linux: what the lock records
    # This test's own (live) pid, recorded with an earlier start time: the job that made the lock is gone and
    # an unrelated process now has its pid.
    lock_of(tmp_path / "reused", pid=os.getpid(), pid_start=me["pid_start"] - 1, boot_id=me["boot_id"])
    run_lock.check_free(tmp_path / "reused")
    with caplog.at_level(logging.WARNING):
        run_lock.acquire(tmp_path / "reused", "launcher 2").release()
    assert "now belongs to another process, started later); taking it over" in caplog.records[0].getMessage()
    lock_of(tmp_path / "rebooted", pid=os.getpid(), pid_start=me["pid_start"], boot_id="another-boot")
    run_lock.check_free(tmp_path / "rebooted")
    # The same pid and start time: the job itself, alive.
    lock_of(tmp_path / "live", pid=os.getpid(), **me)
    with pytest.raises(ConfigError, match="is in use by another job"):
        run_lock.check_free(tmp_path / "live")


def test_a_lock_that_cannot_be_judged_names_its_file_and_why(tmp_path):
    lock_of(tmp_path / "nopid", pid="twelve")
    with pytest.raises(ConfigError, match=r"\.lock names no valid pid, so whether its job lives cannot be told"):
        run_lock.acquire(tmp_path / "nopid", "launcher 2")
    lock_of(tmp_path / "far", host="another-host", pid=1)
    with pytest.raises(ConfigError, match=r"another host's job cannot be checked from here: .* delete .*far/\.lock"):
        run_lock.acquire(tmp_path / "far", "launcher 2")


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.EROFS, "its file system is read-only; make it writable by this user, or set job.dump_folder"),
        (errno.EACCES, "permission denied; make it writable by this user, or set job.dump_folder"),
        (errno.ENOSPC, "ran out of space"),
    ],
)
def test_a_run_folder_that_refuses_the_lock_is_one_line(tmp_path, monkeypatch, code, said):
    def refuse(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(run_lock.Path, "write_text", refuse)
    with pytest.raises(ConfigError) as caught:
        run_lock.acquire(tmp_path / "run", "launcher 1")
    assert said in str(caught.value) and "\n" not in str(caught.value)
    assert code == errno.ENOSPC or str(caught.value).startswith(f"cannot use {tmp_path / 'run'}: ")


def test_a_worker_refused_a_run_folder_file_says_which_in_one_line(tmp_path):
    file = tmp_path / "run" / "metrics.jsonl"
    status, line, with_traceback = explain(PermissionError(errno.EACCES, "Permission denied", str(file)), file.parent)
    assert (status, with_traceback) == (2, False)
    assert line.startswith(f"cannot use {file}: permission denied; make it writable by this user, or set job.dump")


def config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(argv)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_config_that_is_not_a_text_file_is_one_line_saying_what_it_is(tmp_path):
    binary = tmp_path / "model.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert config_error(["--config", str(binary)]) == (
        f"--config {binary}: not a TOML file: byte 0 (0x89) is not UTF-8 text (a binary or otherwise encoded "
        "file?); name a UTF-8 .toml file"
    )
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(data := '[job]\ndescription = "café"\n'.encode("latin-1"))
    assert f"byte {data.index(0xE9)} (0xe9) is not UTF-8 text" in config_error(["--config", str(latin1)])
    assert config_error(["--config", str(tmp_path)]).startswith(f"--config {tmp_path} is a folder, not a TOML file")
    os.mkfifo(tmp_path / "pipe.toml")
    assert config_error(["--config", str(tmp_path / "pipe.toml")]) == (
        f"--config {tmp_path / 'pipe.toml'} is a FIFO (named pipe), not a file; name a .toml file"
    )


@pytest.mark.parametrize("name", ["", " ", ".", ".."])
def test_a_job_name_that_names_no_run_folder_of_its_own_is_refused(name):
    assert config_error(["--job.name", name]).startswith(f"job.name={name!r} names no run folder of its own")


@pytest.mark.parametrize("name", ["/tmp/run", "../run", "a/../../run", "a/.."])
def test_a_job_name_that_leaves_the_dump_folder_is_refused(name):
    # The run folder is {dump_folder}/{name}: an absolute name or one that climbs out with '..' would write elsewhere.
    assert config_error(["--job.name", name]).startswith(f"job.name={name!r} ")


def test_a_job_name_may_hold_sub_folders_inside_the_dump_folder(tmp_path):
    cfg = parse_config(["--job.dump_folder", str(tmp_path), "--job.name", "sweep/lr-3e-3"])
    assert cfg.job.name == "sweep/lr-3e-3"


def repeated(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        refuse_repeated_keys(argv)
    return str(e.value)


def test_a_key_given_twice_on_the_command_line_is_refused_naming_both_values():
    # As a TOML key given twice is: the one kept would otherwise be the last, silently. The user's command line is
    # checked (titanlite's commands and the torchrun worker); code composing a run lets the last value win.
    assert repeated(["--optimizer.lr", "1e-3", "--training.steps", "3", "--optimizer.lr=2e-3"]) == (
        "optimizer.lr is given twice on the command line ('1e-3', then '2e-3'); give it once"
    )
    assert "--config is given twice on the command line ('a.toml', then 'b.toml')" in repeated(
        ["--config", "a.toml", "--config", "b.toml"]
    )
    assert "training.deterministic is given twice" in repeated(
        ["--training.deterministic", "--training.deterministic", "false"]
    )
    refuse_repeated_keys(["--prompt", "x", "--optimizer.lr", "1e-3", "--output", "y"])  # once each: fine


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    # Editors on Windows save UTF-8 with a BOM (EF BB BF); TOML's parser takes it for a statement.
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b'[job]\nname = "with-bom"\n')
    assert parse_config(["--config", str(path)]).job.name == "with-bom"
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xef\xbb\xbf" + '[job]\nname = "café"\n'.encode("latin-1"))
    offset = bad.read_bytes().index(0xE9)
    assert f"byte {offset} (0xe9) is not UTF-8 text" in config_error(["--config", str(bad)])


LONG = "a" * 300


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--config", f"/tmp/{LONG}.toml"], "--config"),
        (["--job.dump_folder", f"/tmp/{LONG}"], "job.dump_folder"),
        (["--job.name", f"sweep/{LONG}"], "job.name"),
        (["--model.flavor", "hf", "--model.hf_assets_path", f"/tmp/{LONG}"], "model.hf_assets_path"),
        (["--training.dataset", "local", "--training.dataset_path", f"/tmp/{LONG}/a.txt"], "training.dataset_path"),
        (["--training.dataset_mixture", f"/tmp/{LONG}:0.5,stdlib:0.5"], "training.dataset_mixture"),
        (["--data.cache_dir", f"/tmp/{LONG}"], "data.cache_dir"),
        (["--validation.dataset_path", f"/tmp/{LONG}"], "validation.dataset_path"),
        (["--checkpoint.initial_load_path", f"/tmp/{LONG}/step-3"], "checkpoint.initial_load_path"),
        (["--parallelism.pipeline_parallel_schedule_csv", f"{LONG}.csv"], "parallelism.pipeline_parallel_schedule_csv"),
        (["--profiling.save_traces_folder", LONG], "profiling.save_traces_folder"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_a_path_with_a_name_too_long_for_any_file_system_is_one_line_naming_the_key(argv, key):
    message = config_error(argv)
    assert message.startswith(f"{key}: its name 'aaaaaaaaaaaaaaaaaaaaaaaa...' is 30"), message
    assert "bytes long, more than the 255 a file or folder name may have; shorten it" in message


def test_a_path_too_long_for_the_system_is_one_line_naming_the_key(tmp_path):
    deep = "/".join(["b" * 200] * 21)  # 4220 bytes, each name within the limit
    message = config_error(["--training.dataset", "local", "--training.dataset_path", deep])
    assert message == "training.dataset_path is 4220 bytes long, more than the 4095 a path may have; use a shorter one"
    dump = "/tmp/" + "/".join(["c" * 200] * 20)  # 4024 bytes; the run folder adds the name
    message = config_error(["--job.dump_folder", dump, "--job.name", "d" * 100])
    assert message.startswith("the run folder (job.dump_folder/job.name) is 4125 bytes long, more than the 4095")


def test_a_lock_that_cannot_be_removed_is_left_with_a_note_not_a_traceback(tmp_path, monkeypatch, caplog):
    # The run folder made read-only mid-run: the launcher's release of its lock must not end the job in a traceback
    # after the worker's one line.
    lock = run_lock.acquire(tmp_path / "run", "launcher 1")

    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(run_lock.Path, "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        lock.release()
    assert lock.path.exists()
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        f"titanlite: note: could not remove the run folder's lock {lock.path} (Permission denied); the next launch "
        "on this folder takes it over, its job being gone"
    ]


def test_a_fifo_or_socket_as_the_dataset_is_named_as_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "corpus.txt")
    with pytest.raises(ConfigError, match=r"corpus\.txt' is a FIFO \(named pipe\), not a file; use a \.txt"):
        local_listing(Source("local", str(tmp_path / "corpus.txt"), "training.dataset_path"))
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "corpus.sock"))
        with pytest.raises(ConfigError, match=r"corpus\.sock' is a socket, not a file"):
            local_listing(Source("local", str(tmp_path / "corpus.sock"), "training.dataset_path"))


def test_a_sighup_stops_the_run_after_a_step_like_a_sigterm():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop = StopOnSignal(torch.device("cpu"))
        # Checked before sending it: without a handler a SIGHUP would end this test process.
        assert signal.getsignal(signal.SIGHUP) == stop.handle
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested() == signal.SIGHUP
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_finished_run_gives_the_stop_signals_their_handlers_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop = StopOnSignal(torch.device("cpu"))
        assert signal.getsignal(signal.SIGTERM) == stop.handle
        stop.close()  # a run no signal stopped
        assert {sig: signal.getsignal(sig) for sig in before} == before
        stop = StopOnSignal(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGTERM)
        stop.close()  # a stopped run keeps its handler: the launcher's echo of the signal must not kill it
        assert signal.getsignal(signal.SIGTERM) == stop.handle
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def mark(folder, rank: int, pid: int, step: int, attempt: int = 0) -> None:
    entry = {"rank": rank, "pid": pid, "step": step, "time": time.time(), "attempt": attempt}
    (folder / f"alive-rank{rank}.json").write_text(json.dumps(entry))


def test_a_timed_out_rank_names_the_peer_that_stopped_or_lags(tmp_path, monkeypatch, capsys):
    """A collective timeout with no failed peer names the rank that stopped answering: a process stopped by
    SIGSTOP (state T in /proc), or one that never began this rank's step; a peer running the same step is not
    blamed, nor marks of an earlier attempt."""
    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    mark_progress(4)  # rank 0, this process, on step 4
    assert json.loads((tmp_path / "alive-rank0.json").read_text())["pid"] == os.getpid()
    stopped = subprocess.Popen(["sleep", "60"])
    running = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        mark(tmp_path, 1, stopped.pid, 4)
        mark(tmp_path, 2, running.pid, 3)  # never began step 4
        mark(tmp_path, 3, running.pid, 4)  # on step 4 too: waiting, like rank 0
        mark(tmp_path, 5, stopped.pid, 1, attempt=1)  # another attempt's mark
        said = stalled_peers(tmp_path, 0, 0)
        assert len(said) == 2, said
        assert said[0].startswith(f"rank 1, which is stopped (process {stopped.pid} in state T"), said
        assert said[1].startswith(f"rank 2 (pid {running.pid}), which never began step 4: its last mark"), said
        code = record(RuntimeError("Timed out waiting 5000ms for send operation to complete"), 0, None)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 1
        assert line.startswith("titanlite: error: rank 0: timed out waiting for rank 1, which is stopped"), line
        assert "here: RuntimeError: Timed out waiting 5000ms" in line
        assert json.loads((tmp_path / "rank0.json").read_text())["peer_lost"] is False  # its own failure
    finally:
        for proc in (stopped, running):
            proc.kill()
            proc.wait()
    assert process_state(stopped.pid) is None  # gone
    (tmp_path / "alive-rank2.json").unlink()
    assert stalled_peers(tmp_path, 0, 0) == []  # rank 1 is no longer stopped; the rest are on step 4


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("kil@3:1", "TITANLITE_FAULT item 'kil@3:1' is not NAME@STEP or NAME@STEP:RANK, NAME one of kill, nan,"),
        ("kill@three", "TITANLITE_FAULT item 'kill@three' is not NAME@STEP"),
        ("nan@3,error@2:x", "TITANLITE_FAULT item 'error@2:x' is not NAME@STEP"),
        ("wait@1", "TITANLITE_FAULT=wait@STEP needs TITANLITE_FAULT_RELEASE"),
    ],
)
def test_a_fault_hook_it_does_not_know_is_refused(spec, fragment, monkeypatch):
    # The test hooks (TITANLITE_FAULT) run a named fault or say why not; a misspelt one never runs nothing silently.
    from titanlite.components.resilience import Faults

    monkeypatch.delenv("TITANLITE_FAULT_RELEASE", raising=False)
    with pytest.raises(ValueError, match="^" + fragment.replace("(", r"\(")):
        Faults(spec, rank=0)
    assert Faults("kill@3:1,nan@5,hang@2", rank=1).kill_step == 3
