"""`titanlite plan`: the arithmetic of its breakdown, the layouts it considers, the bubble table."""

import dataclasses
import json

import pytest

from tests.helpers import REPO, titanlite_here
from titanlite.builder.estimate import pipeline_bubbles, stage_layers
from titanlite.builder.layouts import candidate_layouts, layout_of, offload_layouts
from titanlite.builder.model_facts import model_facts
from titanlite.builder.plan import plan_model
from titanlite.config import parse_config

GIB = 2**30


@pytest.fixture
def plan(cli, tmp_path):
    """plan(*args) -> (what `titanlite plan ARGS` printed, its TITANLITE_PLAN_JSON report), run in this process (the
    planner works on the meta device; a process of its own would add seconds of start-up to each call)."""

    def run(*args: str) -> tuple[str, dict]:
        out = tmp_path / "plan.json"
        proc = cli("plan", *args, env={"TITANLITE_PLAN_JSON": str(out)})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout, json.loads(out.read_text())

    return run


def test_gpt2_large_on_two_gpus_matches_the_arithmetic(plan):
    stdout, result = plan("--config", "train_configs/gpt2_large_zero2.toml", "--ngpu", "2", "--gpu-mem-gib", "80")
    n = 774_090_240  # GPT-2 Large with the padded GPT-2 vocabulary, tied embeddings
    assert f"{n:,} parameters" in stdout
    rows = {(r["layout"], r["ac"]): r for r in result["rows"]}
    ddp, zero2, zero3 = rows[("DDP 2", "none")], rows[("ZeRO-2 2", "none")], rows[("ZeRO-3 2", "none")]
    # fp32 weights 3.1 GB, gradients 3.1 GB, AdamW moments 6.2 GB; sharded parts halved on 2 ranks.
    assert ddp["parameters"] == ddp["gradients"] == 4 * n
    assert ddp["optimizer"] == 8 * n
    for zero in (zero2, zero3):
        assert zero["parameters"] == zero["gradients"] == 2 * n
        assert zero["optimizer"] == 4 * n
    # Communication per rank and step (ring, 2 ranks): DDP all-reduces fp32 gradients once; ZeRO-2
    # all-gathers bf16 weights for each of its micro-batches and reduce-scatters fp32 gradients once.
    assert ddp["comm_bytes"] == {"all-reduce": pytest.approx(2 * 0.5 * 4 * n)}
    assert zero2["comm_bytes"] == {
        "all-gather": pytest.approx(zero2["microbatches"] * 0.5 * 2 * n),
        "reduce-scatter": pytest.approx(0.5 * 4 * n),
    }
    assert zero3["comm_bytes"]["all-gather"] == pytest.approx(2 * zero3["microbatches"] * 0.5 * 2 * n)
    assert all(r["fits"] for r in (ddp, zero2, zero3))
    assert result["recommended"]["layout"] in {r["layout"] for r in result["rows"]}
    assert f"recommended: {result['recommended']['layout']}, AC {result['recommended']['ac']}: fits with" in stdout


def test_big_models_on_many_gpus_say_what_fits(plan):
    # Meta device only: runs in seconds on a laptop.
    _, r8 = plan(
        "--config",
        "train_configs/smollm3_3b_zero2.toml",
        "--model.name",
        "llama3",
        "--model.flavor",
        "8B",
        "--ngpu",
        "8",
        "--training.local_batch_size",
        "1",
    )
    fits = {(r["layout"], r["ac"]): r["fits"] for r in r8["rows"]}
    assert not fits[("DDP 8", "none")]  # 8 B parameters x 16 bytes = 128 GB before activations
    assert fits[("ZeRO-3 8", "full")]
    _, r70 = plan(
        "--config",
        "train_configs/smollm3_3b_zero2.toml",
        "--model.name",
        "llama3",
        "--model.flavor",
        "70B",
        "--ngpu",
        "8",
        "--nnodes",
        "8",
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "64",
    )
    fits = {(r["layout"], r["ac"]): r["fits"] for r in r70["rows"]}
    assert not fits[("DDP 64", "none")] and fits[("ZeRO-3 64", "full")]
    assert any(name.startswith("HSDP") for name, _ in fits) and any("PP 8" in name for name, _ in fits)
    # PP beside DDP is refused before launch (check_pipeline_data_parallel): never weighed, never recommended.
    assert not [name for name, _ in fits if name.startswith("DDP") and "PP" in name]
    assert r70["recommended"] is not None


