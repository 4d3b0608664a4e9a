#!/usr/bin/env bash
# Session s19's side-by-side checks (issue 16): main against BASE (default 774012f, s18's end, in a worktree of its
# own at /work/base, run with main's venv; its kernels the build cached for its sources). Outputs under $O (default
# /work/notes/s19/bench). Usage: bash measure.sh [parts...]
#   micro: the packed path against the per-chunk one on the 1B Q4_K_M file's layer 0 gate/up (pack_probe.py)
#   sync:  1B W1's steps on the synchronous engine (w1_breakdown.py), base and main alternating, two rounds ($M1B)
#   steps: step_kernels_probe.py (s18's) on main: a prompt step's time by native kernel
#   w1:    1B W1 (bench throughput), main with llama.cpp in the same invocation, base alone, alternating, two rounds
#   w1q8:  the same on the Q8_0 file, one round; w1q40: the Q4_0 file, one round
set -x
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/root/.cache/torch_extensions}
O=${O:-/work/notes/s19/bench}
BASE=${BASE:-/work/base}
MAIN=$(cd "$(dirname "$0")/../../.." && pwd)
PY=$MAIN/.venv/bin/python
here=$MAIN/benchmarks/results/2026-12-03-s19
M1B=${M1B:-/work/ckpt/llama-1b-q4_k_m.gguf}
mkdir -p "$O"
w1() {  # model, tag, rounds
  for r in $(seq "$3"); do
    uptime
    (cd "$MAIN" && flock /work/bench.lock timeout 1200 $PY -m conveyor.cli bench throughput --model "$1" --max-model-len 1024 \
      --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp --results-dir "$O/$2_main_$r" > "$O/$2_main_$r.txt" 2>&1)
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' "$O/$2_main_$r.txt"
    (cd "$BASE" && PYTHONPATH=$BASE flock /work/bench.lock timeout 1200 $PY -m conveyor.cli bench throughput --model "$1" \
      --max-model-len 1024 --num-prompts 64 --input-len 32:128 --output-len 32 --results-dir "$O/$2_base_$r" \
      > "$O/$2_base_$r.txt" 2>&1)
    grep -h '"output_tokens_per_s"' "$O/$2_base_$r.txt"
  done
}
parts=${*:-"micro sync steps w1 w1q8 w1q40"}
for part in $parts; do
case $part in
micro)
  (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY "$here/pack_probe.py" "$M1B" | tee "$O/micro.txt") ;;
sync)
  for r in 1 2; do for side in base main; do
    d=$MAIN; [ $side = base ] && d=$BASE
    uptime
    (cd "$d" && PYTHONPATH=$d flock /work/bench.lock timeout 600 $PY benchmarks/w1_breakdown.py --async-batching false \
      --model "$M1B" --input-len 32:128 --output-len 32 --max-model-len 1024 > "$O/sync_${side}_$r.txt" 2>&1)
    echo "$side $r"; head -3 "$O/sync_${side}_$r.txt"
  done; done ;;
steps)
  (cd "$MAIN" && flock /work/bench.lock timeout 600 $PY benchmarks/results/2026-12-03-s18/step_kernels_probe.py "$M1B" \
    > "$O/steps_main.txt" 2>&1)
  grep -A8 "first step" "$O/steps_main.txt" ;;
w1) w1 "$M1B" w1q4 2 ;;
w1q8) w1 /work/ckpt/llama-1b-q8_0.gguf w1q8 1 ;;
w1q40) w1 /work/ckpt/llama-1b-q4_0.gguf w1q40 1 ;;
esac
done
