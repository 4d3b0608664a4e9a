#!/bin/bash
# base then branch, then base then branch again: 1B Q4_K_M TTFT at 512 prompt tokens
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
for round in 1 2; do
  for side in base wtB; do
    echo "== $side round $round $(uptime)"
    cd /work/$side && timeout 280 .venv/bin/conveyor bench latency --model /work/ckpt/llama-1b-q4_k_m.gguf \
      --max-model-len 1024 --input-len 512 --output-len 8 --runs 3 --results-dir /tmp/s10-e2e/$side$round 2>&1 \
      | grep -v "^\s*$" | tail -12
  done
done
echo "== end $(uptime)"
