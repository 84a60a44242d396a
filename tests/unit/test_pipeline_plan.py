"""The pipeline planner: stage counts, layer splits, placement, micro-batches, and what it refuses."""

import pytest

from tests.helpers import titanlite_here
from titanlite.base.errors import ConfigError
from titanlite.builder.plan import plan_run
from titanlite.components import loss
from titanlite.config import Compile, Training, parse_config
from titanlite.parallel import pipeline
from titanlite.parallel.pipeline import even_split, plan_pipeline


def plan(*args, n_layers=4, samples=8):
    cfg = parse_config(["--parallelism.pipeline_parallel_degree", "2", *args])
    return plan_pipeline(cfg.parallelism, n_layers, samples)


def test_single_stage_schedules_run_one_stage_per_rank():
    p = plan("--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2")
    assert p.layer_ranges == ((0, 2), (2, 4)) and p.n_microbatches == 4
    assert p.stage_ids(0) == (0,) and p.stage_ids(1) == (1,)
    assert p.analytic_bubble() == pytest.approx(1 / 4)


def test_looped_and_v_shaped_placement(monkeypatch):
    monkeypatch.setattr(pipeline, "V_SHAPED_RUN", True)  # placement is the same on every torch
    looped = plan("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    assert looped.num_stages == 4 and looped.stage_ids(0) == (0, 2) and looped.stage_ids(1) == (1, 3)
    assert looped.analytic_bubble() == pytest.approx(1 / (2 * 8))
    v = plan("--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble")
    assert v.stage_ids(0) == (0, 3) and v.stage_ids(1) == (1, 2)  # first and last stage on rank 0
    assert v.analytic_bubble() is None


def test_uneven_split_gives_earlier_stages_the_extra_layer():
    assert even_split(5, 2) == [(0, 3), (3, 5)]
    assert even_split(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert plan(n_layers=5).describe() == "stage 0: layers 0-2 + embeddings; stage 1: layers 3-4 + norm, output"


def test_layers_per_stage_sets_the_stage_count():
    p = plan(
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
        "--parallelism.pipeline_parallel_layers_per_stage",
        "2",
        n_layers=8,
    )
    assert p.layer_ranges == ((0, 2), (2, 4), (4, 6), (6, 8))


@pytest.mark.parametrize(
    "args, n_layers, samples, fragment",
    [
        (
            ["--parallelism.pipeline_parallel_microbatch_size", "3"],
            4,
            8,
            "microbatch_size=3 does not divide the 8 sequences",
        ),
        (["--parallelism.pipeline_parallel_microbatch_size", "8"], 4, 8, "gets 1 micro-batch(es) per step"),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_microbatch_size",
                "8",
            ],
            4,
            24,
            "needs a multiple of 2",
        ),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"], 5, 8, "gives 3 stages for 5 layers"),
        (
            ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
            3,
            8,
            "3 layers cannot fill 4 pipeline stages",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "DualPipeV",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ],
            6,
            8,
            "exactly two stages per rank",
        ),
        (["--parallelism.pipeline_parallel_schedule_csv", "missing.csv"], 4, 8, "does not exist"),
    ],
)
def test_impossible_pipelines_are_refused_with_the_knob(args, n_layers, samples, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        plan(*args, n_layers=n_layers, samples=samples)
    assert fragment in str(e.value)


def test_v_shaped_schedules_are_refused_in_one_line_where_torch_cannot_run_them(monkeypatch):
    """torch 2.11 fails at a V-shaped schedule's first point-to-point exchange between one rank's two stages."""
    monkeypatch.setattr(pipeline, "V_SHAPED_RUN", False)
    for name in pipeline.V_SHAPED:
        with pytest.raises(ConfigError, match=f"pipeline_parallel_schedule={name} needs torch 2.12 or later"):
            plan("--parallelism.pipeline_parallel_schedule", name)


def test_split_backward_schedules_take_the_plain_loss_where_torch_cannot_split_the_chunked_one(monkeypatch):
    """torch 2.11's weight-gradient half of a zero-bubble schedule fails on the chunked loss's autograd.Function:
    auto (-1) resolves to the plain loss there, an explicit chunk size is refused in one line."""
    monkeypatch.setattr(loss, "SPLIT_BACKWARD_TAKES_FUNCTIONS", False)
    assert loss.chunk_tokens(Training(), Compile(), False, "InterleavedZeroBubble") == 0
    assert loss.chunk_tokens(Training(), Compile(), False, "Interleaved1F1B") == loss.DEFAULT_CHUNK_TOKENS
    with pytest.raises(
        ConfigError, match="loss_chunk_tokens=512 with pipeline_parallel_schedule=InterleavedZeroBubble"
    ):
        loss.chunk_tokens(Training(loss_chunk_tokens=512), Compile(), False, "InterleavedZeroBubble")


PP_DDP = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]


def test_pipeline_with_ddp_is_refused_before_launch_naming_fsdp():
    """PP x DDP fails inside torch's schedules (check_pipeline_data_parallel says how): the reported command
    (`NGPU=4 ./run_train.sh` with PP 2 x DDP 2, whose `titanlite check` runs first) stops with status 2 and one
    line saying what to set instead, which is accepted."""
    proc = titanlite_here("check", "--world-size", "4", *PP_DDP)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "titanlite: error: parallelism.pipeline_parallel_degree=2 with DDP (data_parallel_replicate_degree=2, "
        "data_parallel_shard_degree=1) fails inside torch's pipeline schedules, which drive DDP's gradient reducer "
        "wrongly; use FSDP beside PP: data_parallel_shard_degree=2 and data_parallel_replicate_degree=1\n"
    )
    fsdp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    assert plan_run(parse_config(fsdp), world_size=4).dims.fsdp_enabled  # the suggestion
    hsdp = [*PP_DDP[:4], "--parallelism.data_parallel_shard_degree", "2"]
    assert plan_run(parse_config(hsdp), world_size=8).dims.dp_replicate == 2  # replicas that shard: HSDP, accepted
    assert plan_run(parse_config(PP_DDP[2:]), world_size=2).dims.ddp_enabled  # DDP without PP: accepted
