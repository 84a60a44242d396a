"""Activation checkpointing changes no number (bitwise) and torch.compile almost none (1e-4), on every layout."""

import pytest

from tests.helpers import TINY, assert_close, metrics, train_in_pool

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "single": (1, ["--training.local_batch_size", "8"]),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "tp2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (
        2,
        [
            "--training.local_batch_size",
            "8",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ),
}


# The compiled FSDP x 2 and PP x 2 runs give each block inputs of one process's shape (8 sequences of 32 tokens: FSDP's
# local batch, PP's micro-batch), so their graphs are the ones test_compile_matches_eager[single--1] compiled, found in
# inductor's cache: on a fresh machine (CI's) each rank compiled its own shapes from scratch, FSDP x 2 as long as the
# single process (65 s in CI). What they prove is unchanged: the compiled blocks under FSDP's hooks and in pipeline
# stages give eager's losses.
SAME_SHAPES = {
    "fsdp2_same_shapes": (2, ["--training.local_batch_size", "8"]),
    "pp2_same_shapes": (
        2,
        [
            "--training.local_batch_size",
            "16",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "8",
        ],
    ),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Each layout's run without AC or compile, made once."""
    cache = {}

    def run(layout):
        if layout not in cache:
            nproc, args = {**LAYOUTS, **SAME_SHAPES}[layout]
            run_dir = tmp_path_factory.mktemp(f"plain_{layout}")
            proc = train_in_pool(nproc, [*TINY, *args], run_dir)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[layout] = metrics(run_dir)
        return cache[layout]

    return run


# Full and selective_op AC on one process and full AC on FSDP x 2 in the default suite; the rest (TP x 2's
# and PP x 2's full AC among them: they re-run the same block wrapper under a TP plan or in a stage) slow.
AC_CASES = [
    (layout, mode)
    if mode == "full" and layout in ("single", "fsdp2")  # the rest are slow (CI runs them)
    else pytest.param(layout, mode, marks=pytest.mark.slow)
    for layout in LAYOUTS
    for mode in ("full", "selective_layer", "selective_op")
]


@pytest.mark.parametrize("layout, mode", AC_CASES)
def test_activation_checkpointing_is_bitwise_identical(tmp_path, plain, layout, mode):
    nproc, args = LAYOUTS[layout]
    ac = ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", "2"]
    proc = train_in_pool(nproc, [*TINY, *args, *ac], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records, expected = metrics(tmp_path), plain(layout)
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in expected]


@pytest.mark.parametrize(
    "layout, chunks",
    [
        ("single", "-1"),
        pytest.param("single", "48", marks=pytest.mark.slow),  # the chunked loss with its compiled chunk kernel
        pytest.param("fsdp2_same_shapes", "-1", marks=pytest.mark.slow),
        pytest.param("tp2", "-1", marks=pytest.mark.slow),
        pytest.param("pp2_same_shapes", "-1", marks=pytest.mark.slow),
    ],
)
def test_compile_matches_eager(tmp_path, plain, layout, chunks):
    # inductor on CPU; the first compile takes ~20-30 s, later ones reuse TORCHINDUCTOR_CACHE_DIR.
    # With full AC too, except under TP, where torch 2.13 cannot compile checkpointed DTensor blocks.
    # The eager reference uses the chunked loss (auto, compile off); compiled, auto picks the fused plain
    # loss except under TP (loss parallelism), where the loss is chunked.
    nproc, args = {**LAYOUTS, **SAME_SHAPES}[layout]
    ac = [] if layout == "tp2" else ["--activation_checkpoint.mode", "full"]
    proc = train_in_pool(
        nproc, [*TINY, *args, "--compile.enable", *ac, "--training.loss_chunk_tokens", chunks], tmp_path, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    chunked = "loss: cross-entropy in chunks of" in proc.stdout
    assert chunked == (layout == "tp2" or chunks != "-1"), proc.stdout[-2000:]
    assert_close([r["loss"] for r in metrics(tmp_path)], [r["loss"] for r in plain(layout)], 1e-4)


@pytest.mark.slow  # three runs of the hybrid debug model (a compile among them: about 40 s); CI runs it
def test_a_hybrid_model_under_activation_checkpointing_is_bitwise_and_compiled_tracks_eager(tmp_path):
    # Qwen3.5's debug model (Gated DeltaNet layers beside full attention, block-causal documents): full AC recomputes
    # the linear layers' chunked rule and convolution and gives the same numbers bit for bit; compiled (with full AC)
    # its losses follow eager's to 1e-4.
    hybrid = ["--config", "train_configs/qwen3_5_debug.toml", *TINY, "--training.local_batch_size", "8"]
    runs = {}
    for name, extra in {
        "plain": [],
        "ac": ["--activation_checkpoint.mode", "full"],
        "compiled": ["--compile.enable", "--activation_checkpoint.mode", "full"],
    }.items():
        proc = train_in_pool(1, [*hybrid, *extra], tmp_path / name, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[name] = metrics(tmp_path / name)
    assert [(r["loss"], r["grad_norm"]) for r in runs["ac"]] == [(r["loss"], r["grad_norm"]) for r in runs["plain"]]
    assert_close([r["loss"] for r in runs["compiled"]], [r["loss"] for r in runs["plain"]], 1e-4)
