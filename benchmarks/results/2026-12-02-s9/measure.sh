#!/usr/bin/env bash
# End-of-session side-by-side checks: base (a191c70) vs the merged code (integ), quiet machine.
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s9/bench
mkdir -p $O
uptime
# 1. 1B Q4_K_M single request vs llama.cpp on the same file: integ, then base
for side in integ base; do
  (cd /work/$side && timeout 900 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
     --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir $O/lat1b_$side > $O/lat1b_${side}.txt 2>&1); uptime
done
# 2. 1B Q4_K_M W1-shaped: integ with llama.cpp and OpenVINO (fp16 IR of the file's dequantized weights), base alone
(cd /work/integ && timeout 1200 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
   --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp openvino --results-dir $O/w1_1b_integ > $O/w1_1b_integ.txt 2>&1); uptime
(cd /work/base && timeout 1200 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
   --num-prompts 64 --input-len 32:128 --output-len 32 --results-dir $O/w1_1b_base > $O/w1_1b_base.txt 2>&1); uptime
# 3. default model W1 with OpenVINO, alternating
for r in 1; do for side in integ base; do
  (cd /work/$side && timeout 600 .venv/bin/conveyor bench throughput --peer openvino --results-dir $O/w1_$side > $O/w1_${side}_$r.txt 2>&1); uptime
done; done
echo DONE
