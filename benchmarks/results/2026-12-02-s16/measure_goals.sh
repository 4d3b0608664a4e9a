#!/usr/bin/env bash
# Session s16: issue 16's goals re-measured side by side on this machine with main (each command waits for the
# bench lock; the load average is printed before it). Results: /work/notes/s16/goals/*.txt and JSON dirs, copied to
# goals/ beside this script.
set -x
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
O=/work/notes/s16/goals; mkdir -p $O
cd /work/main
run() { local name=$1; shift; uptime; flock /work/bench.lock timeout 1800 .venv/bin/python "$@" > $O/$name.txt 2>&1; tail -30 $O/$name.txt | grep -h '"output_tokens_per_s"\|conveyor_over\|ttft\|tpot\|rss_minus\|"load_s"' | head -12; }
if [ -z "${1:-}" ]; then  # the first pass
# 1B bf16 W1 against llama.cpp and OpenVINO
run w1_1b_bf16 -m conveyor.cli bench throughput --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
  --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp openvino --results-dir $O/w1_1b_bf16
# 1B Q4_K_M single request against llama.cpp on the same file (TPOT and TTFT)
run w2_1b_q4 -m conveyor.cli bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
  --input-len 128 --output-len 32 --runs 3 --peer llama-cpp --results-dir $O/w2_1b_q4
# 1B bf16 single request (TPOT against the bandwidth bound) beside OpenVINO
run w2_1b_bf16 -m conveyor.cli bench latency --model /work/ckpt/llama-1b-bf16.gguf --max-model-len 1024 \
  --input-len 128 --output-len 32 --runs 3 --peer openvino --results-dir $O/w2_1b_bf16
# default-model W1 against llama.cpp
run w1_default_llama -m conveyor.cli bench throughput --runs 3 --peer llama-cpp --results-dir $O/w1_default_llama
# memory: 1B bf16 folder with the default KV rule, 1B Q4_K_M compact
run mem_1b_bf16 benchmarks/gguf_memory.py /work/ckpt/llama-1b --kv-cache-memory default
run mem_1b_q4 benchmarks/gguf_memory.py /work/ckpt/llama-1b-q4_k_m.gguf --gguf-weights compact
uptime
echo DONE
fi
# Later passes, as they were run (bash measure_goals.sh second | third | fourth):
case "${1:-}" in
second)  # 1B Q4_K_M W1 against llama.cpp on the same file; the bf16 folder's memory/load again (the first load
         # above read the checkpoint from disk: 11.8 s; mem_1b_bf16_3.txt is a third run of the same command)
  run w1_1b_q4 -m conveyor.cli bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 \
    --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp --results-dir $O/w1_1b_q4
  run mem_1b_bf16_2 benchmarks/gguf_memory.py /work/ckpt/llama-1b --kv-cache-memory default ;;
third)  # the 1B bf16 single-stream decode step against the bandwidth bound
  run decode_step_1b -m conveyor.cli bench decode-step --model /work/ckpt/llama-1b --num-seqs 1 --prompt-len 128 \
    --steps 16 --max-model-len 2048 ;;
fourth)  # 1B Q8_0 W1 against llama.cpp on the same file
  run w1_1b_q8 -m conveyor.cli bench throughput --model /work/ckpt/llama-1b-q8_0.gguf --max-model-len 1024 \
    --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp --results-dir $O/w1_1b_q8 ;;
esac
