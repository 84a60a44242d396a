"""`titanlite check`'s memory preflight: it refuses what cannot fit, warns near the limit, agrees with
`titanlite plan`, knows CPU offload, and steps aside when training.memory_preflight is false."""

import json
import logging
import subprocess
import sys

import pytest

from tests.helpers import REPO, env, logged
from titanlite.base import devices
from titanlite.base.errors import ConfigError
from titanlite.builder.plan import plan_model
from titanlite.commands import check as preflight
from titanlite.commands import cli
from titanlite.commands.check import GIB, Capacity, config_estimate, memory_preflight, rank_needs
from titanlite.config import parse_config

# A tiny local corpus, so that `check` spends its time on the config and not on tokenising a corpus.
TINY_DATA = [
    "--training.dataset",
    "local",
    "--training.dataset_path",
    str(REPO / "tests" / "data" / "validation.txt"),
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "1",
]
LLAMA_70B = ["--model.name", "llama3", "--model.flavor", "70B"]
# Llama 3 8B at a short sequence: 7.4 B parameters x 16 bytes = 110 GiB of weights, gradients and AdamW state.
LLAMA_8B = [
    "--model.name",
    "llama3",
    "--model.flavor",
    "8B",
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "1",
]


def estimate_for(cfg, world_size: int, device: str):
    """check's config_estimate for the config's planned model (check passes its plan's)."""
    return config_estimate(cfg, world_size, device, plan_model(cfg))


def check_memory(cfg, world_size: int, local_ranks: int) -> None:
    memory_preflight(cfg, world_size, local_ranks, plan_model(cfg))


def pretend(monkeypatch, device: str, gpu_gib: float = 80.0, ram_gib: float = 512.0) -> None:
    """Make the preflight see `device` with one `gpu_gib` GPU per rank and `ram_gib` of RAM on the node."""
    monkeypatch.setattr(devices, "device_type", lambda: device)

    def capacity(pool: str, local_ranks: int) -> Capacity:
        if pool == "cuda":
            return Capacity(gpu_gib * GIB, "NVIDIA H100 80GB HBM3")
        return Capacity(ram_gib * GIB, "available RAM", local_ranks)

    monkeypatch.setattr(preflight, "memory_capacity", capacity)


def debug_need(local_ranks: int = 1) -> float:
    """Bytes one CPU rank of the default config (the debug model) needs, as the preflight counts them."""
    _, _, est = estimate_for(parse_config([]), local_ranks, "cpu")
    return rank_needs(est, "cpu")["cpu"][0]


def test_check_refuses_llama_70b_on_one_process_in_one_line():
    cmd = [sys.executable, "-m", "titanlite.commands.cli", "check", "--world-size", "1", *LLAMA_70B, *TINY_DATA]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "titanlite: error: memory: llama3 70B on single device needs about "
    ), lines
    # 69.3 B parameters x 16 bytes alone are 1032 GiB: the estimate, and the RAM it was compared with
    figure = float(lines[0].split("needs about ")[1].split(" GiB per rank")[0])
    assert 1032 < figure < 1100, lines[0]
    assert "GiB of available RAM" in lines[0] and "(estimate: " in lines[0]
    assert "no layout of 1 process fits" in lines[0] and lines[0].endswith("--training.memory_preflight false")
    assert "config ok" not in proc.stdout  # its time: scripts/bench_preflight.py


def test_the_preflight_of_llama_70b_refuses_it_in_process(monkeypatch):
    """The refusal itself, in this process (how long it takes: scripts/bench_preflight.py prints it)."""
    pretend(monkeypatch, "cpu", ram_gib=64)
    with pytest.raises(ConfigError, match="llama3 70B"):
        check_memory(parse_config(LLAMA_70B), 1, 1)


@pytest.mark.parametrize("local_ranks", [1, 2])
def test_debug_model_warns_near_the_limit_and_is_refused_over_it(monkeypatch, caplog, local_ranks):
    monkeypatch.setattr(devices, "device_type", lambda: "cpu")
    caplog.set_level(logging.INFO, logger="titanlite")
    need = debug_need(local_ranks)
    cfg = parse_config([])

    def run_with(share: float) -> list[str]:
        """The preflight's lines when this node's RAM is `need / share` per process."""
        ram = local_ranks * need / share
        monkeypatch.setattr(preflight, "memory_capacity", lambda pool, n: Capacity(ram, "available RAM", n))
        caplog.clear()
        check_memory(cfg, local_ranks, local_ranks)
        return logged(caplog)

    well_below = run_with(0.5)
    shared = f" shared by {local_ranks} processes" if local_ranks > 1 else ""
    assert len(well_below) == 1 and well_below[0].startswith("titanlite: memory: about "), well_below
    assert f"GiB of available RAM{shared}" in well_below[0] and "(estimate: " in well_below[0]
    near = run_with(0.95)
    assert len(near) == 1 and near[0].startswith("titanlite: warning: memory: gpt2 debug on "), near
    assert "is 95% of" in near[0]
    with pytest.raises(ConfigError) as refused:
        run_with(1.05)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("memory: gpt2 debug on ") and "more than" in message
    assert f"GiB of available RAM{shared}" in message and message.endswith("--training.memory_preflight false")


