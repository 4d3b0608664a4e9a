#!/usr/bin/env bash
# Issue 16 / s10: prefill attention on torch's fused kernel (4-D SDPA) against base fcef4c3, side by side,
# alternating base and ours; each command takes /work/bench.lock for itself only.
#   bash benchmarks/results/2026-12-02-s10-prefill/measure.sh /work/base /work/wtA <out dir>
set -u
BASE=${1:-/work/base}
OURS=${2:-/work/wtA}
O=${3:-/tmp/s10-prefill-bench}
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
mkdir -p "$O"
lock() { flock -w 900 /work/bench.lock "$@"; }
for side in base ours; do
  dir=$BASE; [ $side = ours ] && dir=$OURS
  echo "== breakdown $side $(uptime)"
  (cd "$dir" && lock timeout 300 .venv/bin/python benchmarks/w1_breakdown.py > "$O/breakdown_$side.txt" 2>&1)
done
for side in base ours; do
  dir=$BASE; [ $side = ours ] && dir=$OURS
  echo "== W1 default + openvino $side $(uptime)"
  (cd "$dir" && lock timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir "$O/w1_$side" \
     > "$O/w1_$side.txt" 2>&1)
done
for side in base ours; do
  dir=$BASE; [ $side = ours ] && dir=$OURS
  echo "== latency default $side $(uptime)"
  (cd "$dir" && lock timeout 300 .venv/bin/conveyor bench latency --runs 3 --results-dir "$O/lat_$side" \
     > "$O/lat_$side.txt" 2>&1)
  echo "== latency 1B q4_k_m $side $(uptime)"
  (cd "$dir" && lock timeout 300 .venv/bin/conveyor bench latency --runs 3 --model /work/ckpt/llama-1b-q4_k_m.gguf \
     --max-model-len 1024 --input-len 128 --output-len 8 --results-dir "$O/lat1b_$side" > "$O/lat1b_$side.txt" 2>&1)
done
echo "== done $(uptime)"
