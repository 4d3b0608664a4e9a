#!/bin/bash
# Session s23's end: issue 16's 1B goals re-measured on main (each command under the bench lock, one after another).
#   bash benchmarks/results/2026-12-05-s23/measure_1b.sh 2>&1 | tee benchmarks/results/2026-12-05-s23/outputs/measure_1b.log
set -u
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/2026-12-05-s23/outputs
run() { echo "== $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): $*"; flock /work/bench.lock timeout 1200 "$@"; }
run .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 --input-len 128 \
    --output-len 32 --runs 3 --peer llama-cpp openvino hf-generate --results-dir $OUT
run .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 --num-prompts 64 \
    --input-len 32:128 --output-len 32 --peer llama-cpp openvino --results-dir $OUT
run .venv/bin/conveyor bench decode-step --model /work/ckpt/llama-1b --num-seqs 1 --prompt-len 128 --steps 16 \
    --max-model-len 2048
run .venv/bin/python benchmarks/gguf_memory.py /work/ckpt/llama-1b --kv-cache-memory default
