#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, on one GPU of an offline machine (docs/testing.md, "Tests on a GPU box", says how to set one up):
#   scripts/gpu_figures.sh throughput   bench throughput, GPT-2 124M and 774M, chunked and plain loss
#   scripts/gpu_figures.sh runs         ./run_train.sh figures: gpt2_large_zero2 at NGPU=1, the 3B at seq 8192
#   scripts/gpu_figures.sh loss         bench throughput of the chunked and the plain loss
#   scripts/gpu_figures.sh runs-short   gpt2_large_zero2 and the 3B with selective AC only
#   scripts/gpu_figures.sh tests        the gpu-marked tests (./run_tests.sh -m gpu)
#   scripts/gpu_figures.sh traces       a profiled, analysed window of gpt2_large_zero2 and of SmolLM3-3B at seq 8192
#   scripts/gpu_figures.sh levers       each speed lever on and off in one sitting (compile mode, AdamW kernel,
#                                       micro-batch against accumulation, float8 recipe); levers-small: the
#                                       GPT-2 124M ones only, levers-large: the 774M and 3B ones only
#   scripts/gpu_figures.sh generate     titanlite generate against transformers' generate (scripts/bench_generate.py)
#   scripts/gpu_figures.sh loss-kernels the loss alone: plain, chunked and a fused linear + cross-entropy (scripts/bench_loss.py)
#   scripts/gpu_figures.sh float8-layers the 3B at seq 8192, full AC: bf16, then float8 with more linears left in bf16
#   scripts/gpu_figures.sh autotune     GPT-2 124M (batch 64) and the 774M (16 x 2): compile mode default against
#                                       max-autotune-no-cudagraphs
#   scripts/gpu_figures.sh flex         SmolLM3-3B at 8,192 tokens (full AC, compiled), causal and block-causal:
#                                       SDPA (flash/cuDNN, or its dense mask) against FlexAttention's compiled kernel
#   scripts/gpu_figures.sh suite        the correctness runs: ./run_tests.sh -m gpu beside the CPU suite
#                                       (./run_tests.sh -n 12) on this machine's torch
#   scripts/gpu_figures.sh correct      one lease (SITTING_SECONDS, default 560): every gpu test, then SmolLM3-3B
#                                       at 8,192 tokens on SDPA and on flex, block-causal and causal, then whether
#                                       TorchTitan's wheels (.whl/titan) run on this torch (scripts/torchtitan_probe.py)
#   scripts/gpu_figures.sh sitting      one lease (SITTING_SECONDS, default 540): the gpu tests beside the CPU
#                                       suite, the MoE block, the loss kernels, a 4-layer Qwen3-30B-A3B (grouped
#                                       experts against the loop), then generate and GPT-2 124M at batch 64, each
#                                       only while its time is left
# Each writes its outputs under $OUT (default /tmp/gpu_figures) and prints a summary last.
set -u
cd "$(dirname "$0")/.."
# The .venv scripts/gpu_box_env.sh made (the machine's torch and the wheels carried), else the machine's python3.
[ -n "${TITANLITE_PYTHON:-}" ] || { [ -x .venv/bin/python ] && TITANLITE_PYTHON=$PWD/.venv/bin/python; }
export TITANLITE_PYTHON=${TITANLITE_PYTHON:-python3} TITANLITE_CACHE_DIR=${TITANLITE_CACHE_DIR:-/tmp/tlcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_figures}
mkdir -p "$OUT"
PY=$TITANLITE_PYTHON
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

