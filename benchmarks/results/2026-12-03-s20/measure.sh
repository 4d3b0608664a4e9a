#!/usr/bin/env bash
# Session s20's side-by-side checks (issue 16): main against BASE (default 949a6d6, s19's end, in a worktree of its
# own at /work/base, run with main's venv; its kernels the build cached for its sources). Outputs under $O (default
# /work/notes/s20/bench). Usage: bash measure.sh [parts...]
#   ab:      kernel_ab.py, base's build against main's (GGUF products at 1 / 64 / 128 rows, alternating)
#   pack:    s19's pack_probe.py (main's copy) run on BASE (its per-chunk arm is the slab path for wide inputs past 256 rows)
#            against the packed path, at 257-767 rows ($M1B)
#   w1q4:    1B Q4_K_M W1 (bench throughput), main with llama.cpp in the same invocation, base alone, two rounds
#   w1q5:    the same on the Q5_K_M file, one round; w2q5: its single request (bench latency), main with llama.cpp,
#            then base alone
#   default: the default model's W1 on the synchronous engine (w1_breakdown.py) with its Q4_1 blocks kept compact
#            (gguf_weights=compact) and dequantized (auto), base and main
#   ov:      default W1 against OpenVINO GenAI, exact caches and 8-bit caches (main)
set -x
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/root/.cache/torch_extensions}
O=${O:-/work/notes/s20/bench}
BASE=${BASE:-/work/base}
MAIN=$(cd "$(dirname "$0")/../../.." && pwd)
PY=$MAIN/.venv/bin/python
here=$MAIN/benchmarks/results/2026-12-03-s20
M1B=${M1B:-/work/ckpt/llama-1b-q4_k_m.gguf}
build() { (cd "$1" && PYTHONPATH=$1 $PY -c "from conveyor.model.native import load_kernels; print(load_kernels().__name__)"); }
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
parts=${*:-"ab pack w1q4 w1q5 w2q5 default ov"}
for part in $parts; do
case $part in
ab)
  (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY "$here/kernel_ab.py" "$(build "$BASE")" "$(build "$MAIN")" \
    | tee "$O/ab.txt") ;;
pack)
  (cd "$BASE" && PYTHONPATH=$BASE flock /work/bench.lock timeout 900 $PY "$MAIN/benchmarks/results/2026-12-03-s19/pack_probe.py" "$M1B" 257,384,512,640,767 \
    | tee "$O/pack_base.txt") ;;
w1q4) w1 "$M1B" w1q4 2 ;;
w1q5) w1 /work/ckpt/llama-1b-q5_k_m.gguf w1q5 1 ;;
w2q5)
  (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY -m conveyor.cli bench latency --model /work/ckpt/llama-1b-q5_k_m.gguf \
    --max-model-len 1024 --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir "$O/w2q5_main" \
    > "$O/w2q5_main.txt" 2>&1)
  (cd "$BASE" && PYTHONPATH=$BASE flock /work/bench.lock timeout 900 $PY -m conveyor.cli bench latency \
    --model /work/ckpt/llama-1b-q5_k_m.gguf --max-model-len 1024 --input-len 128 --output-len 32 --runs 3 \
    --results-dir "$O/w2q5_base" > "$O/w2q5_base.txt" 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' "$O/w2q5_main.txt" "$O/w2q5_base.txt" ;;
default)
  for side in base main; do for g in compact auto; do
    d=$MAIN; [ $side = base ] && d=$BASE
    uptime
    (cd "$d" && PYTHONPATH=$d flock /work/bench.lock timeout 600 $PY "$MAIN/benchmarks/w1_breakdown.py" --async-batching false \
      --gguf-weights $g > "$O/default_${side}_$g.txt" 2>&1)
    echo "$side $g"; head -4 "$O/default_${side}_$g.txt"
  done; done ;;
ov)
  for kv in auto int8; do
    (cd "$MAIN" && flock /work/bench.lock timeout 900 $PY -m conveyor.cli bench throughput --runs 3 --peer openvino \
      --kv-cache-dtype $kv --results-dir "$O/ov_$kv" > "$O/ov_$kv.txt" 2>&1)
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' "$O/ov_$kv.txt"
  done ;;
esac
done
