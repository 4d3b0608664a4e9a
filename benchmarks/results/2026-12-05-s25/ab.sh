#!/bin/bash
# ab.sh ROUNDS SCRIPT ARGS...: base (/work/exp, its own checkout and kernel build) and main (/work/main) alternating,
# each under /work/bench.lock, with main's venv; the last TAILN (2) lines of each run on one line.
rounds=$1; shift
for i in $(seq "$rounds"); do
  for tree in /work/exp /work/main; do
    echo "round $i $(basename $tree) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): $(cd $tree && PYTHONPATH=$tree flock /work/bench.lock /work/main/.venv/bin/python "$@" 2>&1 | tail -${TAILN:-2} | tr '\n' '|')"
  done
done
