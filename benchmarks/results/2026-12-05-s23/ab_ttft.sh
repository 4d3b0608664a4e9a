#!/bin/bash
# TTFT of long prompts, base (/work/exp, c9deb43) against main, alternating; default model and the 1B bf16 folder
for r in 1 2; do
  for tree in /work/exp /work/main; do
    for len in 2048 4000; do
      echo "== $tree round $r input $len default $(date +%T)"
      cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python -c "import sys; from conveyor.cli import main; sys.exit(main())" bench latency --input-len $len --output-len 4 --runs 3 --max-model-len 4096 --results-dir /tmp/ttft 2>&1 | grep -A3 "\"ttft_runs_s\"" | tr -d "\n "; echo
    done
    echo "== $tree round $r input 2048 1B bf16 $(date +%T)"
    cd $tree && PYTHONPATH=$tree timeout 600 /work/main/.venv/bin/python -c "import sys; from conveyor.cli import main; sys.exit(main())" bench latency --model /work/ckpt/llama-1b --input-len 2048 --output-len 4 --runs 3 --max-model-len 4096 --results-dir /tmp/ttft 2>&1 | grep -A3 "\"ttft_runs_s\"" | tr -d "\n "; echo
  done
done
