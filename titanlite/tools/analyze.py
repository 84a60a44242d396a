"""`titanlite analyze`: where did the time go, per rank, from torch.profiler Chrome traces.

Each event of a trace is put in one class:
  compute        GPU kernels other than communication; on the CPU, operators on the training thread
                 other than collectives and waits
  communication  NCCL kernels on the GPU; on the CPU, c10d's collective operators (which enqueue the
                 work) and gloo's spans on its worker threads (which run it)
  other          GPU memory copies and sets (not used on the CPU)
On the CPU a thread blocked inside an operator (FSDP waiting for a prefetched all-gather inside an
autograd node) looks busy: the trace cannot tell blocked from working, so that time counts as compute
and overlap is an upper bound there. GPU kernels have no such ambiguity.
Times are unions of intervals (nested or concurrent events are counted once), inside the window:
the span of the device events on the GPU, the ProfilerStep spans on the CPU.

  total          = compute + non-compute + idle
  compute        = time when any compute event runs
  communication  = time when any communication event runs
  overlap        = share of communication time during which compute also runs
  exposed comm   = communication time without compute = communication x (1 - overlap)
  non-compute    = exposed communication + other time with neither compute nor communication
  idle           = total - time when any event runs
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from titanlite.base.errors import ConfigError, check_path_length

USAGE = "usage: titanlite analyze <trace folder or file> [--top N]"

COLLECTIVE_KINDS = [  # (kind, lower-case name fragments), first match wins
    ("reduce-scatter", ("reduce_scatter", "reducescatter")),
    ("all-gather", ("all_gather", "allgather")),
    ("all-reduce", ("all_reduce", "allreduce")),
    ("all-to-all", ("all_to_all", "alltoall")),
    ("broadcast", ("broadcast",)),
    ("send/recv", ("send", "recv")),
    ("barrier", ("barrier",)),
]


@dataclass(frozen=True)
class Event:
    name: str
    start: float  # microseconds
    end: float
    tid: object = 0


def collective_kind(name: str) -> str | None:
    lower = name.lower()
    for kind, fragments in COLLECTIVE_KINDS:
        if any(f in lower for f in fragments):
            return kind
    return None


# ----------------------------------------------------------------------------------------------
# Interval arithmetic


def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((a, b) for a, b in intervals if b > a):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> list[tuple[float, float]]:
    """Intersection of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs, ys) -> list[tuple[float, float]]:
    """xs minus ys (each sorted and disjoint)."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def clip(events: list[Event], window) -> list[tuple[float, float]]:
    return intersect(union((e.start, e.end) for e in events), window)


# ----------------------------------------------------------------------------------------------
# Reading traces


def load_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable Chrome trace ({type(e).__name__}: {e})") from None


def trace_files(target: Path) -> tuple[Path, list[Path]]:
    """(the folder the results go to, the trace files of one profiled window)."""
    if target.is_file():
        return target.parent, [target]
    if not target.is_dir():
        raise ConfigError(f"{target}: no such trace file or folder")
    files = sorted(target.glob("*.json")) + sorted(target.glob("*.json.gz"))
    files = [f for f in files if not f.name.startswith("analysis")]
    if files:
        return target, files
    windows = sorted(target.glob("iteration_*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if windows:
        return trace_files(windows[-1])
    raise ConfigError(
        f"{target}: no *.json traces here or in iteration_*/ subfolders; profile with profiling.enable_profiling"
    )


def rank_of(trace: dict, path: Path, fallback: int) -> int:
    info = trace.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"])
    match = re.search(r"rank(\d+)", path.name)
    return int(match.group(1)) if match else fallback


def classify(trace: dict) -> dict:
    """Split a trace's complete events into the classes above, with the analysis window."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]

    def ev(e) -> Event:
        return Event(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), (e.get("pid"), e.get("tid")))

    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if device:
        kernels = [ev(e) for e in device if e.get("cat") == "kernel"]
        comm = [k for k in kernels if "nccl" in k.name.lower()]
        compute = [k for k in kernels if "nccl" not in k.name.lower()]
        other = [ev(e) for e in device if e.get("cat") != "kernel"]
        everything = kernels + other
        window = [(min(e.start for e in everything), max(e.end for e in everything))]
        return {
            "mode": "gpu",
            "compute": compute,
            "comm": comm,
            "collectives": comm,
            "other": other,
            "window": window,
            "top": compute,
            "not_compute": [],
        }

    steps = [ev(e) for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ConfigError("trace has neither GPU kernels nor ProfilerStep events; was it written by torch.profiler?")
    main_thread = steps[0].tid
    window = union((s.start, s.end) for s in steps)
    # Operators (cpu_op) on the training thread are compute, except collectives and waits, whose time
    # is cut out of the operators they are nested in; record_function spans (user_annotation: FSDP::...,
    # Optimizer.step, ...) only group operators, except gloo's own spans.
    ops = [ev(e) for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep#")]
    gloo = [ev(e) for e in events if e["name"].startswith("gloo:")]
    issued = [e for e in ops if is_cpu_collective(e.name)]
    waits = [e for e in ops if "wait" in e.name.lower()]
    compute = [
        e for e in ops if e.tid == main_thread and not is_cpu_collective(e.name) and "wait" not in e.name.lower()
    ]
    return {
        "mode": "cpu",
        "compute": compute,
        "comm": issued + gloo,
        "collectives": cpu_collectives(issued, gloo),
        "other": [],
        "window": window,
        "top": compute + [e for e in issued + waits if e.tid == main_thread],
        "not_compute": [e for e in issued + waits if e.tid == main_thread],
    }


def is_cpu_collective(name: str) -> bool:
    return name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::")) and collective_kind(name) is not None


def cpu_collectives(issued: list[Event], gloo: list[Event]) -> list[Event]:
    """One event per collective the program issued, named by its c10d operator and timed by gloo's span.

    On the CPU the c10d operator only enqueues the work; gloo runs it on a worker thread (a
    reduce-scatter runs as gloo:all_reduce), in the order issued. A c10d operator nested in another
    (a functional collective calling c10d) is the same collective."""
    outer: list[Event] = []
    for e in sorted(issued, key=lambda e: (e.start, -e.end)):
        if not outer or e.start >= outer[-1].end or e.tid != outer[-1].tid:
            outer.append(e)
    spans = sorted(gloo, key=lambda e: e.start)
    if len(spans) == len(outer):
        return [Event(op.name, span.start, span.end, span.tid) for op, span in zip(outer, spans)]
    paired, j = [], 0
    for op in outer:  # counts differ (a collective cut by the window's edge): the next span not before it
        while j < len(spans) and spans[j].start < op.start:
            j += 1
        if j < len(spans):
            paired.append(Event(op.name, spans[j].start, spans[j].end, spans[j].tid))
            j += 1
        else:
            paired.append(op)
    return paired


def self_times(events: list[Event]) -> dict[str, float]:
    """Per operator name, its time minus that of operators nested in it on the same thread."""
    totals: dict[str, float] = defaultdict(float)
    by_thread = defaultdict(list)
    for e in events:
        by_thread[e.tid].append(e)
    for thread_events in by_thread.values():
        stack: list[list] = []  # [event, child time]
        for e in sorted(thread_events, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1][0].end <= e.start:
                done, child = stack.pop()
                totals[done.name] += (done.end - done.start) - child
            if stack:
                stack[-1][1] += e.end - e.start
            stack.append([e, 0.0])
        for done, child in stack:
            totals[done.name] += (done.end - done.start) - child
    return totals


# ----------------------------------------------------------------------------------------------
# Figures


def analyze_trace(trace: dict, top: int = 10) -> dict:
    c = classify(trace)
    window = c["window"]
    compute = subtract(clip(c["compute"], window), union((e.start, e.end) for e in c["not_compute"]))
    comm, other = clip(c["comm"], window), clip(c["other"], window)
    total = length(window)
    busy = union(compute + comm + other)
    overlap = length(intersect(compute, comm))
    comm_time = length(comm)
    exposed = comm_time - overlap
    other_exposed = length(other) - length(intersect(other, union(compute + comm)))
    compute_time = length(compute)
    idle = total - length(busy)
    non_compute = exposed + other_exposed
    ms = 1e-3
    collectives: defaultdict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "total_ms": 0.0})
    for e in c["collectives"]:
        kind = collective_kind(e.name)
        if not any(a <= e.start < b for a, b in window):
            continue
        if kind is None:
            continue
        collectives[kind]["count"] += 1
        collectives[kind]["total_ms"] += (e.end - e.start) * ms
    for fig in collectives.values():
        fig["mean_ms"] = fig["total_ms"] / fig["count"]
    inside = [e for e in c["top"] if any(a <= e.start < b for a, b in window)]
    durations = self_times(inside) if c["mode"] == "cpu" else kernel_times(inside)
    skip = {e.name for e in c["not_compute"]}  # self times include them so that their parents' exclude them
    durations = {name: t for name, t in durations.items() if name not in skip}
    ranked = sorted(durations.items(), key=lambda kv: -kv[1])[:top]
    classes = kernel_classes(durations, total) if c["mode"] != "cpu" else {}
    return {
        "mode": c["mode"],
        "total_ms": total * ms,
        "compute_ms": compute_time * ms,
        "non_compute_ms": non_compute * ms,
        "idle_ms": idle * ms,
        "communication_ms": comm_time * ms,
        "other_non_compute_ms": other_exposed * ms,
        "compute_pct": pct(compute_time, total),
        "non_compute_pct": pct(non_compute, total),
        "idle_pct": pct(idle, total),
        "communication_pct": pct(comm_time, total),
        "overlap_pct": pct(overlap, comm_time),
        "exposed_communication_ms": exposed * ms,
        "collectives": dict(sorted(collectives.items())),
        "top_operators": [{"name": name, "ms": t * ms, "pct_of_total": pct(t, total)} for name, t in ranked],
        "kernel_classes": classes,
    }


