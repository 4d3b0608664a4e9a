#!/usr/bin/env bash
# End-of-session side-by-side checks: base (05f9738 = s11's end, /work/base) vs this session's main (/work/main).
# Usage: bash measure.sh [parts...]  parts: w1 1b-w1 1b-peers 1b-w2 q4-w2 1b-step 1b-breakdown (default: all)
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s12/bench
parts=${*:-"w1 1b-w1 1b-peers 1b-w2 q4-w2 1b-step 1b-breakdown"}
for part in $parts; do
case $part in
w1)  # default W1 with OpenVINO, alternating main / base
  for r in 1 2; do for side in main base; do
    uptime
    (cd /work/$side && timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir $O/w1_${side}_$r > $O/w1_${side}_$r.txt 2>&1)
    grep -h '"output_tokens_per_s"' $O/w1_${side}_$r.txt | head -2
  done; done ;;
1b-w1)  # 1B bf16 W1 with OpenVINO, alternating main / base
  for r in 1 2; do for side in main base; do
    uptime
    (cd /work/$side && timeout 900 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
       --num-prompts 64 --input-len 32:128 --output-len 32 --peer openvino --results-dir $O/w1_1b_${side}_$r > $O/w1_1b_${side}_$r.txt 2>&1)
    grep -h '"output_tokens_per_s"' $O/w1_1b_${side}_$r.txt | head -2
  done; done ;;
1b-peers)  # 1B bf16 W1 with OpenVINO and llama.cpp (main only)
  uptime
  (cd /work/main && timeout 1500 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
     --num-prompts 64 --input-len 32:128 --output-len 32 --peer openvino llama-cpp --results-dir $O/w1_1b_peers > $O/w1_1b_peers.txt 2>&1)
  grep -h '"output_tokens_per_s"\|"seconds"' $O/w1_1b_peers.txt ;;
1b-w2)  # 1B bf16 single request with OpenVINO
  uptime
  (cd /work/main && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
     --input-len 128 --output-len 32 --runs 3 --peer openvino --results-dir $O/w2_1b_bf16 > $O/w2_1b_bf16.txt 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' $O/w2_1b_bf16.txt ;;
q4-w2)  # 1B Q4_K_M single request with llama.cpp
  uptime
  (cd /work/main && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
     --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir $O/w2_1b_q4 > $O/w2_1b_q4.txt 2>&1)
  grep -h '"ttft_s"\|"tpot_s"' $O/w2_1b_q4.txt ;;
1b-step)  # 1B bf16 single-stream decode step against the copy bandwidth, main / base
  for side in main base main base; do
    uptime
    (cd /work/$side && timeout 300 .venv/bin/conveyor bench decode-step --model /work/ckpt/llama-1b --num-seqs 1 --prompt-len 128 \
       --steps 16 --max-model-len 2048 --results-dir $O/step_$side 2>&1 | grep -E '"step_ms_median"|copy_bandwidth|over_bandwidth' | sed "s/^/$side /")
  done ;;
1b-breakdown)  # 1B W1 steps by kind, synchronous engine, main / base
  for side in main base; do
    uptime
    (cd /work/$side && timeout 300 .venv/bin/python /work/main/benchmarks/w1_breakdown.py --model /work/ckpt/llama-1b --input-len 32:128 \
       --output-len 32 --max-model-len 1024 --async-batching false 2>&1 | grep -v "prefill step:" | head -5 | sed "s/^/$side /") | tee -a $O/breakdown_1b.txt
  done ;;
esac
done
uptime
echo DONE