def test_layouts_use_tp_within_and_pp_across_nodes():
    names = {lay.name for lay in candidate_layouts(8, 2)}
    assert {
        "DDP 16",
        "ZeRO-2 16",
        "ZeRO-3 16",
        "HSDP 2x8",
        "ZeRO-3 8 x TP 2",
        "ZeRO-3 2 x TP 8",
        "ZeRO-3 8 x PP 2",
        "TP 8 x PP 2",
    } <= names
    assert all(lay.dims.tp <= 8 and lay.dims.world_size == 16 for lay in candidate_layouts(8, 2))
    assert {lay.name for lay in candidate_layouts(1, 1)} == {"single device"}


@pytest.mark.parametrize("ngpu, nnodes", [(1, 1), (8, 1), (8, 2)])
def test_the_overrides_the_planner_prints_select_its_layout(ngpu, nnodes):
    """`run it with: ...` gives back the layout that was weighed: the degrees' keys come from the mesh's table."""
    for lay in candidate_layouts(ngpu, nnodes, seq_len=32768) + offload_layouts(ngpu, nnodes):
        cfg = parse_config(lay.overrides())
        assert layout_of(cfg, ngpu * nnodes, plan_model(cfg)) == lay, lay.name


def test_bubble_table_and_stage_split():
    # The simulation table's figures: 8 stages, 32 micro-batches -> 17.9 % idle; 2 stages, 8 -> 11.1 %.
    assert pipeline_bubbles(8, [32])[0][3] == pytest.approx(7 / 39)
    assert round(100 * pipeline_bubbles(2, [8])[0][3], 1) == 11.1
    assert pipeline_bubbles(4, [16])[0][2] == pytest.approx(3 / 16)
    assert stage_layers(5, 2, 1) == [[0, 1, 2], [3, 4]]
    assert stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_bad_options_are_one_line(tmp_path):
    proc = titanlite_here("plan", "--ngpu", "two")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "titanlite: error: plan:" in proc.stderr


def test_long_sequences_get_context_parallel_layouts_whose_activations_fall_with_the_degree(plan):
    """At 32,768 tokens the plan offers CP within the node; a rank's activations fall with the CP degree (its
    share of each sequence), less the keys and values it gathers and the mask it keeps; FSDP shards over
    dp_shard x cp."""
    assert not [lay for lay in candidate_layouts(8, 1, seq_len=4096) if lay.dims.cp > 1], "short sequences: no CP"
    names = {lay.name for lay in candidate_layouts(8, 1, seq_len=32768) if lay.dims.cp > 1}
    assert {"CP 8 (ZeRO-2)", "CP 8 (ZeRO-3)", "ZeRO-3 2 x CP 4", "ZeRO-3 2 x CP 2 x TP 2"} <= names
    args = ["--config", "train_configs/llama3_debug.toml", "--model.flavor", "8B", "--ngpu", "8"]
    _, result = plan(*args, "--training.seq_len", "32768", "--training.local_batch_size", "1")
    rows = {(r["layout"], r["ac"]): r for r in result["rows"]}
    zero3, cp2, cp4 = (
        rows[("ZeRO-3 8", "none")],
        rows[("ZeRO-3 4 x CP 2", "none")],
        rows[("ZeRO-3 2 x CP 4", "none")],
    )
    assert zero3["activations"] > cp2["activations"] > cp4["activations"]
    assert zero3["parameters"] == cp2["parameters"] == cp4["parameters"], "FSDP over 8 ranks in each"
    assert (
        "cp all-gather/reduce-scatter" in cp2["comm_bytes"]
        and "cp all-gather/reduce-scatter" not in zero3["comm_bytes"]
    )


CP_REFUSED = [
    (3, ["--parallelism.context_parallel_degree", "3"], "context_parallel_degree=3 does not cut training.seq_len=128"),
    (4, ["--parallelism.context_parallel_degree", "0"], "context_parallel_degree=0 must be at least 1"),
]  # fmt: skip


