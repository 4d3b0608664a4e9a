#!/usr/bin/env bash
# Two clones of this repository at different paths run `bash scripts/run.sh` alternately, 4 times in all,
# sharing one fresh kernel cache ($TORCH_EXTENSIONS_DIR): the native kernels must be compiled at most once.
# The first start finds no build and starts one in the background (its log in the cache folder); the runs then
# use torch's ops until it is there. Slow (each clone sets up its own .venv); not part of the test suite, whose
# tests/model/test_native_build.py shows the same with copies of the package. Usage: bash scripts/check_kernel_cache.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export TORCH_EXTENSIONS_DIR="$work/extensions"
git clone -q "$repo" "$work/clone-a"
git clone -q "$repo" "$work/clone-b"
builds=0
for clone in clone-a clone-b clone-a clone-b; do
    start=$(date +%s)
    log="$(bash "$work/$clone/scripts/run.sh" generate "What is 2 + 2?" --max-tokens 8 2>&1)"
    count=$(grep -c "native kernels: compiling" <<< "$log" || true)
    builds=$((builds + count))
    echo "$clone: $(( $(date +%s) - start )) s, kernel builds: $count"
done
# builds started in the background log to the cache folder; wait for any still running (its lock), then count them
for lock in "$TORCH_EXTENSIONS_DIR"/*.lock; do [ -e "$lock" ] && flock "$lock" true; done
for log in "$TORCH_EXTENSIONS_DIR"/*.log; do
    [ -e "$log" ] || continue
    builds=$((builds + $(grep -c "native kernels: compiling" "$log" || true)))
done
echo "kernel builds in all: $builds"
[ "$builds" -le 1 ] || { echo "FAIL: the kernels were built more than once" >&2; exit 1; }
