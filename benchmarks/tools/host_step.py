"""How much host time (schedule + prepare + commit, the forward excluded) does a decode step take, with penalties
on or off?

Uses only conveyor.bench.decode_step's helpers, so the same file runs against two checkouts (PYTHONPATH) for a
side-by-side comparison. Prints one JSON line: the median host milliseconds per step and its parts, and the
median step time. A 2-layer random-weight model (scripts/make_random_checkpoint.py TINY --shape llama-tiny)
makes the host's part show.

    .venv/bin/python benchmarks/tools/host_step.py --model TINY --num-seqs 256 --prompt-len 512 --steps 16 \
        --repetition-penalty 1.1 --kv-cache-memory 512MiB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from conveyor.bench.decode_step import host_ms_per_step, timed_decode_steps
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded one)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0: no penalty (no histories)")
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV cache bytes (e.g. 512MiB); make it hold every sequence, else preemption mixes in",
    )
    args = parser.parse_args()
    options = dict(
        max_num_seqs=args.num_seqs,
        max_model_len=args.prompt_len + 2 * args.steps + 2 * args.num_seqs,
        max_num_batched_tokens=max(2048, args.prompt_len),
        kv_cache_memory=args.kv_cache_memory,
    )
    config = EngineConfig(**options) if args.model is None else EngineConfig(model=args.model, **options)
    engine = Engine(config)
    prompts = random_workload(args.num_seqs, (args.prompt_len, args.prompt_len), (1, 1), engine.spec.vocab_size).prompts
    prefill_steps = -(-args.num_seqs * args.prompt_len // options["max_num_batched_tokens"])
    params = SamplingParams(
        max_tokens=prefill_steps + args.steps + 8,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=args.repetition_penalty,
    )  # none ends before the timed steps do
    since = engine.timeline.now()
    step_seconds = timed_decode_steps(engine, prompts, [params] * args.num_seqs, args.steps)
    host = host_ms_per_step(engine.timeline.since(since), args.steps)
    preemptions = engine.stats().num_preemptions
    engine.close()
    print(
        json.dumps(
            {
                "preemptions": preemptions,
                "checkout": os.path.dirname(os.path.dirname(os.path.abspath(sys.executable))),
                "num_seqs": args.num_seqs,
                "prompt_len": args.prompt_len,
                "steps": args.steps,
                "repetition_penalty": args.repetition_penalty,
                "async_batching": engine.async_batching,
                "host_ms_per_step": round(sum(host.values()), 3),
                "host_ms_per_step_parts": {k: round(v, 3) for k, v in host.items()},
                "step_ms_median": round(statistics.median(step_seconds) * 1e3, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
