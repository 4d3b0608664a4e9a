#!/usr/bin/env bash
# End-of-session side-by-side checks: base (d77354d = s14's end, worktree /work/base, run with main's .venv and
# PYTHONPATH=/work/base) vs this session's main (/work/main). Usage: bash measure.sh [parts...]  parts: w1 sync 1b-w1 w2
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=${O:-/work/notes/s15/bench}  # where the outputs go (session s16 reuses this script with its own)
parts=${*:-"w1"}
run_side() {  # side, then the command's arguments
  local side=$1; shift
  if [ "$side" = base ]; then (cd /work/base && PYTHONPATH=/work/base timeout 900 /work/main/.venv/bin/python "$@")
  else (cd /work/main && timeout 900 .venv/bin/python "$@"); fi
}
for part in $parts; do
case $part in
w1)  # default W1 with OpenVINO, alternating main / base
  for r in 1 2; do for side in main base; do
    uptime
    run_side $side -m conveyor.cli bench throughput --runs 3 --peer openvino --results-dir $O/w1_${side}_$r > $O/w1_${side}_$r.txt 2>&1
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' $O/w1_${side}_$r.txt | head -3
  done; done ;;
sync)  # default W1 steps, synchronous engine, alternating
  for r in 1 2; do for side in main base; do
    run_side $side benchmarks/w1_breakdown.py --async-batching false > $O/sync_${side}_$r.txt 2>&1
    head -4 $O/sync_${side}_$r.txt
  done; done ;;
1b-w1)  # 1B bf16 W1 with OpenVINO, main then base
  for side in main base; do
    uptime
    run_side $side -m conveyor.cli bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
       --num-prompts 64 --input-len 32:128 --output-len 32 --peer openvino --results-dir $O/w1_1b_${side} > $O/w1_1b_${side}.txt 2>&1
    grep -h '"output_tokens_per_s"\|conveyor_over_peer' $O/w1_1b_${side}.txt | head -3
  done ;;
w2)  # default W2 (one request) with OpenVINO, alternating main / base
  for r in 1 2; do for side in main base; do
    uptime
    run_side $side -m conveyor.cli bench latency --runs 3 --peer openvino --results-dir $O/w2_${side}_$r > $O/w2_${side}_$r.txt 2>&1
    grep -h '"ttft_s"\|"tpot_s"\|"tpot_ms"\|"ttft_ms"' $O/w2_${side}_$r.txt | head -4
  done; done ;;
esac
done
uptime
echo DONE
