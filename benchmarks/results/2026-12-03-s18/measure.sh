#!/usr/bin/env bash
# Session s18's side-by-side checks (issue 16): main against BASE (default e53aa67, s17's end, in a worktree of its
# own at /work/base, run with main's venv; its kernels the build cached for its sources). Outputs under $O (default
# /work/notes/s18/bench). Usage: bash measure.sh [parts...]   parts: micro steps w1q4 w1default
#   micro:     gguf_linear_amx on the 1B Q4_K_M file's layer 0, main's kernels against base's (ab_gguf_prefill.py)
#   steps:     step_kernels_probe.py, base and main alternating, two rounds
#   w1q4:      1B Q4_K_M W1, main with llama.cpp in the same invocation, base alone, alternating, two rounds
#   w2q4:      1B Q4_K_M single request (W2-shaped) with llama.cpp in the same invocation
#   sync:      1B Q4_K_M W1's steps on the synchronous engine (w1_breakdown.py), base and main alternating, 3 rounds
#   w1default: default-model W1 against OpenVINO GenAI, exact (bf16 against bf16) and int8 (against its u8) caches
set -x
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/root/.cache/torch_extensions}
O=${O:-/work/notes/s18/bench}
BASE=${BASE:-/work/base}
MAIN=$(cd "$(dirname "$0")/../../.." && pwd)
PY=$MAIN/.venv/bin/python
here=$MAIN/benchmarks/results/2026-12-03-s18
M1B=${M1B:-/work/ckpt/llama-1b-q4_k_m.gguf}
mkdir -p "$O"
base_build=$(cd "$BASE" && PYTHONPATH=$BASE $PY -c "from conveyor.model.native import load_kernels as l; print(l().__name__)")
parts=${*:-"micro steps w1q4 w1default sync"}
for part in $parts; do
case $part in
micro)
  (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY benchmarks/ab_gguf_prefill.py --model "$M1B" --rows 16 64 128 2048 \
    --old-build "$base_build" | tee "$O/micro.txt") ;;
steps)
  for r in 1 2; do for side in base main; do
    d=$MAIN; [ $side = base ] && d=$BASE
    uptime
    (cd "$d" && PYTHONPATH=$d flock /work/bench.lock timeout 600 $PY "$here/step_kernels_probe.py" "$M1B" \
      > "$O/steps_${side}_$r.txt" 2>&1)
    grep -h "first step\|five decode" "$O/steps_${side}_$r.txt"
  done; done ;;
w1q4)
  for r in 1 2; do
    uptime
    (cd "$MAIN" && flock /work/bench.lock timeout 1200 $PY -m conveyor.cli bench throughput --model "$M1B" --max-model-len 1024 \
      --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp --results-dir "$O/w1q4_main_$r" > "$O/w1q4_main_$r.txt" 2>&1)
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' "$O/w1q4_main_$r.txt"
    (cd "$BASE" && PYTHONPATH=$BASE flock /work/bench.lock timeout 1200 $PY -m conveyor.cli bench throughput --model "$M1B" \
      --max-model-len 1024 --num-prompts 64 --input-len 32:128 --output-len 32 --results-dir "$O/w1q4_base_$r" \
      > "$O/w1q4_base_$r.txt" 2>&1)
    grep -h '"output_tokens_per_s"' "$O/w1q4_base_$r.txt"
  done ;;
w2q4)
  (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY -m conveyor.cli bench latency --model "$M1B" --max-model-len 1024 \
    --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir "$O/w2q4" > "$O/w2q4.txt" 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' "$O/w2q4.txt" ;;
sync)
  for r in 1 2 3; do for side in base main; do
    d=$MAIN; [ $side = base ] && d=$BASE
    (cd "$d" && PYTHONPATH=$d flock /work/bench.lock timeout 600 $PY benchmarks/w1_breakdown.py --async-batching false \
      --model "$M1B" --input-len 32:128 --output-len 32 --max-model-len 1024 > "$O/sync_${side}_$r.txt" 2>&1)
    echo "$side $r"; head -4 "$O/sync_${side}_$r.txt"
  done; done ;;
w1default)
  for kv in auto int8; do
    uptime
    (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY -m conveyor.cli bench throughput --runs 3 --peer openvino \
      --kv-cache-dtype $kv --results-dir "$O/w1_${kv}" > "$O/w1_${kv}.txt" 2>&1)
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' "$O/w1_${kv}.txt"
  done ;;
esac
done
uptime
echo DONE
