#!/usr/bin/env bash
# Session s17's side-by-side checks (issue 16): default W1 with OpenVINO GenAI, our exact cache against its bf16
# cache and our int8 cache against its u8 cache (its CPU default), alternating; then W1's steps on the synchronous
# engine (benchmarks/w1_breakdown.py) and decode attention alone (kv_attention_probe.py), each cache kind
# alternating. Outputs under $O (default /work/notes/s17/bench). Usage: bash measure.sh [parts...]  parts: w1 sync probe
set -x
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/root/.cache/torch_extensions}
O=${O:-/work/notes/s17/bench}
mkdir -p "$O"
cd "$(dirname "$0")/../../.."
here=benchmarks/results/2026-12-03-s17
parts=${*:-"w1 sync probe"}
for part in $parts; do
case $part in
w1)
  for r in 1 2; do for kv in int8 auto; do
    uptime
    flock /work/bench.lock timeout 900 .venv/bin/python -m conveyor.cli bench throughput --runs 3 --peer openvino \
      --kv-cache-dtype $kv --results-dir $O/w1_${kv}_$r > $O/w1_${kv}_$r.txt 2>&1
    grep -h '"output_tokens_per_s"\|conveyor_over_peer\|KV cache' $O/w1_${kv}_$r.txt | head -4
  done; done ;;
sync)
  for r in 1 2; do for kv in auto int8; do
    flock /work/bench.lock timeout 300 .venv/bin/python benchmarks/w1_breakdown.py --async-batching false \
      --kv-cache-dtype $kv > $O/sync_${kv}_$r.txt 2>&1
    head -4 $O/sync_${kv}_$r.txt
  done; done ;;
probe)
  flock /work/bench.lock timeout 300 .venv/bin/python $here/kv_attention_probe.py | tee $O/probe.txt ;;
esac
done
uptime
echo DONE
