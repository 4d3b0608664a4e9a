#!/bin/bash
# ab2.sh ROUNDS GREP SCRIPT ARGS...: base (/work/exp) and main (/work/main) alternating under /work/bench.lock, main's
# venv; the lines of each run matching GREP on one line.
rounds=$1; pat=$2; shift 2
for i in $(seq "$rounds"); do
  for tree in /work/exp /work/main; do
    echo "round $i $(basename $tree) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg): $(cd $tree && PYTHONPATH=$tree flock /work/bench.lock /work/main/.venv/bin/python "$@" 2>&1 | grep -E "$pat" | tr '\n' '|')"
  done
done
