#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md, on one GPU of an offline machine (docs/testing.md, "Tests on a GPU box", says how to set one up):
#   scripts/gpu_figures.sh throughput   bench throughput, GPT-2 124M and 774M, chunked and plain loss
#   scripts/gpu_figures.sh runs         ./run_train.sh figures: gpt2_large_zero2 at NGPU=1, the 3B at seq 8192
#   scripts/gpu_figures.sh loss         bench throughput of the chunked and the plain loss
#   scripts/gpu_figures.sh runs-short   gpt2_large_zero2 and the 3B with selective AC only
#   scripts/gpu_figures.sh tests        the gpu-marked tests (./run_tests.sh -m gpu)
# Each writes its outputs under $OUT (default /tmp/gpu_figures) and prints a summary last.
set -u
cd "$(dirname "$0")/.."
export TITANLITE_PYTHON=${TITANLITE_PYTHON:-python3} TITANLITE_CACHE_DIR=${TITANLITE_CACHE_DIR:-/tmp/tlcache} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_figures}
mkdir -p "$OUT"
PY=$TITANLITE_PYTHON
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"

bench() {  # bench NAME ARGS...: one bench throughput, its table kept in summary.txt
  local name=$1; shift
  echo "== $name: bench throughput $*" | tee -a "$OUT/summary.txt"
  $PY -m titanlite.commands.cli bench throughput --compile.enable --repeats 5 --output "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  grep -E "^(titanlite|bare|loop)" "$OUT/$name.log" | tee -a "$OUT/summary.txt" || tail -3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

train() {  # train NAME ARGS...: ./run_train.sh, its last logged step kept in summary.txt
  local name=$1; shift
  echo "== $name: ./run_train.sh $*" | tee -a "$OUT/summary.txt"
  NGPU=1 ./run_train.sh --job.dump_folder "$OUT/runs" --job.name "$name" "$@" > "$OUT/$name.log" 2>&1
  grep -E "^step " "$OUT/$name.log" | tail -1 | tee -a "$OUT/summary.txt" || tail -3 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

case "${1:-throughput}" in
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