def test_plan_and_check_agree_on_the_estimate(tmp_path, monkeypatch, capsys):
    from titanlite.tools.plan import plan

    for device, ngpu in (("cpu", 2), ("cuda", 1)):
        out = tmp_path / f"plan-{device}.json"
        monkeypatch.setenv("TITANLITE_PLAN_JSON", str(out))
        assert plan(["--ngpu", str(ngpu), "--device", device]) == 0
        own = next(r for r in json.loads(out.read_text())["rows"] if r["own"])
        _, layout, est = estimate_for(parse_config([]), ngpu, device)
        assert own["layout"] == layout.name and own["peak"] == est["peak"], (device, own, est["peak"])
    capsys.readouterr()


def test_cpu_offload_moves_the_state_to_host_memory():
    facts, on_device, whole = estimate_for(parse_config(LLAMA_8B), 1, "cuda")
    _, offloaded, est = estimate_for(parse_config([*LLAMA_8B, "--training.enable_cpu_offload"]), 1, "cuda")
    assert offloaded.offload and offloaded.dims.fsdp_enabled and offloaded.dims.dp_shard == 1
    assert not on_device.offload and whole["host"] == 0
    # fp32 parameters, gradients and both AdamW moments: 16 bytes per parameter, on the host
    assert est["host"] == 16 * facts.params
    assert est["parameters"] == est["gradients"] == est["optimizer"] == 0
    assert est["peak"] < 0.15 * whole["peak"], (est["peak"] / GIB, whole["peak"] / GIB)
    # FSDP on one rank without offload keeps the state on the device, plus its gathered copies
    _, single, fsdp = estimate_for(parse_config([*LLAMA_8B, "--parallelism.fsdp_single_rank"]), 1, "cuda")
    assert single.name == "ZeRO-3 1" and fsdp["peak"] > whole["peak"] and fsdp["host"] == 0


def test_llama_8b_on_one_80_gib_gpu_is_told_to_offload(monkeypatch, caplog):
    pretend(monkeypatch, "cuda", gpu_gib=80, ram_gib=512)
    with pytest.raises(ConfigError) as refused:
        check_memory(parse_config(LLAMA_8B), 1, 1)
    message = str(refused.value)
    assert "\n" not in message and "more than 80.0 GiB of NVIDIA H100 80GB HBM3" in message
    assert "recommends ZeRO-3 1 + CPU offload" in message and "--training.enable_cpu_offload true" in message
    caplog.set_level(logging.INFO, logger="titanlite")
    caplog.clear()
    check_memory(parse_config([*LLAMA_8B, "--training.enable_cpu_offload"]), 1, 1)
    lines = logged(caplog)
    assert (
        len(lines) == 1
        and lines[0].startswith("titanlite: memory: about ")
        and "GiB of host memory per rank" in lines[0]
    )
    # the offloaded state must fit in the node's RAM too: 8 ranks x 14 GiB do not fit in 64 GiB
    pretend(monkeypatch, "cuda", gpu_gib=80, ram_gib=64)
    with pytest.raises(
        ConfigError, match=r"GiB of host memory per rank .*more than 64.0 GiB of available RAM shared by 8"
    ):
        check_memory(parse_config([*LLAMA_8B, "--training.enable_cpu_offload"]), 8, 8)


def test_plan_shows_offload_for_the_configs_own_layout(capsys):
    from titanlite.tools.plan import plan

    assert plan(["--ngpu", "1", *LLAMA_8B, "--training.enable_cpu_offload"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("layout"))
    assert " peak    host fits " in head
    row = next(line for line in out.splitlines() if line.startswith("ZeRO-3 1 + CPU offload (config)"))
    assert f"{16 * 8_030_261_248 / GIB:.2f}" in row.split()


def test_memory_preflight_false_skips_it(monkeypatch, capsys, caplog):
    def fail(*args, **kwargs):
        raise AssertionError("the preflight ran")

    monkeypatch.setattr(preflight, "config_estimate", fail)
    caplog.set_level(logging.INFO, logger="titanlite")
    check_memory(parse_config([*LLAMA_70B, "--training.memory_preflight", "false"]), 1, 1)
    assert logged(caplog) == []
    # and `check` launches a config that cannot fit when told so
    assert cli.main(["check", "--world-size", "1", *LLAMA_70B, *TINY_DATA, "--training.memory_preflight", "false"]) == 0
    out = capsys.readouterr().out
    assert "config ok for 1 process(es)" in out and "memory" not in out
