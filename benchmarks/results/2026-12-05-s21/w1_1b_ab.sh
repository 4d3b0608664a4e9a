#!/bin/bash
# alternating base / main W1 on the 1B Q4_K_M file with llama.cpp beside each
cd /work/main
for who in main base main base; do
  if [ $who = base ]; then export PYTHONPATH=/work/base; else unset PYTHONPATH; fi
  echo "== $who $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  flock /work/bench.lock timeout 900 .venv/bin/python -m conveyor.cli bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf --max-model-len 1024 --num-prompts 64 --input-len 32:128 --output-len 32 --peer llama-cpp 2>&1 | grep -E '"output_tokens_per_s"|conveyor_over_peer'
done