@pytest.mark.parametrize("world, args, message", CP_REFUSED)
def test_impossible_context_parallel_layouts_are_one_line_before_launch(world, args, message):
    proc = titanlite_here("check", "--world-size", str(world), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


README_8B = ["--config", "train_configs/llama3_debug.toml", "--ngpu", "8", "--nnodes", "8", "--model.flavor", "8B"]


def test_every_layout_runs_the_users_global_batch_and_the_readme_pick_has_a_small_bubble(plan):
    """The README's 8B command on 8 nodes: every row does the config's 512 sequences a step (local batch 8 x its
    64-way data parallelism), and the pick, the most tokens/s, is no deep pipeline idle most of the step."""
    stdout, result = plan(*README_8B, "--training.seq_len", "8192")
    assert {r["global_batch"] for r in result["rows"]} == {512}
    pick = next(
        r for r in result["rows"] if (r["layout"], r["ac"]) == tuple(result["recommended"][k] for k in ("layout", "ac"))
    )
    assert pick["fits"] and pick["bubble"] <= 0.25
    best = max(r["tokens_s"] for r in result["rows"] if r["fits"])
    assert pick["tokens_s"] >= best / 1.05
    assert (
        "global batch: 512 sequences (local batch 8 x data-parallel 64 of the config's layout) = 4,194,304 tokens"
        in stdout
    )
    assert (
        "64 GPUs = 8 nodes x 8 GPUs per node, NVLink within a node" in stdout and "InfiniBand between nodes" in stdout
    )
    # the config's own layout does not fit: one line says by how much and the smallest change that fits
    line = next(x for x in stdout.splitlines() if x.startswith("config (ZeRO-3 64, AC none"))
    assert "does not fit (" in line and line.endswith("fix: --activation_checkpoint.mode full")


def test_the_configs_own_layout_gets_a_verdict(plan):
    stdout, result = plan("--config", "train_configs/smollm3_3b_zero2.toml", "--ngpu", "8")
    assert result["recommended"]["layout"] == "ZeRO-2 8"  # SmolLM3-3B's own layout, not a 1-sequence CP x TP
    assert "config (ZeRO-2 8, AC none, micro-batch 1 x 1 accumulation): is the recommended layout" in stdout
    stdout, _ = plan(*README_8B[:4], "--model.flavor", "1B", "--training.seq_len", "2048", "--ngpu", "8")
    line = next(x for x in stdout.splitlines() if x.startswith("config ("))
    # Llama 3.2 1B on one node: ZeRO-3 fits, as fast as DDP (compute-bound, its traffic hidden), and DDP is simpler
    assert line.startswith("config (ZeRO-3 8, AC none, micro-batch 8 x 1 accumulation): fits")
    assert line.endswith("of the recommended layout (DDP 8, AC none)")


def test_one_node_of_many_gpus_is_said_and_nnodes_suggested(plan):
    stdout, _ = plan("--config", "train_configs/llama3_debug.toml", "--ngpu", "16")
    assert "machine: 1 node of 16 GPUs, NVLink within a node" in stdout
    assert "--ngpu 8 --nnodes 2" in stdout


def test_fsdp_resharding_is_set_only_where_fsdp_is_used():
    from titanlite.builder.layouts import Layout
    from titanlite.parallel.dims import ParallelDims

    assert "--parallelism.fsdp_reshard_after_forward" not in Layout(ParallelDims.of(tp=8, pp=8)).overrides()
    assert "--parallelism.fsdp_reshard_after_forward" not in Layout(ParallelDims.of(dp_replicate=8)).overrides()
    assert "--parallelism.fsdp_reshard_after_forward" in Layout(ParallelDims.of(dp_shard=8), "never").overrides()


def test_interconnect_choices_agree_in_help_check_and_docs():
    from titanlite.base.errors import ConfigError
    from titanlite.tools.plan import USAGE, plan

    listed = USAGE.split("[--interconnect ")[1].split("]")[0].split("|")
    assert listed == ["nvlink", "pcie", "infiniband"]
    described = next(line for line in USAGE.splitlines() if line.lstrip().startswith("--interconnect"))
    assert all(choice in described for choice in listed)
    assert "`--interconnect nvlink|pcie|infiniband`" in (REPO / "docs" / "planning.md").read_text()
    with pytest.raises(ConfigError, match="nvlink, pcie or infiniband"):
        plan(["--interconnect", "ethernet"])


def test_a_family_that_refuses_tensor_parallelism_is_offered_no_tp_layout(plan, monkeypatch, tmp_path):
    # A spec that refuses TP (here olmo2's given decoder_spec.tp_refusal, the refusal a family names while its own
    # plan leaves a whole-projection Q/K norm unsharded): the planner must not recommend, or even weigh, a layout
    # the launch check would refuse, and says why it leaves them out. (Its facts kept in a cache of this test's.)
    from titanlite.models import registry
    from titanlite.models.common.decoder_spec import tp_refusal

    refusing = dataclasses.replace(registry.spec_named("olmo2"), tp_refusal=tp_refusal)
    monkeypatch.setitem(registry._SPECS, "olmo2", refusing)
    args = ["--config", "train_configs/llama3_debug.toml", "--model.name", "olmo2", "--model.flavor", "debug",
            "--data.cache_dir", str(tmp_path / "cache")]  # fmt: skip
    out, data = plan(*args, "--ngpu", "2")
    rows = data["rows"]
    assert rows and not [r["layout"] for r in rows if "TP" in r["layout"]]
    assert "not offered (tensor parallelism cannot split the model qk_norm 'full'" in out and "): TP 2" in out


def test_flex_attention_is_planned_without_the_dense_mask(plan):
    """model.attn_backend flex keeps no [tokens, tokens] mask: at 8,192 block-causal tokens of the debug Llama
    the planner's activations per rank are SDPA's less the mask it counts ([b, T, T] in the GPU rows' bf16 on
    one rank, [b, T / 2, T] on each of CP 2's; b the row's micro-batch), to 1 % (what else differs: the flash
    kernel's saved log-sum-exp, which the blockwise path does not keep). The measured peaks are in
    docs/parallelism.md."""
    base = ["--config", "train_configs/llama3_debug.toml", "--ngpu", "2", "--training.seq_len", "8192",
            "--training.local_batch_size", "2", "--model.attn_mask_type", "block_causal"]  # fmt: skip
    rows = {}
    for backend in ("sdpa", "flex"):
        _, result = plan(*base, "--model.attn_backend", backend)
        rows[backend] = {(r["layout"], r["ac"]): r for r in result["rows"]}
    tokens = 8192
    for layout, local_tokens in (("ZeRO-3 2", tokens), ("CP 2 (ZeRO-3)", tokens // 2)):
        sdpa, flex = rows["sdpa"][(layout, "none")], rows["flex"][(layout, "none")]
        mask = sdpa["micro_batch"] * local_tokens * tokens * 2
        saved = sdpa["activations"] - flex["activations"]
        assert abs(saved - mask) <= 0.01 * mask, (layout, saved, mask)


def test_linear_attention_layers_save_the_same_bytes_per_token_at_any_length():
    """The planner measures what Qwen3.5's Gated DeltaNet layers save for backward (the chunked kernel's [B, H, T/C,
    C, C] tensors, the [B, H, T, Dk or Dv] ones, one [B, H, Dk, Dv] state per chunk): no [T, T] tensor, so the bytes
    per token are the same at 1,024 and 4,096 tokens, as the full-attention layer's (the flash kernel's) are. The
    measured peaks beside these estimates are in BENCHMARKS.md."""
    per_token = {}
    for seq in (1024, 4096):
        cfg = parse_config(["--config", "train_configs/qwen3_5_debug.toml", "--model.tokenizer", "byte",
                            "--model.attn_mask_type", "causal", "--training.seq_len", str(seq)])  # fmt: skip
        facts = model_facts(cfg, plan_model(cfg))
        per_token[seq] = [saved / seq for saved in facts.act_layer]
    kinds = ("linear", "linear", "linear", "full")
    for kind, short, long in zip(kinds, per_token[1024], per_token[4096]):
        assert abs(long / short - 1) < 0.01, (kind, short, long)


def test_pipeline_degrees_16_and_32_are_offered_where_they_divide_the_nodes_and_the_layers():
    def pps(n_layers: int, nnodes: int = 64) -> set[int]:
        return {lay.dims.pp for lay in candidate_layouts(8, nnodes, n_layers=n_layers)}

    assert {2, 4, 8, 16, 32, 64} <= pps(64)
    assert 16 in pps(80) and 32 not in pps(80)  # Llama 3 70B's 80 layers: 5 a stage at PP 16
    assert not {16, 32} & pps(61) and 64 in pps(61)  # DeepSeek-V3's 61: the node count itself, as before
    assert 32 not in pps(64, nnodes=16)  # a degree must divide the node count


def test_deepseek_v3_671b_on_64_nodes_offers_torchtitans_layout_with_the_experts_split(plan):
    """TorchTitan's DeepSeek-V3 671B layout, FSDP x TP 8 with EP 1 and the experts split over TP (ETP 8), fits and
    runs at hundreds of tokens/s per GPU; without the split each TP rank holds and computes every expert whole."""
    stdout, result = plan(
        "--ngpu", "8", "--nnodes", "64", "--model.name", "deepseek_v3", "--model.flavor", "deepseek_v3_671b",
        "--model.tokenizer", "byte", "--training.seq_len", "4096", "--training.local_batch_size", "1",
    )  # fmt: skip
    rows = {(r["layout"], r["ac"]): r for r in result["rows"]}
    titan = rows[("ZeRO-3 64 x TP 8, ETP 8", "full")]
    assert titan["fits"] and titan["ep"] == 1 and titan["etp"] == 8
    per_gpu = titan["tokens_s"] / 512
    assert 100 < per_gpu < 2000, per_gpu  # 37.6 B active parameters: about 1,700 at 40 % MFU with no communication
    whole = rows[("ZeRO-3 64 x TP 8", "full")]
    assert whole["experts"] == pytest.approx(8 * titan["experts"]) and not whole["fits"]
    assert whole["tokens_s"] < titan["tokens_s"] / 3  # the MoE blocks' FLOPs repeated on the 8 TP ranks


def test_top_shows_the_n_best_rows_after_the_configs_own_and_refuses_less_than_one(plan, cli):
    """--top N: the table holds the config's own row, then the N best of the others (the order without it: those that
    fit, fastest first), and the recommended one wherever it ranks; a line says how many were left out. The JSON
    report keeps every row."""
    args = ("--config", "train_configs/llama3_debug.toml", "--ngpu", "4")

    def table(stdout: str) -> list[str]:
        lines = stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
        end = next(i for i, line in enumerate(lines) if line.startswith("communication per step"))
        return lines[start + 1 : end]

    full_out, full = plan(*args)
    top_out, top = plan(*args, "--top", "2")
    every, best = table(full_out), table(top_out)
    assert len(every) == len(full["rows"]) > 4
    assert best[:3] == every[:3] and "(config)" in best[0]
    recommended = full["recommended"]["layout"]
    assert any(line.startswith(recommended + " ") for line in best[:3])
    assert best[3:] == [f"... {len(every) - 3} more layouts (--top 2: the config's own, the 2 best, the recommended)"]
    assert top["rows"] == full["rows"]
    assert top_out.replace("\n".join(best), "\n".join(every)) == full_out  # the rest is printed as before

    proc = cli("plan", *args, "--top", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "titanlite: error: plan: --top must be at least 1, not 0\n"


@pytest.mark.parametrize("tool", ["plan --measure", "bench"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_measured_and_benched_runs_take_the_cores_per_process_as_run_train_sh_does(tool, ranks, monkeypatch, tmp_path):
    """plan --measure's and bench's runs get run_train.sh's OMP_NUM_THREADS: the caller's where set, else the usable
    cores shared among the processes (plan --measure once ran every rank on one thread, 2 x slower on 2 cores)."""
    import os
    import subprocess

    from titanlite.tools import plan as plan_tool
    from titanlite.tools import strategies

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env, **kw: seen.append(env["OMP_NUM_THREADS"]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))

    def start():
        if tool == "bench":
            strategies.launch(ranks, [], tmp_path, "run")
        else:
            plan_tool.run_measured([], ranks, tmp_path, {})

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    start()
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    start()
    assert seen == [str(6 // ranks), "5"]
