"""`conveyor bench throughput | async-vs-sync`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from conveyor.bench.workloads import random_workload


def _range(text: str) -> tuple[int, int]:
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length or a range like 32:256") from None
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length or a range like 32:256 (low <= high, >= 1)")
    return parts[0], parts[1]


def add_bench_parser(commands: Any, add_engine_flags: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (results as JSON)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser("throughput", help="offline throughput on a random-token workload")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=_range, default=(32, 256), help="prompt length or range LOW:HIGH")
    tp.add_argument("--output-len", type=_range, default=(128, 128), help="output length or range LOW:HIGH")
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--trace", default=None, help="write a Chrome trace-event JSON of the run (Perfetto)")
    tp.add_argument("--out", default=None, help="write the result as JSON here")
    add_engine_flags(tp)

    sv = kinds.add_parser("serve", help="load a running OpenAI-compatible server (ours or any other)")
    sv.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    sv.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64], help="clients (a sweep)")
    sv.add_argument("--duration", type=float, default=None, help="seconds per concurrency level")
    sv.add_argument("--num-requests", type=int, default=None, help="requests per level (default 4 x concurrency)")
    sv.add_argument("--input-len", type=_range, default=(32, 128))
    sv.add_argument("--output-len", type=int, default=64)
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--model", default=None)
    sv.add_argument("--server-pid", type=int, default=None, help="sample this process's resident memory")
    sv.add_argument("--out", default=None, help="write results as JSON here")

    cmp_ = kinds.add_parser("async-vs-sync", help="async against sync batching, alternating runs, medians")
    cmp_.add_argument("--runs", type=int, default=5, help="runs per mode per workload (alternating)")
    cmp_.add_argument("--trace", default=None, help="also trace one async run per workload to FILE-<w>-async.json")
    cmp_.add_argument("--out", default="benchmarks/async_vs_sync.json")
    add_engine_flags(cmp_)


def cmd_bench(args: argparse.Namespace, config: Any) -> int:
    if args.bench_command == "serve":
        return _serve(args)
    if args.bench_command == "async-vs-sync":
        from conveyor.bench.async_compare import compare, markdown_table, save

        report = compare(config, runs=args.runs, trace_path=args.trace)
        report["command"] = "conveyor " + " ".join(sys.argv[1:])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        save(report, args.out)
        print(markdown_table(report))
        print(f"[saved {args.out}]", file=sys.stderr)
        return 0
    return _throughput(args, config)


def _throughput(args: argparse.Namespace, config: Any) -> int:
    from conveyor.bench.async_compare import machine_facts
    from conveyor.engine.engine import Engine

    engine = Engine(config)
    workload = random_workload(args.num_prompts, args.input_len, args.output_len, engine.spec.vocab_size,
                               seed=args.workload_seed)
    engine.add_request(workload.prompts[0][:8], workload.params[0].clone(max_tokens=2))  # warm-up
    while engine.has_work():
        engine.step()
    if args.trace:
        engine.start_trace()
    before = engine.stats()
    start = time.perf_counter()
    for prompt, params in zip(workload.prompts, workload.params):
        engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    after = engine.stats()
    engine.close()
    if args.trace:
        engine.save_trace(args.trace)
    busy, active = after.device_busy_s - before.device_busy_s, after.active_s - before.active_s
    result = {"workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                           "output_len": args.output_len, "seed": args.workload_seed},
              "async_batching": engine.async_batching, "seconds": seconds,
              "requests_per_s": args.num_prompts / seconds,
              "output_tokens_per_s": workload.num_output_tokens / seconds,
              "total_tokens_per_s": (workload.num_output_tokens + workload.num_prompt_tokens) / seconds,
              "device_idle_fraction": max(0.0, 1 - busy / active) if active else 0.0,
              "preemptions": after.num_preemptions - before.num_preemptions,
              "machine": machine_facts(), "command": "conveyor " + " ".join(sys.argv[1:])}
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine",)}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from conveyor.bench.async_compare import machine_facts
    from conveyor.bench.serve import markdown, run_load

    results = []
    for concurrency in args.concurrency:
        count = args.num_requests if args.num_requests is not None else (None if args.duration else 4 * concurrency)
        result = asyncio.run(run_load(args.url, concurrency, args.duration, count, args.input_len, args.output_len,
                                      args.api_key, args.model, server_pid=args.server_pid))
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "errors"}), file=sys.stderr)
    print(markdown(results))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"machine": machine_facts(), "command": "conveyor " + " ".join(sys.argv[1:]),
                       "results": results}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in results) else 1
