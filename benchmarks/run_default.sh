#!/usr/bin/env bash
# The default model's peer comparison (docs/performance.md, the default model's tables), one command:
#
#     bash benchmarks/run_default.sh
#
#   W1: 64 requests at once, random 32-256-token prompts, 128 new tokens each (greedy, EOS ignored); ours the
#       median of 3 runs, then transformers `generate` (bf16, static batches of 32), llama.cpp (64 sequences)
#       and OpenVINO GenAI, each once, in the same invocation.
#   W2: one request, 128-token prompt, 128 new tokens, ours (bf16, then int4 weights) and the peers
#       interleaved round by round, medians of 3.
# Same lock, load reporting and result folder conventions as benchmarks/run_1b.sh; baselines w1-default and
# w2-default are rewritten (benchmarks/baselines/, local to this machine, not committed). Results: $OUT (default
# benchmarks/results, not committed), one JSON per command with the exact command line and the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
BENCH_LOCK=${BENCH_LOCK:-/work/bench.lock}
[ -d "$(dirname "$BENCH_LOCK")" ] || BENCH_LOCK=/tmp/conveyor-bench.lock
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
run() {
    echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): conveyor $*" >&2
    # shellcheck disable=SC2068
    flock "$BENCH_LOCK" timeout 3600 .venv/bin/conveyor $@ --results-dir "$OUT"
}
run bench throughput --runs 3 --peer hf-generate llama-cpp openvino --save-baseline w1-default
run bench latency --runs 3 --peer hf-generate llama-cpp openvino --save-baseline w2-default
run bench latency --runs 3 --quantization int4 --peer llama-cpp openvino
