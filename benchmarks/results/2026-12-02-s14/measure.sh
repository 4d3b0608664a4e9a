#!/usr/bin/env bash
# End-of-session side-by-side checks: base (5d5368b = s13's end, /work/base) vs this session's main (/work/main).
# Usage: bash measure.sh [parts...]  parts: w1 1b-w1 (default: all)
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s14/bench
parts=${*:-"w1 1b-w1"}
for part in $parts; do
case $part in
w1)  # default W1 with OpenVINO, alternating main / base
  for r in 1 2; do for side in main base; do
    uptime
    (cd /work/$side && timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir $O/w1_${side}_$r > $O/w1_${side}_$r.txt 2>&1)
    grep -h '"output_tokens_per_s"' $O/w1_${side}_$r.txt | head -2
  done; done ;;
1b-w1)  # 1B bf16 W1 with OpenVINO, main then base
  for side in main base; do
    uptime
    (cd /work/$side && timeout 900 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
       --num-prompts 64 --input-len 32:128 --output-len 32 --peer openvino --results-dir $O/w1_1b_${side} > $O/w1_1b_${side}.txt 2>&1)
    grep -h '"output_tokens_per_s"' $O/w1_1b_${side}.txt | head -2
  done ;;
esac
done
uptime
echo DONE
