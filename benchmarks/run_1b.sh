#!/usr/bin/env bash
# The 1B-class workloads (issue 16), Conveyor beside its peers on the same files, one command:
#
#     bash benchmarks/run_1b.sh [FORMATS...]        # default: bf16 q8_0 q4_k_m q5_k_m
#
# Models: $CKPT/llama-1b-<format>.gguf (default CKPT=/work/ckpt), made by scripts/make_1b_benchmark_models.py
# (random-weight Llama-3.2-1B shape, llama.cpp's converter and quantizer; nothing downloaded). Peers:
# scripts/install_llama_cpp.sh and scripts/install_openvino.sh (skipped with the reason when missing).
#   W1: 64 requests at once, random 32-128-token prompts, 32 new tokens each (greedy, EOS ignored); the peers
#       run after ours in the same invocation (ours is freed first: one 1B model in memory at a time).
#   W2: one request, 128-token prompt, 32 new tokens; ours and one peer per invocation, interleaved round by
#       round (two 1B models in memory, not four).
# OpenVINO and transformers run on the bf16 file only (OpenVINO on an fp16 IR of it, transformers in bf16);
# llama.cpp on every file. Each command waits for $BENCH_LOCK (no two benchmarks at once) and the machine's
# load average is printed before it and saved in each result's "machine". Results: $OUT (default
# benchmarks/results-1b), one JSON per command with the exact command line. Lengths are bounded (32 new tokens)
# to keep 1B runs short on 2 cores (not yet timed end to end); set W1_ARGS / W2_ARGS / ENGINE_ARGS to change them.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=${CKPT:-/work/ckpt}
OUT=${OUT:-benchmarks/results-1b}
BENCH_LOCK=${BENCH_LOCK:-/work/bench.lock}
[ -d "$(dirname "$BENCH_LOCK")" ] || BENCH_LOCK=/tmp/conveyor-bench.lock
W1_ARGS=${W1_ARGS:-"--num-prompts 64 --input-len 32:128 --output-len 32"}
W2_ARGS=${W2_ARGS:-"--input-len 128 --output-len 32 --runs 3"}
# the checkpoint allows 131072 positions, whose one-request KV cache (4 GiB) the default budget refuses
ENGINE_ARGS=${ENGINE_ARGS:-"--max-model-len 1024"}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
run() {
    echo "== $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg): conveyor $*" >&2
    # shellcheck disable=SC2068
    flock "$BENCH_LOCK" timeout 3600 .venv/bin/conveyor $@ --results-dir "$OUT"
}
for format in "${@:-bf16 q8_0 q4_k_m q5_k_m}"; do
    for f in $format; do
        model="$CKPT/llama-1b-$f.gguf"
        [ -f "$model" ] || { echo "missing $model: run scripts/make_1b_benchmark_models.py" >&2; exit 1; }
        peers="llama-cpp"
        [ "$f" = bf16 ] && peers="llama-cpp openvino hf-generate"
        run bench throughput --model "$model" $ENGINE_ARGS $W1_ARGS --peer $peers
        for peer in $peers; do
            run bench latency --model "$model" $ENGINE_ARGS $W2_ARGS --peer "$peer"
        done
    done
done