# GPU kernel classes, first match wins (lower-case name fragments). Attention comes before matmul: flash and
# cuDNN attention kernels hold "gemm"-like fragments in some releases.
KERNEL_CLASSES = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    # cuBLAS/CUTLASS kernels, and inductor's Triton matmul templates (max-autotune) before other Triton kernels
    (
        "matmul",
        (
            "gemm",
            "nvjet",
            "cutlass",
            "xmma",
            "cublas",
            "sm90_",
            "sm80_",
            "matmul",
            "triton_tem_fused_mm",
            "triton_tem_fused_addmm",
            "triton_tem_fused_bmm",
        ),
    ),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("compiled (inductor/Triton)", ("triton_",)),
]


def kernel_class(name: str) -> str:
    lower = name.lower()
    for label, fragments in KERNEL_CLASSES:
        if any(f in lower for f in fragments):
            return label
    return "other kernels"


def kernel_classes(durations: dict[str, float], total: float) -> dict[str, dict]:
    """Summed kernel time per class (ms, % of all kernel time, % of the window). Summed, not unioned:
    kernels on concurrent streams count in full, so the shares are of kernel time, not of the window."""
    sums: dict[str, float] = defaultdict(float)
    for name, t in durations.items():
        sums[kernel_class(name)] += t
    kernel_total = sum(sums.values())
    return {
        label: {"ms": t * 1e-3, "pct_of_kernels": pct(t, kernel_total), "pct_of_total": pct(t, total)}
        for label, t in sorted(sums.items(), key=lambda kv: -kv[1])
    }


