"""`titanlite plan` with expert parallelism: EP rows for mixtures of experts (none for dense models), the experts'
per-rank memory, all-to-all buffers and traffic derived from the model's shape, and bad EP degrees refused with the
run's own line."""

import json

import pytest

from tests.helpers import titanlite_here
from titanlite.base.errors import ConfigError
from titanlite.builder.layouts import Layout, layout_of
from titanlite.builder.plan import plan_model, plan_run
from titanlite.config import parse_config
from titanlite.models.qwen3_moe import FLAVORS
from titanlite.parallel.dims import ParallelDims
from titanlite.tools.plan import plan

SEQ = 4096
MOE_30B = [
    "--config",
    "train_configs/qwen3_moe_debug.toml",
    "--model.flavor",
    "qwen3_moe_30b_a3b",
    "--training.seq_len",
    str(SEQ),
    "--training.local_batch_size",
    "1",
]


def planned(tmp_path, monkeypatch, capsys, *args):
    out = tmp_path / "plan.json"
    monkeypatch.setenv("TITANLITE_PLAN_JSON", str(out))
    assert plan(list(args)) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_qwen3_moe_30b_on_8_gpus_plans_ep_rows_whose_experts_are_split_ep_ways(tmp_path, monkeypatch, capsys):
    stdout, result = planned(
        tmp_path, monkeypatch, capsys, *MOE_30B, "--ngpu", "8", "--parallelism.expert_parallel_degree", "8"
    )
    a = FLAVORS["qwen3_moe_30b_a3b"]
    assert not a.moe.dense_layers  # every layer sparse
    # Each block's routed experts: w1, w3 [E, expert_dim, dim] and w2 [E, dim, expert_dim].
    experts = a.n_layers * a.moe.n_experts * 3 * a.moe.expert_dim * a.dim
    state = 4 + 4 + 8  # fp32 weights and gradients, AdamW's two fp32 moments
    rows = {(r["layout"], r["ac"]): r for r in result["rows"]}
    ep_rows = [r for r in result["rows"] if r["ep"] > 1]
    assert {r["ep"] for r in ep_rows} == {2, 4, 8}
    for r in ep_rows:  # with ETP (= TP) each expert split over the TP ranks too
        assert r["layout"].endswith(f", EP {r['ep']}" + (f", ETP {r['etp']}" if r["etp"] > 1 else ""))
        tp = int(r["layout"].split("TP ")[1].split(",")[0]) if "TP " in r["layout"] else 1
        efsdp = 8 // tp // r["ep"]  # FSDP shards each EP rank's experts over the rest of dp_shard
        assert r["experts"] == pytest.approx(state * experts / (r["ep"] * efsdp * r["etp"]))
    # With ep = dp_shard (no further FSDP sharding of the experts) a rank keeps 1/ep of the experts' bytes.
    ep8 = rows[("ZeRO-3 8, EP 8", "none")]
    assert ep8["experts"] == pytest.approx(state * experts / 8)
    # TP does not split a MoE block: its experts are whole on both TP ranks, sharded by FSDP's 4 only.
    assert rows[("ZeRO-3 4 x TP 2", "none")]["experts"] == pytest.approx(state * experts / 4)
    assert rows[("ZeRO-2 4 x TP 2, EP 4", "none")]["experts"] == pytest.approx(state * experts / 4)
    # Expert tensor parallelism splits them over the TP ranks too: FSDP's 4 x TP's 2.
    assert rows[("ZeRO-3 4 x TP 2, ETP 2", "none")]["experts"] == pytest.approx(state * experts / 8)
    # The all-to-all buffers of the MoE layer running: the routed rows [tokens x top_k, dim] in and out, in bf16.
    rows_routed = ep8["micro_batch"] * SEQ * a.moe.top_k
    assert ep8["dispatch"] == pytest.approx(2 * rows_routed * a.dim * 2)
    assert rows[("ZeRO-3 8", "none")]["dispatch"] == 0
    # 2 all-to-alls forward and 2 backward per MoE layer, each moving (ep - 1) / ep of the rows off the rank.
    volume = 4 * a.n_layers * ep8["microbatches"] * rows_routed * a.dim * 2 * 7 / 8
    assert ep8["comm_bytes"]["ep all-to-all"] == pytest.approx(volume)
    # The experts' FSDP gathers nothing at EP 8 (one rank per expert shard): only the rest is all-gathered.
    assert ep8["comm_bytes"]["all-gather"] < rows[("ZeRO-3 8", "none")]["comm_bytes"]["all-gather"] / 10
    # The config's own EP layout gets its verdict, the fix on its own mesh.
    line = next(x for x in stdout.splitlines() if x.startswith("config ("))
    assert line.startswith("config (ZeRO-3 8, EP 8, AC none, micro-batch 1 x 1 accumulation): does not fit (")
    assert line.endswith("fix: --activation_checkpoint.mode full")
    run_it = next(x for x in stdout.splitlines() if x.startswith("  run it with:"))
    if result["recommended"]["layout"].endswith(", EP 2"):
        assert "--parallelism.expert_parallel_degree 2" in run_it


