#!/usr/bin/env bash
# End-of-session side-by-side checks: base (c35d084, /work/base) vs the merged code (/work/integ); quiet machine.
# Usage: bash measure.sh [parts...]  parts: w1 breakdown 1b-w1 1b-w2 q4-w2 (default: all, in that order)
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s11/bench
parts=${*:-"w1 breakdown 1b-w1 1b-w2 q4-w2"}
for part in $parts; do
case $part in
w1)  # default W1 with OpenVINO, alternating integ / base
  for r in 1 2; do for side in integ base; do
    uptime
    (cd /work/$side && timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir $O/w1_${side}_$r > $O/w1_${side}_$r.txt 2>&1)
    grep -h '"output_tokens_per_s"' $O/w1_${side}_$r.txt | head -2
  done; done ;;
breakdown)  # W1 steps by kind, synchronous engine
  for r in 1 2; do for side in integ base; do
    uptime
    (cd /work/$side && timeout 300 .venv/bin/python benchmarks/w1_breakdown.py --async-batching false 2>&1 | head -5) | tee -a $O/breakdown_$side.txt
  done; done ;;
1b-w1)  # 1B bf16 W1 with OpenVINO and llama.cpp (merged only)
  uptime
  (cd /work/integ && timeout 1500 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
     --num-prompts 64 --input-len 32:128 --output-len 32 --peer openvino llama-cpp --results-dir $O/w1_1b_bf16 > $O/w1_1b_bf16.txt 2>&1)
  grep -h '"output_tokens_per_s"\|"seconds"' $O/w1_1b_bf16.txt ;;
1b-w2)  # 1B bf16 single request with OpenVINO (its TTFT)
  uptime
  (cd /work/integ && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
     --input-len 128 --output-len 32 --runs 3 --peer openvino --results-dir $O/w2_1b_bf16 > $O/w2_1b_bf16.txt 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' $O/w2_1b_bf16.txt ;;
q4-w2)  # 1B Q4_K_M single request with llama.cpp
  uptime
  (cd /work/integ && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
     --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir $O/w2_1b_q4 > $O/w2_1b_q4.txt 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' $O/w2_1b_q4.txt ;;
esac
done
uptime
echo DONE