bench() {  # bench NAME ARGS...: one bench throughput, its table kept in summary.txt
  local name=$1; shift
  echo "== $name: bench throughput $*" | tee -a "$OUT/summary.txt"
  timeout 300 $PY -m titanlite.commands.cli bench throughput --compile.enable --repeats 5 --output "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  grep -E "^(titanlite|bare|loop)" "$OUT/$name.log" | tee -a "$OUT/summary.txt" || tail -3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

train() {  # train NAME ARGS...: ./run_train.sh, its last logged step kept in summary.txt
  local name=$1; shift
  echo "== $name: ./run_train.sh $*" | tee -a "$OUT/summary.txt"
  NGPU=1 timeout 300 ./run_train.sh --job.dump_folder "$OUT/runs" --job.name "$name" "$@" > "$OUT/$name.log" 2>&1
  grep -E "^step " "$OUT/$name.log" | tail -1 | tee -a "$OUT/summary.txt" || tail -3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

trace() {  # trace NAME ARGS...: a short run profiled at its last two steps, then titanlite analyze of that window
  local name=$1; shift
  echo "== $name: profiled ./run_train.sh $*" | tee -a "$OUT/summary.txt"
  NGPU=1 timeout 300 ./run_train.sh --job.dump_folder "$OUT/runs" --job.name "$name" --profiling.enable_profiling \
    --profiling.profile_active_steps 2 "$@" > "$OUT/$name.log" 2>&1
  $PY -m titanlite.commands.cli analyze "$OUT/runs/$name/profile" --top 15 > "$OUT/$name.analysis.md" 2>&1
  grep -E "^\| (total|compute|idle|matmul|attention|optimizer|compiled|other kernels)" "$OUT/$name.analysis.md" \
    | tee -a "$OUT/summary.txt" || tail -3 "$OUT/$name.analysis.md" | tee -a "$OUT/summary.txt"
}

step() {  # step NAME SECONDS CMD...: CMD into NAME.log if SECONDS are left before $end (the one-lease modes); its
  # last lines into summary.txt, marked when the CPU suite ($cpu_pid) runs beside it
  local name=$1 need=$2 left=$((end - SECONDS)) beside=""; shift 2
  if [ "$left" -lt "$need" ]; then echo "== $name: skipped ($left s left, needs $need)" | tee -a "$OUT/summary.txt"; return; fi
  [ "$cpu_pid" -gt 0 ] && kill -0 "$cpu_pid" 2>/dev/null && beside=" [beside the CPU suite]"
  echo "== $name ($(date +%T))$beside: $*" | tee -a "$OUT/summary.txt"
  timeout -s INT -k 10 $((need < left ? need : left)) "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
  grep -E "^\||tokens/s|^(bench_moe|shape|small|qwen|step |titanlite|bare|probe)|Error|exit [0-9]" "$OUT/$name.log" | tail -12 \
    | tee -a "$OUT/summary.txt"
}
cpu_pid=0

large=(--config train_configs/gpt2_large_zero2.toml --compile.enable)
smol=(--config train_configs/smollm3_3b_zero2.toml --compile.enable --metrics.log_freq 5)
case "${1:-throughput}" in
  traces)
    trace trace_774m "${large[@]}" --training.steps 8 --profiling.profile_freq 8
    trace trace_3b_selective "${smol[@]}" --activation_checkpoint.mode selective_op --training.steps 6 \
      --profiling.profile_freq 6
    ;;
  levers-small|levers-large|levers)  # each pair back to back: bench throughput for GPT-2 124M, ./run_train.sh after
    small=(--config train_configs/gpt2_small.toml --no-bare)
    [ "$1" = levers-large ] || {
    bench 124m_b16_default "${small[@]}"
    bench 124m_b16_reduce_overhead "${small[@]}" --compile.mode reduce-overhead
    bench 124m_b16_foreach "${small[@]}" --optimizer.implementation foreach
    bench 124m_b64_default "${small[@]}" --training.local_batch_size 64
    bench 124m_b64_reduce_overhead "${small[@]}" --training.local_batch_size 64 --compile.mode reduce-overhead
    }
    [ "$1" = levers-small ] && { cat "$OUT/summary.txt"; exit 0; }
    train 774m_b8x4 "${large[@]}" --training.steps 30
    train 774m_b16x2 "${large[@]}" --training.steps 30 --training.local_batch_size 16
    train 774m_b32x1_selective "${large[@]}" --training.steps 30 --training.local_batch_size 32 \
      --activation_checkpoint.mode selective_op
    train 774m_b8x4_reduce_overhead "${large[@]}" --training.steps 30 --compile.mode reduce-overhead
    train 3b_selective "${smol[@]}" --activation_checkpoint.mode selective_op --training.steps 20
    train 3b_full "${smol[@]}" --activation_checkpoint.mode full --training.steps 20
    if $PY -c "import torchao" 2>/dev/null; then
      train 3b_full_float8_tensorwise "${smol[@]}" --activation_checkpoint.mode full --float8.enable --training.steps 20
      train 3b_full_float8_rowwise "${smol[@]}" --activation_checkpoint.mode full --float8.enable \
        --float8.recipe rowwise --training.steps 20
      train 3b_selective_float8_tensorwise "${smol[@]}" --activation_checkpoint.mode selective_op --float8.enable \
        --training.steps 20
    fi
    ;;
  generate)
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY scripts/bench_generate.py --output "$OUT/generate.json" 2>&1 | tee "$OUT/generate.log" | tail -8 \
      | tee -a "$OUT/summary.txt"
    ;;
  loss-kernels)
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY scripts/bench_loss.py --output "$OUT/loss_kernels.json" 2>&1 \
      | tee "$OUT/loss_kernels.log" | grep -E "^\||not measured" | tee -a "$OUT/summary.txt"
    ;;
  float8-layers)  # which linears pay in float8: all blocks' (the default), then attention's or the MLP's left in bf16
    full=("${smol[@]}" --activation_checkpoint.mode full --training.steps 15)
    train 3b_full_bf16 "${full[@]}"
    train 3b_full_float8 "${full[@]}" --float8.enable
    train 3b_full_float8_mlp_only "${full[@]}" --float8.enable --float8.filter_fqns output,attention
    train 3b_full_float8_no_kv "${full[@]}" --float8.enable --float8.filter_fqns output,wk,wv
    ;;
  autotune)
    bench 124m_b64_default --config train_configs/gpt2_small.toml --no-bare --training.local_batch_size 64
    bench 124m_b64_max_autotune --config train_configs/gpt2_small.toml --no-bare --training.local_batch_size 64 \
      --compile.mode max-autotune-no-cudagraphs
    train 774m_b16x2 "${large[@]}" --training.steps 30 --training.local_batch_size 16
    train 774m_b16x2_max_autotune "${large[@]}" --training.steps 30 --training.local_batch_size 16 \
      --compile.mode max-autotune-no-cudagraphs
    ;;
  flex)  # issue 41's GPU figures: tokens/s of each backend, the same shape, steps and mask
    full=("${smol[@]}" --activation_checkpoint.mode full --training.steps 15)
    for mask in causal block_causal; do
      train "3b_${mask}_sdpa" "${full[@]}" --model.attn_mask_type "$mask"
      train "3b_${mask}_flex" "${full[@]}" --model.attn_mask_type "$mask" --model.attn_backend flex
    done
    ;;
  suite)  # both at once: the CPU suite pins itself to the CPU (gloo), the gpu tests use the GPU
    (./run_tests.sh -n 12 -q -p no:cacheprovider > "$OUT/cpu_suite.log" 2>&1; echo "exit $?" >> "$OUT/cpu_suite.log") &
    ./run_tests.sh -m gpu -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log"
    wait
    { echo "== ./run_tests.sh -m gpu"; tail -4 "$OUT/gpu_tests.log"; echo "== ./run_tests.sh -n 12"
      tail -4 "$OUT/cpu_suite.log"; } | tee -a "$OUT/summary.txt"
    ;;
  sitting)  # one lease: each step runs only while its time is left, so the summary always comes back
    end=$((SECONDS + ${SITTING_SECONDS:-540})) cpu_pid=0
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/device.txt"
    # The CPU suite on 10 of the 16 cores, beside the gpu tests and then the GPU-bound benchmarks (CUDA-event timed
    # kernels, and GPU-bound training runs); the host-bound generate bench waits until it is done.
    (timeout -s INT -k 15 $((end - SECONDS - 120)) ./run_tests.sh -n 10 -q -p no:cacheprovider -rfE \
      > "$OUT/cpu_suite.log" 2>&1; echo "exit $?" >> "$OUT/cpu_suite.log") &
    cpu_pid=$!
    timeout -s INT -k 15 300 ./run_tests.sh -m gpu -v -p no:cacheprovider -rs --durations=0 \
      > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log"
    { echo "== ./run_tests.sh -m gpu"; grep -E "(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | grep "::" | cut -c1-150
      grep -E "^E  " "$OUT/gpu_tests.log" | head -20 | cut -c1-300; tail -2 "$OUT/gpu_tests.log"; } | tee -a "$OUT/summary.txt"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    step moe_block 60 $PY scripts/bench_moe.py --dtype bfloat16
    step loss_kernels 90 $PY scripts/bench_loss.py --output "$OUT/loss_kernels.json"
    moe=(--model.name qwen3_moe --model.flavor qwen3_moe_30b_a3b --model.n_layers 4 --training.seq_len 4096
         --training.local_batch_size 1 --training.steps 15 --metrics.log_freq 5 --job.dump_folder "$OUT/runs")
    step moe_30b_4l_grouped 90 env NGPU=1 ./run_train.sh "${moe[@]}" --job.name moe_grouped
    step moe_30b_4l_loop 90 env NGPU=1 ./run_train.sh "${moe[@]}" --job.name moe_loop --moe.experts_kernel loop
    wait "$cpu_pid"
    { echo "== ./run_tests.sh -n 10 (CPU, gloo)"; grep -E "^(FAILED|ERROR)" "$OUT/cpu_suite.log" | cut -c1-250
      tail -2 "$OUT/cpu_suite.log"; } | tee -a "$OUT/summary.txt"
    step generate 110 $PY scripts/bench_generate.py --repeats 3 --output "$OUT/generate.json"
    step 124m_b64 150 $PY -m titanlite.commands.cli bench throughput --compile.enable --repeats 5 --no-bare \
      --config train_configs/gpt2_small.toml --training.local_batch_size 64
    ;;
  correct)  # issue 50's part 1 in one lease (SITTING_SECONDS, default 560): every gpu test, then SmolLM3-3B at 8,192
    # tokens on SDPA and on flex, block-causal and causal, then whether TorchTitan (.whl/titan) runs on this torch; each
    # step only while its time is left. Nothing beside them: on 2026-11-28 the CPU suite on 12 workers beside starved
    # them (a debug run took 70 s, the 3B did not finish its imports in 110 s). The CPU suite is its own call:
    # ./run_tests.sh -n 12 -m "not slow and not gpu".
    end=$((SECONDS + ${SITTING_SECONDS:-560}))
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/device.txt"
    timeout -s INT -k 15 $((end - SECONDS - 240)) ./run_tests.sh -m gpu -n 0 -v -p no:cacheprovider -rs --durations=0 \
      > "$OUT/gpu_tests.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.log"
    { echo "== ./run_tests.sh -m gpu"; grep -E "(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_tests.log" | grep "::" | cut -c1-140
      grep -E "^E  " "$OUT/gpu_tests.log" | head -12 | cut -c1-250; tail -2 "$OUT/gpu_tests.log"; } | tee -a "$OUT/summary.txt"
    full=("${smol[@]}" --activation_checkpoint.mode full --training.steps 10 --job.dump_folder "$OUT/runs")
    for mask in block_causal causal; do  # block-causal first: where SDPA needs its dense mask and flex may pay
      step "3b_${mask}_sdpa" 100 env NGPU=1 ./run_train.sh "${full[@]}" --job.name "${mask}_sdpa" --model.attn_mask_type "$mask"
      step "3b_${mask}_flex" 100 env NGPU=1 ./run_train.sh "${full[@]}" --job.name "${mask}_flex" --model.attn_mask_type "$mask" \
        --model.attn_backend flex
    done
    step torchtitan_probe 60 bash -c "$PY -m pip install -q --no-index --no-deps --target /tmp/ttsite .whl/titan/*.whl \
      && PYTHONPATH=/tmp/ttsite $PY scripts/torchtitan_probe.py"
    ;;
  throughput)
    small=(--config train_configs/gpt2_small.toml)
    large=(--config train_configs/gpt2_large_zero2.toml --training.global_batch_size -1)
    bench 124m_b16 "${small[@]}"
    bench 124m_b16_plain "${small[@]}" --training.loss_chunk_tokens 0
    bench 124m_b32 "${small[@]}" --training.local_batch_size 32 --no-bare
    bench 124m_b64 "${small[@]}" --training.local_batch_size 64 --no-bare
    bench 774m_b8 "${large[@]}"
    bench 774m_b8_plain "${large[@]}" --training.loss_chunk_tokens 0
    ;;
  loss)  # the two loss paths only
    bench 124m_b16 --config train_configs/gpt2_small.toml
    bench 124m_b16_plain --config train_configs/gpt2_small.toml --training.loss_chunk_tokens 0
    bench 774m_b8 --config train_configs/gpt2_large_zero2.toml --training.global_batch_size -1
    bench 774m_b8_plain --config train_configs/gpt2_large_zero2.toml --training.global_batch_size -1 --training.loss_chunk_tokens 0
    ;;
  runs)
    train gpt2_large_zero2 --config train_configs/gpt2_large_zero2.toml --compile.enable --training.steps 30
    train smollm3_3b_full --config train_configs/smollm3_3b_zero2.toml --compile.enable \
      --activation_checkpoint.mode full --training.steps 20 --metrics.log_freq 5
    train smollm3_3b_selective --config train_configs/smollm3_3b_zero2.toml --compile.enable \
      --activation_checkpoint.mode selective_op --training.steps 20 --metrics.log_freq 5
    if $PY -c "import torchao" 2>/dev/null; then
      train smollm3_3b_full_float8 --config train_configs/smollm3_3b_zero2.toml --compile.enable \
        --activation_checkpoint.mode full --float8.enable --training.steps 20 --metrics.log_freq 5
    fi
    ;;
  runs-short)  # the two headline runs only
    train gpt2_large_zero2 --config train_configs/gpt2_large_zero2.toml --compile.enable --training.steps 30
    train smollm3_3b_selective --config train_configs/smollm3_3b_zero2.toml --compile.enable \
      --activation_checkpoint.mode selective_op --training.steps 20 --metrics.log_freq 5
    ;;
  tests)
    $PY -m pytest -m gpu -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    ;;
esac
echo "---- summary"
cat "$OUT/summary.txt" 2>/dev/null
