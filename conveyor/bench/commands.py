"""`conveyor bench throughput | latency | serve | soak | tp | decode-step | structured | async-vs-sync`."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

from conveyor.bench.peers import PEERS
from conveyor.bench.soak_command import add_soak_parser, cmd_soak
from conveyor.bench.workloads import Workload, random_workload, shared_prefix_workload
from conveyor.errors import ConfigError


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


def _count(text: str) -> int:
    """A whole number >= 1 (prompts, runs, sequences, lengths)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_parser(commands: Any, add_engine_flags: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (results as JSON, baselines, plots)", allow_abbrev=False)
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    tp = kinds.add_parser(
        "throughput", help="offline throughput; --peer runs the same workload on a peer", allow_abbrev=False
    )
    tp.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    tp.add_argument("--num-prompts", type=_count, default=64)
    tp.add_argument("--input-len", type=_range, default=(32, 256), help="prompt length or range LOW:HIGH")
    tp.add_argument("--output-len", type=_range, default=(128, 128), help="output length or range LOW:HIGH")
    tp.add_argument("--prefix-len", type=_count, default=512, help="shared-prefix workload: shared system prompt")
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--runs", type=_count, default=1, help="timed runs (the median is reported)")
    tp.add_argument(
        "--peer",
        nargs="*",
        default=[],
        choices=PEERS,
        help="peers run after ours, in the same process, on the same workload (transformers in the "
        "dtype ours computes in)",
    )
    tp.add_argument("--peer-batch-size", type=_count, default=32, help="hf-generate static batch size")
    tp.add_argument("--trace", default=None, help="write a Chrome trace-event JSON of the run (Perfetto)")
    _add_result_flags(tp)
    add_engine_flags(tp)

    lat = kinds.add_parser(
        "latency", help="one request: time to first token and time per output token", allow_abbrev=False
    )
    lat.add_argument("--input-len", type=_count, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--runs", type=_count, default=3)
    lat.add_argument("--peer", nargs="*", default=[], choices=[p for p in PEERS if p != "hf-continuous"])
    _add_result_flags(lat)
    add_engine_flags(lat)

    sv = kinds.add_parser(
        "serve", help="load a running OpenAI-compatible server (ours or any other)", allow_abbrev=False
    )
    sv.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    sv.add_argument("--concurrency", type=_count, nargs="+", default=[1, 8, 32, 64], help="clients (a sweep)")
    sv.add_argument("--duration", type=float, default=None, help="seconds per concurrency level")
    sv.add_argument("--num-requests", type=_count, default=None, help="requests per level (default 4 x concurrency)")
    sv.add_argument("--input-len", type=_range, default=(32, 128))
    sv.add_argument("--output-len", type=_count, default=64)
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--model", default=None)
    sv.add_argument("--server-pid", type=int, default=None, help="sample this process's resident memory")
    sv.add_argument("--out", default=None, help="write results as JSON here")
    sv.add_argument("--plot", default=None, help="PNG prefix: throughput-vs-concurrency and latency CDF")

    tpp = kinds.add_parser(
        "tp",
        help="tensor parallelism: gloo all-reduce latency, decode step time per "
        "tensor-parallel size, and the across-machines model",
        allow_abbrev=False,
    )
    tpp.add_argument("--sizes", type=_count, nargs="+", default=[1, 2], help="tensor-parallel sizes to time")
    tpp.add_argument("--num-seqs", type=_count, default=8)
    tpp.add_argument("--prompt-len", type=_count, default=64)
    tpp.add_argument("--steps", type=_count, default=20)
    tpp.add_argument("--rounds", type=_count, default=2, help="the sizes are alternated this many times")
    tpp.add_argument("--iters", type=_count, default=200, help="repetitions of each collective")
    _add_result_flags(tpp)
    add_engine_flags(tpp)

    ds = kinds.add_parser(
        "decode-step",
        help="one decode step: time, achieved FLOP/s and its share of the "
        "measured matmul peaks (float32's and the step dtype's)",
        allow_abbrev=False,
    )
    ds.add_argument("--num-seqs", type=_count, default=64, help="running sequences, all decoding")
    ds.add_argument("--prompt-len", type=_count, default=128)
    ds.add_argument("--steps", type=_count, default=16, help="timed decode steps (the median is reported)")
    ds.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="every request's repetition penalty; other than 1.0, each row carries its token history "
        "(the host's per-step cost of penalties)",
    )
    _add_result_flags(ds)
    add_engine_flags(ds)

    so = kinds.add_parser(
        "structured",
        help="structured output's cost: a decode step with every row JSON-constrained "
        "against the unconstrained step (async and sync), and compile times",
        allow_abbrev=False,
    )
    so.add_argument("--num-seqs", type=_count, default=64, help="running sequences, all decoding")
    so.add_argument("--prompt-len", type=_count, default=64)
    so.add_argument("--steps", type=_count, default=8, help="timed decode steps per round and kind")
    so.add_argument("--rounds", type=_count, default=3, help="alternating rounds (unconstrained, then JSON)")
    so.add_argument("--num-schemas", type=_count, default=200, help="random schemas whose compile time is measured")
    _add_result_flags(so)
    add_engine_flags(so)

    add_soak_parser(kinds, _count)

    cmp_ = kinds.add_parser(
        "async-vs-sync", help="async against sync batching, alternating runs, medians", allow_abbrev=False
    )
    cmp_.add_argument("--runs", type=_count, default=5, help="runs per mode per workload (alternating)")
    cmp_.add_argument("--trace", default=None, help="also trace one async run per workload to FILE-<w>-async.json")
    cmp_.add_argument("--out", default="benchmarks/async_vs_sync.json")
    add_engine_flags(cmp_)


def _add_result_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", default="results", help="every result is saved here as JSON")
    parser.add_argument("--save-baseline", default=None, metavar="NAME", help="also save as benchmarks/baselines/NAME")
    parser.add_argument("--compare-to", default=None, metavar="NAME", help="compare with a saved baseline")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart against the peers here")


def cmd_bench(args: argparse.Namespace, config: Any) -> int:
    if args.bench_command == "serve":
        return _serve(args)
    if args.bench_command == "soak":
        return cmd_soak(args)
    if args.bench_command == "async-vs-sync":
        from conveyor.bench.async_compare import compare, markdown_table, save

        report = compare(config, runs=args.runs, trace_path=args.trace)
        report["command"] = "conveyor " + " ".join(sys.argv[1:])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        save(report, args.out)
        print(markdown_table(report))
        print(f"[saved {args.out}]", file=sys.stderr)
        return 0
    if args.compare_to:  # fail before minutes of benchmarking, not after
        from conveyor.bench.results import load_baseline

        load_baseline(args.compare_to)
    if args.bench_command == "latency":
        return _latency(args, config)
    if args.bench_command == "decode-step":
        return _decode_step(args, config)
    if args.bench_command == "tp":
        return _tp(args, config)
    if args.bench_command == "structured":
        return _structured(args, config)
    return _throughput(args, config)


def _finish(args: argparse.Namespace, result: dict[str, Any], kind: str) -> None:
    from conveyor.bench.async_compare import machine_facts
    from conveyor.bench.results import compare_line, load_baseline, save_baseline, save_result

    result["machine"] = machine_facts()
    result["command"] = "conveyor " + " ".join(sys.argv[1:])
    path = save_result(result, args.results_dir, kind)
    print(f"[saved {path}]", file=sys.stderr)
    if args.save_baseline:
        print(f"[baseline saved: {save_baseline(result, args.save_baseline)}]", file=sys.stderr)
    if args.compare_to and "output_tokens_per_s" in result:
        print(compare_line(result, load_baseline(args.compare_to), args.compare_to))


def _run_ours(engine: Any, workload: Workload) -> tuple[float, Any, Any, list[list[int]]]:
    """-> (seconds, stats before, stats after, each request's output tokens in workload order)."""
    before = engine.stats()
    start = time.perf_counter()
    # admitted as LLM.generate admits them: one output per request, at its end (as the peers return theirs)
    ids = [
        engine.add_request(prompt, params, final_only=True) for prompt, params in zip(workload.prompts, workload.params)
    ]
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return time.perf_counter() - start, before, engine.stats(), [tokens.get(i, []) for i in ids]


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Greedy outputs of the same prompts compared: the share of requests whose tokens are all equal, and the mean
    share of each request's tokens before the first difference (random-weight models part at near-ties)."""
    pairs = list(zip(ours, theirs, strict=True))
    common = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), min(len(o), len(t))) for o, t in pairs]
    return {
        "identical_requests": sum(o == t for o, t in pairs) / len(pairs),
        "mean_prefix_share": sum(c / max(1, len(o)) for c, (o, _) in zip(common, pairs)) / len(pairs),
    }