def kernel_times(events: list[Event]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        totals[e.name] += e.end - e.start
    return totals


def pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


AVERAGED = [
    "total_ms",
    "compute_ms",
    "non_compute_ms",
    "idle_ms",
    "communication_ms",
    "other_non_compute_ms",
    "compute_pct",
    "non_compute_pct",
    "idle_pct",
    "communication_pct",
    "overlap_pct",
    "exposed_communication_ms",
]


def recorded_steps(trace: dict) -> bool:
    """Whether a trace holds what analyze_trace reads: GPU kernels, or the CPU's ProfilerStep spans."""
    return any(
        e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or str(e.get("name", "")).startswith("ProfilerStep#")
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
    )


def average(per_rank: dict[int, dict]) -> dict:
    n = len(per_rank)
    out = {key: sum(r[key] for r in per_rank.values()) / n for key in AVERAGED}
    kinds = sorted({k for r in per_rank.values() for k in r["collectives"]})
    out["collectives"] = {}
    for kind in kinds:
        counts = [r["collectives"].get(kind, {"count": 0, "total_ms": 0.0}) for r in per_rank.values()]
        count = sum(c["count"] for c in counts) / n
        total = sum(c["total_ms"] for c in counts) / n
        out["collectives"][kind] = {"count": count, "total_ms": total, "mean_ms": total / count if count else 0.0}
    return out


def analyze(target: Path, top: int = 10) -> tuple[Path, dict]:
    """Analyse every rank's trace of a window. A rank whose profiler recorded nothing of its training
    thread (its file holds only metadata, or a stray event of a collective's thread but no ProfilerStep:
    seen now and then on CPU ranks oversubscribing their cores) is left out and named under "empty"; a
    window with no usable trace is an error."""
    folder, files = trace_files(target)
    per_rank, empty = {}, []
    for i, path in enumerate(files):
        trace = load_trace(path)
        if not recorded_steps(trace):
            empty.append(path.name)
            continue
        per_rank[rank_of(trace, path, i)] = analyze_trace(trace, top) | {"file": path.name}
    if not per_rank:
        raise ConfigError(
            f"{folder}: the profiler recorded no training step in any trace ({', '.join(empty)}); profile again"
        )
    result = {
        "folder": str(folder),
        "ranks": dict(sorted(per_rank.items())),
        "average": average(per_rank),
        "empty": empty,
    }
    return folder, result


# ----------------------------------------------------------------------------------------------
# Output


def to_markdown(result: dict) -> str:
    ranks, avg = result["ranks"], result["average"]
    cols = [*(f"rank {r}" for r in ranks), "average"]
    rows = [
        ("total (ms)", "total_ms", ".1f"),
        ("compute %", "compute_pct", ".1f"),
        ("non-compute %", "non_compute_pct", ".1f"),
        ("idle %", "idle_pct", ".1f"),
        ("communication (ms)", "communication_ms", ".1f"),
        ("overlap %", "overlap_pct", ".1f"),
        ("exposed communication (ms)", "exposed_communication_ms", ".1f"),
    ]
    lines = [f"# Trace analysis: {result['folder']}", ""]
    if result.get("empty"):
        lines += [f"Left out, the profiler recorded no training step: {', '.join(result['empty'])}.", ""]
    lines += ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, key, fmt in rows:
        values = [format(r[key], fmt) for r in ranks.values()] + [format(avg[key], fmt)]
        lines.append(f"| {label} | " + " | ".join(values) + " |")
    lines += [
        "",
        "## Collectives (average over ranks)",
        "",
        "| kind | count | total (ms) | mean (ms) |",
        "|---|---:|---:|---:|",
    ]
    for kind, fig in avg["collectives"].items():
        lines.append(f"| {kind} | {fig['count']:g} | {fig['total_ms']:.2f} | {fig['mean_ms']:.3f} |")
    first = next(iter(ranks))
    lines += [
        "",
        f"## Top operators (rank {first}, self time)",
        "",
        "| operator | ms | % of total |",
        "|---|---:|---:|",
    ]
    for op in ranks[first]["top_operators"]:
        lines.append(f"| `{op['name'][:80]}` | {op['ms']:.2f} | {op['pct_of_total']:.1f} |")
    classes = ranks[first].get("kernel_classes")
    if classes:
        lines += [
            "",
            f"## GPU kernel time by class (rank {first}; summed kernel durations)",
            "",
            "| class | ms | % of kernel time | % of total |",
            "|---|---:|---:|---:|",
        ]
        for label, fig in classes.items():
            lines.append(f"| {label} | {fig['ms']:.2f} | {fig['pct_of_kernels']:.1f} | {fig['pct_of_total']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""))
        return 0 if argv else 2
    top, rest, it = 10, [], iter(argv)
    for arg in it:
        if arg == "--top":
            value = next(it, "")
            if not value.isdigit():
                raise ConfigError(f"analyze --top takes a whole number, not '{value}'")
            top = int(value)
        else:
            rest.append(arg)
    if len(rest) != 1:
        raise ConfigError(f"analyze takes one trace folder or file; got {len(rest)}. {USAGE}")
    check_path_length(rest[0], "analyze")
    folder, result = analyze(Path(rest[0]), top)
    markdown = write_results(folder, result)
    print(markdown + f"\nwritten: {folder / 'analysis.json'} and {folder / 'analysis.md'}")
    return 0


def write_results(folder: Path, result: dict) -> str:
    """analysis.json and analysis.md beside the traces; returns the Markdown."""
    markdown = to_markdown(result)
    (folder / "analysis.json").write_text(json.dumps(result, indent=2) + "\n")
    (folder / "analysis.md").write_text(markdown)
    return markdown
