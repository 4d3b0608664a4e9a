#!/bin/bash
export TORCH_EXTENSIONS_DIR=/root/.cache/torch_extensions
for side in base wtB; do
  echo "== $side $(uptime)"
  peer=""; [ $side = wtB ] && peer="--peer openvino"
  cd /work/$side && timeout 420 .venv/bin/conveyor bench throughput --model /work/ckpt/llama-1b-q4_k_m.gguf \
    --max-model-len 1024 --num-prompts 64 --input-len 32:128 --output-len 32 $peer \
    --results-dir /tmp/s10-e2e/w1_$side 2>&1 | grep -v "^\s*$" | tail -40
done
echo "== end $(uptime)"
