"""`titanlite plan`: will it fit, and which layout should I use?

Prints, for every candidate layout of the machine, the per-rank memory and per-step communication that the
planner's estimator (titanlite/builder/estimate.py, which documents every figure) gives for the config, which
layouts fit, and the one to use; `--measure` runs the config's own layout for 3 steps and prints the measured
tensor peak per rank beside the estimate.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from titanlite.base.command_line import TRAIN_WORKER, local_launch, take_options, with_overrides
from titanlite.base.devices import check_local_ranks, uses_cuda
from titanlite.base.errors import ConfigError
from titanlite.base.failures import reason_in
from titanlite.builder.estimate import (
    ASSUMED_MFU,
    BANDWIDTH,
    GIB,
    Machine,
    Setting,
    batch_overrides,
    estimate,
    excluded_layouts,
    layout_rows,
    loss_path,
    pipeline_bubbles,
    recommend,
    rows_json,
    setting_for,
    verdict,
)
from titanlite.builder.layouts import Layout, layout_of
from titanlite.builder.model_facts import ModelFacts, model_facts
from titanlite.builder.plan import plan_model
from titanlite.config import parse_config

USAGE = """usage: titanlite plan [--config FILE] [--ngpu N] [--nnodes M] [--gpu-mem-gib G] [--gpu-tflops T]
                      [--interconnect nvlink|pcie|infiniband] [--headroom F] [--device cuda|cpu] [--top N]
                      [--measure] [--section.key VALUE ...]
  --ngpu N          GPUs (processes) per node (default 8, or $NGPU)
  --nnodes M        nodes (default 1); between nodes the link is InfiniBand
  --gpu-mem-gib G   memory of one device (default 80)
  --interconnect    the link between the GPUs of a node: nvlink (default), pcie, or infiniband (one GPU per
                    node's worth of bandwidth, as if every GPU sat in its own node)
  --headroom F      share of memory kept free for the allocator and CUDA context (default 0.1)
  --gpu-tflops T    peak bf16 TFLOP/s of one device, for the step-time column (default 989, H100 SXM)
  --device          what the estimate is for: cuda (bf16 activations under mixed precision; default) or
                    cpu (float32, as titanlite runs there); --measure on a CPU machine implies cpu
  --top N           the table's N best layouts (those that fit, fastest first) after the config's own, and
                    the recommended one (default: every layout)
  --measure         run 3 real steps of the config's own layout (torchrun, N x M processes) and print
                    the estimate beside the measured tensor peak per rank (PyTorch's MemTracker, or
                    FSDPMemTracker under FSDP)"""


def plan(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        return 0
    defaults = {
        "ngpu": int(os.environ.get("NGPU", 8)),
        "nnodes": 1,
        "gpu-mem-gib": 80.0,
        "interconnect": "nvlink",
        "headroom": 0.1,
        "device": "",
        "gpu-tflops": 989.0,
        "top": 0,  # 0: every layout (the least that can be given is 1)
        "measure": False,
    }
    opts, rest = take_options(argv, defaults, "plan:", at_least={"top": 1})
    ngpu, nnodes, measure = opts["ngpu"], opts["nnodes"], opts["measure"]
    mem, headroom, tflops = opts["gpu-mem-gib"], opts["headroom"], opts["gpu-tflops"]
    if ngpu < 1 or nnodes < 1 or mem <= 0 or not 0 <= headroom < 1 or tflops <= 0:
        raise ConfigError(
            "plan: --ngpu and --nnodes must be >= 1, --gpu-mem-gib and --gpu-tflops > 0, 0 <= --headroom < 1"
        )
    if opts["interconnect"] not in ("nvlink", "pcie", "infiniband"):
        raise ConfigError(f"plan: --interconnect takes nvlink, pcie or infiniband, not '{opts['interconnect']}'")
    device = opts["device"] or ("cpu" if measure and not uses_cuda() else "cuda")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"plan: --device takes cuda or cpu, not '{device}'")
    cfg = parse_config(rest)
    machine = Machine(ngpu, nnodes, device, opts["interconnect"], tflops)
    world = machine.world
    model = plan_model(cfg)
    own = layout_of(cfg, world, model)  # refuses a layout the run would refuse, before the model is measured
    facts = model_facts(cfg, model)
    budget = mem * (1 - headroom) * GIB
    rows = layout_rows(cfg, facts, own, machine, lambda est: est["peak"] <= budget)
    print_plan(cfg, facts, rows, machine, mem, headroom, opts["top"])
    pick, _ = recommend(rows)
    print(verdict(cfg, rows, pick, budget))
    excluded = excluded_layouts(cfg, facts, own, machine)
    for why, names in excluded.items():
        print(f"not offered ({why}): {', '.join(names)}")
    target = os.environ.get("TITANLITE_PLAN_JSON")
    if target and not measure:
        Path(target).write_text(json.dumps(rows_json(rows), indent=1))
    if measure:
        check_local_ranks(world)  # the measured run's ranks all run on this machine
        return measure_layout(cfg, rest, own, facts, setting_for(cfg, own, world, device), world)
    return 0


LINKS = {"nvlink": "NVLink", "pcie": "PCIe", "infiniband": "InfiniBand"}


def machine_line(machine: Machine, mem: float, headroom: float) -> str:
    """The machine in words: nodes x GPUs per node, the links within and between nodes, each GPU's memory."""
    ngpu, nnodes = machine.ngpu, machine.nnodes
    unit = "GPU" if machine.device == "cuda" else "process"
    within = f"{LINKS[machine.interconnect]} within a node ({BANDWIDTH[machine.interconnect]:g} GB/s per GPU)"
    if nnodes > 1:
        links = f"{within}, InfiniBand between nodes ({BANDWIDTH['infiniband']:g} GB/s per GPU)"
        where = f"{machine.world} {unit}s = {nnodes} nodes x {ngpu} {unit}s per node"
    else:
        links = within
        where = f"1 node of {ngpu} {unit}" + "s" * (ngpu > 1)
    line = f"{where}, {links}; {mem:g} GiB each ({headroom:.0%} kept free)"
    if nnodes == 1 and ngpu > 8:
        line += f" (all {ngpu} on one node's {LINKS[machine.interconnect]}: for nodes of 8 GPUs, --ngpu 8 --nnodes "
        line += f"{ngpu // 8})" if ngpu % 8 == 0 else "N)"
    return line


def active_part(facts: ModelFacts) -> str:
    """ ", N active per token (x B)" for a mixture of experts (the parameters one token uses); "" if dense."""
    if not 0 < facts.active_params < facts.params:
        return ""
    return f", {facts.active_params:,} active per token ({facts.active_params / 1e9:.2f} B)"


def print_plan(
    cfg, facts: ModelFacts, rows: list[dict], machine: Machine, mem: float, headroom: float, top: int = 0
) -> None:
    """The plan's header, its table (with `top`, only the config's own row, the `top` best others and the recommended
    one), the communication, the recommendation and the pipeline bubbles."""
    device, tflops = machine.device, machine.tflops
    dtype = (
        "bf16 activations (mixed precision)"
        if device == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
        else "float32"
    )
    offload = any(r["layout"].offload for r in rows)
    own = next(r for r in rows if r["own"])
    losses = {loss_path(r["setting"]) for r in rows if r is not own} - {loss_path(own["setting"])}
    loss = loss_path(own["setting"]) + (f" (layouts with TP: {', '.join(sorted(losses))})" if losses else "")
    print(
        f"titanlite plan: {cfg.model.name} {cfg.model.flavor}, {facts.params:,} parameters ({facts.params / 1e9:.2f} "
        f"B){active_part(facts)}, seq {cfg.training.seq_len}; {device}, fp32 weights and AdamW, {dtype}; {loss}"
        + ("; CPU offload keeps the FSDP shards, gradients and AdamW state in host memory (host)" if offload else "")
    )
    print("machine: " + machine_line(machine, mem, headroom))
    batch = own["setting"].global_batch
    t = cfg.training
    source = (
        "training.global_batch_size"
        if t.global_batch_size > 0
        else f"local batch {t.local_batch_size} x data-parallel {own['layout'].dims.dp} of the config's layout"
    )
    print(
        f"global batch: {batch} sequences ({source}) = {batch * t.seq_len:,} tokens per step, the same in every row; "
        "each row runs it at the micro-batch that fits fastest"
    )
    print(
        "per rank, GiB (the rank with the largest peak); batch: micro-batch x accumulation (PP: micro-batch / pipeline "
        f"micro-batches); comm: GB per step per rank and its time at the assumed bandwidth; step: compute (AC's "
        f"recomputation included) at {ASSUMED_MFU:.0%} MFU of {tflops:g} TFLOP/s x (1 + bubble), or data parallelism's "
        "collectives where longer (they overlap with compute), + TP's, CP's, EP's and PP's communication (they do not)"
    )
    moe = bool(facts.n_experts)
    if moe:
        print(
            f"mixture of experts: {facts.n_experts} experts per MoE block, {facts.top_k} per token; ep: the expert-"
            "parallel degree (ranks of dp_shard x cp); experts: their parameters, gradients and optimizer state (of "
            "params, grads, optim); a2a: expert parallelism's all-to-all buffers for the MoE layer running; ETP in a "
            "layout's name: its experts split over its TP ranks"
        )
    width = max([26] + [len(r["layout"].name + (" (config)" if r["own"] else "")) for r in rows])
    host_head = f" {'host':>7}" if offload else ""
    moe_head = f" {'ep':>3} {'experts':>7} {'a2a':>7}" if moe else ""
    print(
        f"{'layout':<{width}} {'AC':<15} {'batch':>7}{moe_head} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} "
        f"{'temp':>7} {'peak':>7}{host_head} {'fits':>4} {'comm GB':>8} {'comm ms':>8} {'bubble':>6} {'step ms':>8} "
        f"{'tok/s/GPU':>9} {'tok/s':>10}"
    )
    ordered = [own] + sorted((r for r in rows if r is not own), key=lambda r: (not r["fits"], -r["tokens_s"]))
    pick, why = recommend(rows)
    shown = [r for i, r in enumerate(ordered) if not top or i <= top or r is pick]
    for r in shown:
        e, lay, s = r["est"], r["layout"], r["setting"]
        name = lay.name + (" (config)" if r["own"] else "")
        host = f" {e['host'] / GIB:>7.2f}" if offload else ""
        shape = f"{s.micro_batch}/{s.microbatches}" if lay.dims.pp > 1 else f"{s.micro_batch}x{s.microbatches}"
        experts = f" {lay.dims.ep:>3} {e['experts'] / GIB:>7.2f} {e['dispatch'] / GIB:>7.2f}" if moe else ""
        print(
            f"{name:<{width}} {lay.ac:<15} {shape:>7}{experts} {e['parameters'] / GIB:>7.2f} "
            f"{e['gradients'] / GIB:>7.2f} {e['optimizer'] / GIB:>7.2f} "
            f"{e['activations'] / GIB:>7.2f} {e['temporary'] / GIB:>7.2f} {e['peak'] / GIB:>7.2f}{host} "
            f"{'yes' if r['fits'] else 'no':>4} "
            f"{sum(e['comm'].values()) / 1e9:>8.2f} {1e3 * r['comm_s']:>8.1f} {r['bubble']:>6.0%} "
            f"{1e3 * r['step_s']:>8.0f} {r['tokens_s'] / lay.dims.world_size:>9,.0f} {r['tokens_s']:>10,.0f}"
        )
    left = len(ordered) - len(shown)
    if left:
        print(f"... {left} more layouts (--top {top}: the config's own, the {top} best, the recommended)")
    for label, row in (("config", own), ("recommended", pick)):
        if row is not None:
            parts = ", ".join(f"{kind} {volume / 1e9:.2f} GB" for kind, volume in row["est"]["comm"].items()) or "none"
            print(f"communication per step per rank, {label} ({row['layout'].name}): {parts}")
    print(f"recommended: {pick['layout'].name}, AC {pick['layout'].ac}: {why}" if pick else f"recommended: none; {why}")
    if pick:
        print("  run it with: " + " ".join(pick["layout"].overrides() + batch_overrides(cfg, pick)))
    pps = sorted({r["layout"].dims.pp for r in rows if r["layout"].dims.pp > 1})
    for p in pps:
        print(f"pipeline bubble, {p} stages (GPipe/1F1B; looped schedules with v stages per rank divide it by v):")
        print(f"  {'micro-batches':>13} {'idle/compute (p-1)/m':>21} {'idle share (p-1)/(m+p-1)':>25}")
        for _, m, rel, share in pipeline_bubbles(p, [p, 2 * p, 4 * p, 8 * p]):
            print(f"  {m:>13} {rel:>21.1%} {share:>25.1%}")


def measure_layout(cfg, argv: list[str], lay: Layout, facts: ModelFacts, s: Setting, world: int) -> int:
    est = estimate(facts, lay, s)
    folder = tempfile.mkdtemp(prefix="titanlite-plan-")  # kept when the run fails: its logs explain why
    out = Path(folder) / "memory"
    train_argv = with_overrides(
        argv,
        [
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "3",
            "--checkpoint.enable",
            "false",
            "--profiling.enable_profiling",
            "false",
            "--job.dump_folder",
            folder,
            "--job.name",
            "measure",
        ],
    )
    print(f"measure: 3 steps of {lay.name} on {world} process(es) ...", flush=True)
    proc = run_measured(train_argv, world, Path(folder), {"TITANLITE_MEASURE_MEMORY": str(out)})
    if proc.returncode != 0:  # the worker's own line (the launcher's last), and its exit status
        reason = reason_in(proc.stderr).removeprefix("titanlite: error: ")
        print(
            f"titanlite: error: plan --measure: the measured run failed: {reason} (its output: {folder})",
            file=sys.stderr,
            flush=True,
        )
        (Path(folder) / "output.txt").write_text(proc.stdout + proc.stderr)
        return proc.returncode
    measured = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    shutil.rmtree(folder, ignore_errors=True)
    peak = max(m["Total"] for m in measured.values())
    comp = ["parameters", "gradients", "optimizer", "activations", "temporary"] + ["dispatch"] * (lay.dims.ep > 1)
    print(f"estimate vs measured, {lay.name}, AC {lay.ac}, {loss_path(s)}, the rank with the largest peak (MiB):")
    print("  estimate: " + ", ".join(f"{k} {est[k] / 2**20:.1f}" for k in comp))
    top = max(measured.values(), key=lambda m: m["Total"])
    if top["tracker"] == "MemTracker":  # it also attributes the peak, by its own categories
        print(
            "  measured, by the tracker's categories: "
            + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in top.items() if k not in ("Total", "tracker") and v)
        )
    print(
        f"  peak: estimated {est['peak'] / 2**20:.1f}, measured {peak / 2**20:.1f} "
        f"({100 * (est['peak'] / peak - 1):+.1f} %; "
        + next(iter(measured.values()))["tracker"]
        + ", ranks: "
        + ", ".join(f"{r}: {m['Total'] / 2**20:.1f}" for r, m in sorted(measured.items()))
        + ")"
    )
    result = {
        "layout": lay.name,
        "ac": lay.ac,
        "loss_chunk_tokens": s.loss_chunk,
        "estimate_peak": est["peak"],
        "measured_peak": peak,
        "measured_by_rank": measured,
        "estimate": {k: est[k] for k in comp},
    }
    target = os.environ.get("TITANLITE_PLAN_JSON")
    if target:
        Path(target).write_text(json.dumps(result))
    return 0


def run_measured(train_argv: list[str], world: int, folder: Path, extra_env: dict[str, str]):
    """The measured run: the training worker on `world` local processes through titanlite's launcher, its
    logs in `folder`; returns the finished process (returncode, stdout, stderr)."""
    cmd, env = local_launch(world, TRAIN_WORKER, train_argv, log_dir=folder / "logs")
    return subprocess.run(cmd, env={**env, **extra_env}, capture_output=True, text=True)
