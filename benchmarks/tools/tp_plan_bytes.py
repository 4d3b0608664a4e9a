"""Bytes of step plans rank 0 sends to its tensor-parallel workers over one run (deterministic: no clock,
no lock). Runs with whichever checkout's package the interpreter imports, so base and branch compare:

    python benchmarks/tp_plan_bytes.py MODEL_DIR 1.1     # repetition penalty 1.1 (rows carry histories)
    /work/base/.venv/bin/python benchmarks/tp_plan_bytes.py MODEL_DIR 1.0
"""

from __future__ import annotations

import json
import random
import sys

from conveyor.llm import LLM
from conveyor.params import SamplingParams


def main() -> int:
    model, penalty = sys.argv[1], float(sys.argv[2])
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 40000) for _ in range(512)] for _ in range(64)]
    llm = LLM(model=model, tensor_parallel_size=2, max_num_seqs=64, max_model_len=600)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                                             repetition_penalty=penalty), use_tqdm=False)
        workers = llm.engine.runner.workers
        print(json.dumps({"repetition_penalty": penalty, "plans_sent": workers.plans_sent,
                          "plan_bytes_sent": workers.plan_bytes_sent,
                          "bytes_per_plan": round(workers.plan_bytes_sent / workers.plans_sent)}))
    finally:
        llm.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
