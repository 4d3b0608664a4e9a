"""How many bytes of step plans does tensor-parallel rank 0 send its workers over one run?

Deterministic (no clock): TP=2, 64 requests of 512 random tokens, 32 new tokens each, with the repetition
penalty given (rows with penalties carry their histories). Prints one JSON line.

    .venv/bin/python benchmarks/tools/tp_plan_bytes.py MODEL_DIR 1.1
    .venv/bin/python benchmarks/tools/tp_plan_bytes.py MODEL_DIR 1.0
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
        llm.generate(
            prompts,
            SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=penalty),
            use_tqdm=False,
        )
        workers = llm.engine.runner.workers
        print(
            json.dumps(
                {
                    "repetition_penalty": penalty,
                    "plans_sent": workers.plans_sent,
                    "plan_bytes_sent": workers.plan_bytes_sent,
                    "bytes_per_plan": round(workers.plan_bytes_sent / workers.plans_sent),
                }
            )
        )
    finally:
        llm.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
