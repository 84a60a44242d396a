"""The device switch (TITANLITE_DEVICE), the NGPU check and the failure lines, in a simulated GPU
environment: torch.cuda is patched to report GPUs on this CPU machine."""

import json

import pytest
import torch

from titanlite.base import devices
from titanlite.base.errors import ConfigError


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine where torch sees one CUDA GPU (set_device is a no-op: there is no real one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def test_cpu_switch_pins_every_rank_to_the_cpu_on_a_gpu_box(one_gpu, monkeypatch):
    monkeypatch.setenv("TITANLITE_DEVICE", "cpu")  # what tests/conftest.py sets for the whole suite
    assert devices.device_type() == "cpu"
    assert devices.local_device(1) == torch.device("cpu")
    devices.check_local_ranks(4)  # four gloo ranks on the CPU: no GPU count applies


def test_gpu_box_defaults_to_cuda_local_rank(one_gpu, monkeypatch):
    monkeypatch.delenv("TITANLITE_DEVICE")
    assert devices.device_type() == "cuda"
    assert devices.local_device(0) == torch.device("cuda", 0)
    devices.check_local_ranks(1)
    with pytest.raises(
        ConfigError,
        match=r"NGPU=2 processes per node, but this machine has 1 visible CUDA GPU\(s\); "
        r"set NGPU <= 1, or TITANLITE_DEVICE=cpu to run 2 gloo processes on the CPU",
    ):
        devices.check_local_ranks(2)


def test_bad_switch_values_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("TITANLITE_DEVICE", "gpu")
    with pytest.raises(ConfigError, match="TITANLITE_DEVICE='gpu' is not a device; use cpu, cuda"):
        devices.device_type()
    monkeypatch.setenv("TITANLITE_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="TITANLITE_DEVICE=cuda but torch sees no CUDA GPU here"):
        devices.device_type()


def test_check_refuses_more_ranks_than_gpus_before_anything_else(one_gpu, monkeypatch, capsys):
    from titanlite.commands import check
    from titanlite.commands.cli import main

    def looked_at(*args, **kwargs):
        raise AssertionError("the layout or the data was looked at before the GPUs were counted")

    monkeypatch.delenv("TITANLITE_DEVICE")
    monkeypatch.setattr(check, "plan_run", looked_at)  # refused before the layout, the data or the model
    monkeypatch.setattr(check, "build_data", looked_at)
    assert main(["check", "--world-size", "2", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titanlite: error: NGPU=2 processes per node, but this machine has 1")


def test_single_rank_fsdp_is_for_one_device_only():
    from titanlite.config import parse_config
    from titanlite.parallel.dims import ParallelDims

    cfg = parse_config(["--parallelism.fsdp_single_rank"])
    one = ParallelDims.from_config(cfg.parallelism, 1)
    assert one.fsdp_enabled and one.dp_shard == 1 and one.describe() == "single device (FSDP on one rank)"
    offload = ParallelDims.from_config(parse_config([]).parallelism, 1, cpu_offload=True)
    assert offload.fsdp_enabled and offload.fsdp_single_rank
    assert not ParallelDims.from_config(parse_config([]).parallelism, 1).fsdp_enabled
    with pytest.raises(ConfigError, match="fsdp_single_rank is for a single-device run, but the world size is 2"):
        ParallelDims.from_config(cfg.parallelism, 2)


def test_cpu_offload_at_one_gpu_is_one_rank_fsdp(one_gpu, monkeypatch):
    from titanlite.builder.plan import plan_run
    from titanlite.config import parse_config

    monkeypatch.delenv("TITANLITE_DEVICE")
    plan = plan_run(parse_config(["--training.enable_cpu_offload"]), world_size=1)
    assert plan.dims.fsdp_single_rank and plan.dims.fsdp_enabled


# ----------------------------------------------------------------------------------------------
# Failures: one line, the right exit status, the root cause first


def raise_here(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_failure_lines_and_exit_statuses(tmp_path, capsys):
    from titanlite.base.errors import NonFiniteLoss
    from titanlite.base.failures import explain, record

    assert explain(raise_here(ConfigError("set x to y")))[:2] == (2, "set x to y")
    assert explain(raise_here(NonFiniteLoss("loss nan at step 3")))[0] == 3
    code, line, _ = explain(raise_here(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")))
    assert code == 4 and line.startswith(
        "out of device memory (CUDA out of memory. Tried to allocate 2 GiB) at tests/unit/test_devices.py:"
    )
    code = record(raise_here(KeyError("missing")), rank=3, run_dir=tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    log = tmp_path / "logs" / "error-rank3.log"
    assert code == 1 and err == [
        "titanlite: error: rank 3: KeyError: 'missing' "
        f"(tests/unit/test_devices.py:{raise_here.__code__.co_firstlineno + 2}); traceback in {log}"
    ]
    assert "Traceback (most recent call last)" in log.read_text() and "KeyError: 'missing'" in log.read_text()


def test_the_launcher_reports_the_earliest_failure_of_the_latest_attempt(tmp_path):
    from titanlite.base.failures import first_failure

    assert first_failure(tmp_path) is None
    entries = [
        (3, 1.0, 0, "old attempt"),
        (0, 12.0, 1, "peer lost"),
        (1, 11.0, 1, "root cause"),
        (2, 13.0, 1, "peer lost"),
    ]
    for rank, t, attempt, line in entries:
        (tmp_path / f"rank{rank}.json").write_text(
            json.dumps({"rank": rank, "code": 1, "line": line, "time": t, "attempt": attempt})
        )
    assert first_failure(tmp_path)["line"] == "root cause"


def test_a_rank_that_lost_its_peers_says_which_rank_failed_first(tmp_path, monkeypatch, capsys):
    # Rank 1 failed and recorded why; rank 0's collective then fails with gloo's lost connection, or times out:
    # rank 0's line is marked as a consequence and quotes rank 1's reason; the launcher still blames rank 1.
    from titanlite.base import failures

    monkeypatch.setenv(failures.FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(failures, "PEER_RECORD_WAIT_S", 0.0, raising=False)
    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:56482. "
        "This is typically caused by a remote worker crashing."
    )
    # No record of the failed rank (killed, or on another node): still marked, without naming it.
    failures.record(raise_here(RuntimeError(gloo)), rank=0, run_dir=None)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("titanlite: error: rank 0: lost its peers after another rank failed first"), line
    assert "here: Connection closed by peer [127.0.0.1]:56482 (tests/unit/test_devices.py:" in line
    assert failures.record(raise_here(RuntimeError("fault injection: boom")), rank=1, run_dir=None) == 1
    own = "RuntimeError: fault injection: boom (tests/unit/test_devices.py:"
    for error in (gloo, "[pair.cc:598] Timed out waiting 1800000ms for recv operation to complete"):
        failures.record(raise_here(RuntimeError(error)), rank=0, run_dir=None)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"titanlite: error: rank 0: lost its peers after rank 1 failed (rank 1's error: {own}")
        assert json.loads((tmp_path / "rank0.json").read_text())["peer_lost"] is True
        assert failures.first_failure(tmp_path)["rank"] == 1
    # A timeout with no failed peer is a hang of its own, and a ConfigError is always this rank's own.
    (tmp_path / "rank1.json").unlink()
    failures.record(raise_here(RuntimeError("Timed out waiting 1800000ms for recv")), rank=0, run_dir=None)
    assert "lost its peers" not in capsys.readouterr().err
    failures.record(raise_here(RuntimeError("fault injection: boom")), rank=1, run_dir=None)
    failures.record(raise_here(ConfigError("comm.train_timeout_seconds=0 must be positive")), rank=0, run_dir=None)
    assert "rank 0: comm.train_timeout_seconds=0 must be positive" in capsys.readouterr().err


def test_under_the_launcher_a_failure_is_one_line_the_launchers(tmp_path, monkeypatch, capsys):
    # A worker on the launcher's last attempt records its line and leaves it to the launcher, which prints it last,
    # after torchrun's report: the line once, not twice. An attempt that torchrun will restart prints its own (nobody
    # else would say why it failed), as does a worker without a launcher.
    from titanlite.base import failures

    monkeypatch.setenv(failures.FAILURE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert failures.record(RuntimeError("first attempt"), rank=0, run_dir=None) == 1
    assert "titanlite: error: rank 0: RuntimeError: first attempt" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert failures.record(ConfigError("cannot use /x/run/step-4.tmp: permission denied"), rank=0, run_dir=None) == 2
    assert capsys.readouterr().err == ""
    line = "titanlite: error: rank 0: cannot use /x/run/step-4.tmp: permission denied"
    assert json.loads((tmp_path / "rank0.json").read_text())["line"] == line


def test_a_launcher_stopped_by_a_signal_prints_its_workers_line(monkeypatch, capsys):
    # SIGTERM to the launcher: torchrun stops the workers, which record why they stopped; the launcher says it.
    import os
    import signal
    from pathlib import Path

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from titanlite.base import failures
    from titanlite.commands import launch

    line = "titanlite: error: rank 0: stopped by SIGTERM after step 3, with a checkpoint of it; run the same command"

    def stopped(argv):
        entry = {"rank": 0, "code": 143, "line": line, "time": 1.0, "attempt": 0, "peer_lost": False}
        (Path(os.environ[failures.FAILURE_DIR_ENV]) / "rank0.json").write_text(json.dumps(entry))
        raise SignalException("stopped", signal.SIGTERM)

    monkeypatch.setattr(launch, "start", stopped)
    assert launch.run(["--standalone", "--nproc-per-node", "1", "-m", "titanlite.commands.train"]) == 143
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_torchrun_failure_is_one_line(monkeypatch, capsys):
    # e.g. RDZV_ENDPOINT naming a host that does not resolve: torchrun retries, then raises from the cause.
    from titanlite.commands import launch

    def fail(args):
        try:
            raise OSError("nosuchhost.invalid: Name or service not known")
        except OSError as cause:
            raise RuntimeError(
                "The connection to the C10d store has failed. See inner exception for details."
            ) from cause

    monkeypatch.setattr(launch, "start", fail)
    assert launch.main(["--standalone", "--nproc-per-node", "1", "-m", "titanlite.commands.train"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "titanlite: error: torchrun could not run the job: RuntimeError: The connection to the C10d store has "
        "failed. See inner exception for details.; from OSError: nosuchhost.invalid: Name or service not known"
    ]


def test_a_failure_is_reported_when_the_launchers_folder_is_gone(tmp_path, monkeypatch, capsys):
    # A launcher run in this process (a tool, a test) removed its failure folder; a later record() must still
    # print its line and return the status, not raise FileNotFoundError while reporting.
    from titanlite.base import failures

    monkeypatch.setenv(failures.FAILURE_DIR_ENV, str(tmp_path / "gone"))
    assert failures.record(RuntimeError("boom"), rank=0, run_dir=None) == 1
    assert "rank 0: RuntimeError: boom" in capsys.readouterr().err