def test_the_ep_overrides_select_the_layout():
    lay = Layout(ParallelDims.of(dp_shard=4, tp=2, ep=4), "never")
    cfg = parse_config(["--config", "train_configs/qwen3_moe_debug.toml", *lay.overrides()])
    assert layout_of(cfg, 8, plan_model(cfg)) == lay
    assert "--parallelism.expert_parallel_degree" in Layout(ParallelDims.of(dp_shard=8)).overrides(every=True)


def test_a_dense_family_gets_no_ep_rows(tmp_path, monkeypatch, capsys):
    stdout, result = planned(
        tmp_path, monkeypatch, capsys, "--config", "train_configs/llama3_debug.toml", "--ngpu", "8"
    )
    assert result["rows"] and all(r["ep"] == 1 for r in result["rows"])
    assert ", EP " not in stdout and "mixture of experts" not in stdout


BAD_EP = [
    ("train_configs/qwen3_moe_debug.toml", 6, 3, "does not divide the 8 experts"),  # check_ep_degree
    ("train_configs/llama3_debug.toml", 2, 2, "but model llama3 has none"),  # a dense family
    ("train_configs/qwen3_moe_debug.toml", 4, 8, "borrows its ranks from data_parallel_shard_degree"),  # check_ep
]


@pytest.mark.parametrize("config, world, ep, message", BAD_EP)
def test_a_bad_ep_degree_is_refused_with_the_runs_own_line(config, world, ep, message):
    args = ["--config", config, "--parallelism.expert_parallel_degree", str(ep)]
    with pytest.raises(ConfigError, match=message) as planner:
        plan([*args, "--ngpu", str(world)])
    with pytest.raises(ConfigError) as run:
        plan_run(parse_config(args), world)
    assert str(planner.value) == str(run.value)


def test_the_cli_prints_a_bad_ep_degree_in_one_line():
    proc = titanlite_here(
        "plan",
        "--config",
        "train_configs/qwen3_moe_debug.toml",
        "--ngpu",
        "6",
        "--parallelism.expert_parallel_degree",
        "3",
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "titanlite: error: parallelism.expert_parallel_degree=3 does not divide the 8 experts of each qwen3_moe "
        "block; use a degree that divides 8"
    ]


def test_expert_tensor_parallel_rows_split_the_experts_and_their_flops_and_count_their_all_reduce(
    tmp_path, monkeypatch, capsys
):
    """Beside every TP row of a MoE model an ETP row (its experts split over TP, with EP or without): its experts'
    bytes fall by tp, its compute is no longer the MoE blocks' repeated on each TP rank, and backward's all-reduce
    of the experts' input rows' gradients [tokens x top_k, dim] over TP is counted."""
    stdout, result = planned(tmp_path, monkeypatch, capsys, *MOE_30B, "--ngpu", "8")
    a = FLAVORS["qwen3_moe_30b_a3b"]
    rows = {(r["layout"], r["ac"]): r for r in result["rows"]}
    whole, split = rows[("ZeRO-3 4 x TP 2", "none")], rows[("ZeRO-3 4 x TP 2, ETP 2", "none")]
    assert split["etp"] == 2 and whole["etp"] == 1
    assert split["experts"] == pytest.approx(whole["experts"] / 2)
    assert split["peak"] < whole["peak"] and split["tokens_s"] > whole["tokens_s"]
    rows_routed = split["micro_batch"] * SEQ * a.moe.top_k  # Qwen3-MoE: no shared expert
    volume = 2 * (1 / 2) * rows_routed * a.dim * 2 * a.n_layers * split["microbatches"]
    assert split["comm_bytes"]["tp expert all-reduce"] == pytest.approx(volume)
    assert "tp expert all-reduce" not in whole["comm_bytes"]
    assert any(r["etp"] == 2 and r["ep"] > 1 for r in result["rows"])  # EP x ETP rows too


def test_the_etp_overrides_select_the_layout_and_a_bad_degree_gets_the_runs_own_line():
    lay = Layout(ParallelDims.of(dp_shard=2, tp=2, ep=2, etp=2), "never")
    cfg = parse_config(["--config", "train_configs/qwen3_moe_debug.toml", *lay.overrides()])
    assert layout_of(cfg, 4, plan_model(cfg)) == lay
    assert "--parallelism.expert_tensor_parallel_degree" in Layout(ParallelDims.of(dp_shard=8)).overrides(every=True)
    args = ["--config", "train_configs/qwen3_moe_debug.toml", "--parallelism.tensor_parallel_degree", "2"]
    args += ["--parallelism.expert_tensor_parallel_degree", "4"]
    with pytest.raises(ConfigError) as planner:
        plan([*args, "--ngpu", "2"])
    with pytest.raises(ConfigError) as run:
        plan_run(parse_config(args), 2)
    assert str(planner.value) == str(run.value)