def _throughput(args: argparse.Namespace, config: Any) -> int:
    import resource

    from conveyor.bench.peers import check_peer, run_hf_continuous, run_hf_generate, run_llama_cpp, run_openvino
    from conveyor.engine.engine import Engine

    engine = Engine(config)
    vocab = engine.spec.vocab_size
    if args.workload == "shared-prefix":
        workload = shared_prefix_workload(
            args.num_prompts, args.prefix_len, args.input_len, args.output_len, vocab, seed=args.workload_seed
        )
    else:
        workload = random_workload(args.num_prompts, args.input_len, args.output_len, vocab, seed=args.workload_seed)
    engine.add_request(workload.prompts[0][:8], workload.params[0].clone(max_tokens=2))  # warm-up
    while engine.has_work():
        engine.step()
    runs = []
    for i in range(args.runs):
        engine.reset_prefix_cache()
        if args.trace and i == args.runs - 1:
            engine.start_trace()
        runs.append(_run_ours(engine, workload))
    if args.trace:
        engine.save_trace(args.trace)
    engine.close()
    seconds = statistics.median(r[0] for r in runs)
    _, before, after, our_tokens = runs[-1]
    busy, active = after.device_busy_s - before.device_busy_s, after.active_s - before.active_s
    ours = workload.num_output_tokens / seconds
    result: dict[str, Any] = {
        "workload": {
            "name": args.workload,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.workload_seed,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "engine": {
            "dtype": engine.dtype,
            "quantization": config.quantization,
            "kv_cache_dtype": config.kv_cache_dtype,
            "async_batching": engine.async_batching,
            "prefix_caching": config.enable_prefix_caching,
        },
        "runs_seconds": [r[0] for r in runs],
        "seconds": seconds,
        "requests_per_s": args.num_prompts / seconds,
        "output_tokens_per_s": ours,
        "total_tokens_per_s": (workload.num_output_tokens + workload.num_prompt_tokens) / seconds,
        "device_idle_fraction": max(0.0, 1 - busy / active) if active else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peers": {},
    }
    model_path, dtype = engine.model_source, engine.dtype
    del engine  # a 1B model's weights leave before a peer loads its own
    gc.collect()
    for peer in args.peer:
        reason = check_peer(peer, model_path)
        if reason is not None:
            print(f"[peer {peer} skipped: {reason}]", file=sys.stderr)
            result["peers"][peer] = {"skipped": reason}
            continue
        try:
            if peer == "hf-generate":
                pr = run_hf_generate(model_path, workload, args.peer_batch_size, dtype)
            elif peer == "hf-continuous":
                pr = run_hf_continuous(model_path, workload, dtype)
            elif peer == "openvino":
                pr = run_openvino(
                    model_path,
                    workload,
                    dtype,
                    _threads(config),
                    config.max_num_seqs,
                    config.max_num_batched_tokens,
                    config.kv_cache_dtype,
                )
            else:
                pr = run_llama_cpp(model_path, workload, _threads(config))
        except Exception as exc:  # a failing peer costs its own row, not our measurement or the other peers'
            failure = f"{type(exc).__name__}: {exc}"
            print(f"[peer {peer} failed: {failure}]", file=sys.stderr)
            result["peers"][peer] = {"failed": failure}
            continue
        note = pr.note
        if config.kv_cache_dtype == "int8" and peer != "openvino":  # OpenVINO got its own 8-bit cache; these have none
            note += "; an exact KV cache against our int8 one (not like for like)"
        result["peers"][peer] = {
            "seconds": pr.seconds,
            "output_tokens": pr.output_tokens,
            "output_tokens_per_s": pr.output_tokens_per_s,
            "note": note,
            "conveyor_over_peer": ours / pr.output_tokens_per_s if pr.output_tokens_per_s else None,
        }
        if pr.tokens is not None:  # how far the peer computes what we compute (greedy, the same prompts)
            result["peers"][peer]["tokens_agreement"] = token_agreement(our_tokens, pr.tokens)
    print(json.dumps(result, indent=2))
    if args.plot:
        from conveyor.bench.results import plot_throughput

        bars = {"conveyor": ours} | {
            p: v["output_tokens_per_s"] for p, v in result["peers"].items() if "output_tokens_per_s" in v
        }
        print(
            f"[plot {plot_throughput(bars, args.plot, f'{args.workload}: {args.num_prompts} requests')}]",
            file=sys.stderr,
        )
    _finish(args, result, "throughput")
    return 0


def _threads(config: Any) -> int:
    """CPU threads a peer gets: the engine's own setting, else every core."""
    return config.num_threads or os.cpu_count() or 2


def _decode_step(args: argparse.Namespace, config: Any) -> int:
    from conveyor.bench.decode_step import measure_decode_step

    result = measure_decode_step(config, args.num_seqs, args.prompt_len, args.steps, args.repetition_penalty)
    print(json.dumps({k: v for k, v in result.items() if k != "step_ms_all"}, indent=2))
    _finish(args, result, "decode-step")
    return 0


def _tp(args: argparse.Namespace, config: Any) -> int:
    from conveyor.bench.tp import measure_collectives, measure_decode, scaling_model
    from conveyor.model.loader import load_model, model_path, resolve_dtype

    spec = load_model(
        config.model, resolve_dtype(config.dtype, model_path(config.model), "cpu", config.quantization)
    ).spec
    result: dict[str, Any] = {"model_hidden": spec.hidden_size, "model_vocab": spec.vocab_size}
    result.update(measure_collectives(spec.hidden_size, spec.vocab_size, args.iters))
    result.update(measure_decode(config, args.sizes, args.num_seqs, args.prompt_len, args.steps, args.rounds))
    result["scaling_model"] = [
        row for tp, batch in ((2, 1), (2, 64), (8, 1), (8, 64)) for row in scaling_model(tp, batch)
    ]
    print(json.dumps({k: v for k, v in result.items() if k != "scaling_model"}, indent=2))
    _finish(args, result, "tp")
    return 0


def _structured(args: argparse.Namespace, config: Any) -> int:
    from conveyor.bench.structured_cost import measure_compile_times, measure_step_cost

    result = measure_step_cost(config, args.num_seqs, args.prompt_len, args.steps, args.rounds)
    result["compile"] = measure_compile_times(config, args.num_schemas)
    shown = {k: v for k, v in result.items() if k not in ("modes", "schemas")}
    shown["modes"] = {m: {k: v for k, v in r.items() if not k.endswith("_all_ms")} for m, r in result["modes"].items()}
    print(json.dumps(shown, indent=2))
    _finish(args, result, "structured")
    return 0


def _latency(args: argparse.Namespace, config: Any) -> int:
    from conveyor.bench.latency import ConveyorLatency, LatencyRunner, interleaved
    from conveyor.bench.peers import check_peer
    from conveyor.engine.engine import Engine

    if args.output_len < 2:
        raise ConfigError(f"--output-len must be at least 2 to measure time per output token, got {args.output_len}")
    engine = Engine(config)
    prompt = random_workload(1, (args.input_len, args.input_len), (1, 1), engine.spec.vocab_size).prompts[0]
    runners: dict[str, LatencyRunner] = {"conveyor": ConveyorLatency(engine, prompt, args.output_len)}
    result: dict[str, Any] = {
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": engine.dtype,
        "quantization": config.quantization,
        "kv_cache_dtype": config.kv_cache_dtype,
        "runs": args.runs,
        "interleaved": "a warm-up run each, then rounds of one run per contestant",
        "peers": {},
    }
    for peer in args.peer:
        reason = check_peer(peer, engine.model_source)
        if reason is not None:
            print(f"[peer {peer} skipped: {reason}]", file=sys.stderr)
            result["peers"][peer] = {"skipped": reason}
            continue
        try:
            runners[peer] = _latency_peer(peer, engine, prompt, args.output_len, config)
        except Exception as exc:  # a peer that cannot start costs its own row only
            failure = f"{type(exc).__name__}: {exc}"
            print(f"[peer {peer} failed: {failure}]", file=sys.stderr)
            result["peers"][peer] = {"failed": failure}
    measured = interleaved(runners, args.runs)
    result.update(measured.pop("conveyor"))
    result["peers"].update(measured)
    print(json.dumps(result, indent=2))
    _finish(args, result, "latency")
    return 0


def _latency_peer(peer: str, engine: Any, prompt: list[int], output_len: int, config: Any) -> Any:
    from conveyor.bench.latency import HFGenerateLatency

    if peer == "llama-cpp":
        from conveyor.bench.llama_cpp_peer import LlamaCppLatency

        return LlamaCppLatency(engine.model_source, prompt, output_len, _threads(config))
    if peer == "openvino":
        from conveyor.bench.openvino_peer import OpenVINOLatency

        return OpenVINOLatency(
            engine.model_source,
            prompt,
            output_len,
            engine.dtype,
            _threads(config),
            config.max_num_batched_tokens,
            config.kv_cache_dtype,
        )
    return HFGenerateLatency(engine.model_source, prompt, output_len, engine.dtype)  # the parser allows no other


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from conveyor.bench.async_compare import machine_facts
    from conveyor.bench.serve import markdown, run_load

    results = []
    for concurrency in args.concurrency:
        count = args.num_requests if args.num_requests is not None else (None if args.duration else 4 * concurrency)
        result = asyncio.run(
            run_load(
                args.url,
                concurrency,
                args.duration,
                count,
                args.input_len,
                args.output_len,
                args.api_key,
                args.model,
                server_pid=args.server_pid,
            )
        )
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("errors", "e2e_values")}), file=sys.stderr)
    print(markdown(results))
    if args.plot:
        from conveyor.bench.results import plot_serve

        paths = plot_serve(results, {r["concurrency"]: r.get("e2e_values", []) for r in results}, args.plot)
        print(f"[plots {', '.join(paths)}]", file=sys.stderr)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {"machine": machine_facts(), "command": "conveyor " + " ".join(sys.argv[1:]), "results": results},
                f,
                indent=2,
            )
    return 0 if all(r["failed"] == 0 for r in results) else 1
