#!/bin/bash
# The default W1 against OpenVINO GenAI, base (/work/exp) and main alternating, each with its own OpenVINO run.
out=${OUT:-/tmp/w1peer}
for r in $(seq ${ROUNDS:-2}); do
  for tree in /work/exp /work/main; do
    echo "== $(basename $tree) round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    cd $tree && PYTHONPATH=$tree flock /work/bench.lock /work/main/.venv/bin/python -c "import sys; from conveyor.cli import main; sys.exit(main())" bench throughput --runs 3 --peer openvino --results-dir $out 2>&1 | grep -E '^  "output_tokens_per_s"|"conveyor_over_peer"|^      "output_tokens_per_s"' | tr -d '\n'; echo
  done
done
