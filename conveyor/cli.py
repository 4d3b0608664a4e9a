"""`conveyor generate | chat | serve | inspect | bench`: command-line entry points. Engine flags come from
EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from conveyor.config import (
    DTYPE_ALIASES,
    RENAMED_QUANTIZATIONS,
    SUPPORTED_DEVICES,
    SUPPORTED_DTYPES,
    SUPPORTED_GGUF_WEIGHTS,
    SUPPORTED_KERNELS,
    SUPPORTED_QUANTIZATIONS,
    SUPPORTED_TOOL_CALL_PARSERS,
    EngineConfig,
    field_docs,
)
from conveyor.errors import ConfigError, ConveyorError, InvalidRequestError
from conveyor.params import SamplingParams

_ENGINE_FLAG_NAMES = {"seed": "engine-seed"}  # --seed is the per-request sampling seed


def _engine_dest(name: str) -> str:
    """Where an engine field's flag lands in the namespace: renamed flags get their own name there, so that
    --engine-seed and the sampling --seed do not overwrite each other's values."""
    return _ENGINE_FLAG_NAMES[name].replace("-", "_") if name in _ENGINE_FLAG_NAMES else name


def _parse_async(value: str) -> bool | str:
    lowered = value.lower()
    if lowered in ("auto", "true", "false", "on", "off", "1", "0"):
        return "auto" if lowered == "auto" else lowered in ("true", "on", "1")
    raise argparse.ArgumentTypeError(f"{value!r} is not one of auto, true, false")


def _parse_size(value: str) -> str | float:
    try:
        return float(value) if float(value) <= 1 else value
    except ValueError:
        return value


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, typed from its default, documented from its docstring."""
    docs = field_docs()
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log engine details to stderr (also accepted before the command)",
    )
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + _ENGINE_FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
        help_text = (docs.get(f.name, "") + f" (default: {f.default})").replace(
            "%", "%%"
        )  # argparse formats help with %
        dest = _engine_dest(f.name)
        if f.name == "async_batching":
            group.add_argument(flag, dest=dest, type=_parse_async, default=f.default, help=help_text)
        elif f.name == "kv_cache_memory":
            group.add_argument(flag, dest=dest, type=_parse_size, default=f.default, help=help_text)
        elif isinstance(f.default, bool):
            group.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif f.name in ("dtype", "device", "quantization", "kernels", "tool_call_parser", "gguf_weights"):
            choices = {
                "dtype": [*SUPPORTED_DTYPES, *DTYPE_ALIASES],
                "device": list(SUPPORTED_DEVICES),
                "quantization": [*(q for q in SUPPORTED_QUANTIZATIONS if q), *RENAMED_QUANTIZATIONS],
                "kernels": list(SUPPORTED_KERNELS),
                "tool_call_parser": list(SUPPORTED_TOOL_CALL_PARSERS),
                "gguf_weights": list(SUPPORTED_GGUF_WEIGHTS),
            }[f.name]
            group.add_argument(flag, dest=dest, choices=choices, default=f.default, help=help_text)
        elif isinstance(f.default, float):
            group.add_argument(flag, dest=dest, type=float, default=f.default, help=help_text)
        elif isinstance(f.default, int) or f.name in ("max_model_len", "num_threads"):
            group.add_argument(flag, dest=dest, type=int, default=f.default, help=help_text)
        else:
            group.add_argument(flag, dest=dest, default=f.default, help=help_text)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, _engine_dest(f.name)) for f in dataclasses.fields(EngineConfig)})


def add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most (default: {max_tokens})"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1.0 = off")
    group.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    group.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this share of the top token's probability; 0 = off"
    )
    group.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="a string that ends a reply (repeat the flag for several)",
    )
    group.add_argument("--stop-token-ids", type=int, nargs="*", default=[], help="extra token ids that end a reply")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=getattr(args, "n", 1),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=list(args.stop),
        stop_token_ids=tuple(args.stop_token_ids),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Continuous-batching LLM inference engine.", allow_abbrev=False
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="answer one or more prompts and exit", allow_abbrev=False)
    gen.add_argument("prompts", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is (default: wrap it in the model's chat template, when it has one)",
    )
    gen.add_argument("-n", type=int, default=1, help="completions per prompt (sample with --temperature > 0)")
    add_sampling_flags(gen, max_tokens=256)
    add_engine_flags(gen)

    gen.add_argument("--trace", default=None, help="write a Chrome trace-event JSON of the run (Perfetto)")

    chat = commands.add_parser("chat", help="interactive chat with history; Ctrl-D or /exit leaves", allow_abbrev=False)
    chat.add_argument("--system", default=None, help="system message placed first in the conversation")
    add_sampling_flags(chat, max_tokens=512)
    add_engine_flags(chat)

    srv = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (the default model when none is given)", allow_abbrev=False
    )
    from conveyor.server.main import add_serve_flags

    add_serve_flags(srv)
    add_engine_flags(srv)

    insp = commands.add_parser(
        "inspect",
        help="what a GGUF file or HF folder is and whether Conveyor runs it (reads metadata only, loads no weights)",
        allow_abbrev=False,
    )
    insp.add_argument("paths", nargs="+", help=".gguf files or Hugging Face checkpoint folders")

    from conveyor.bench.commands import add_bench_parser

    add_bench_parser(commands, add_engine_flags)
    return parser


def _one_engine(config: EngineConfig, command: str) -> EngineConfig:
    if config.data_parallel_size > 1:
        raise ConfigError(
            f"`conveyor {command}` runs one engine (data_parallel_size={config.data_parallel_size} "
            f"asked for replicas); use `conveyor serve --data-parallel-size N` or "
            f"LLM(data_parallel_size=N)"
        )
    return config


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.llm import LLM

    params = sampling_params_from(args)
    config = _one_engine(engine_config_from(args), "generate")
    llm = LLM(**dataclasses.asdict(config))
    has_template = llm.get_tokenizer() is not None and bool(getattr(llm.get_tokenizer(), "chat_template", None))
    prompts = [
        p if args.raw or not has_template else llm.apply_chat_template([{"role": "user", "content": p}])
        for p in args.prompts
    ]
    if args.trace:
        llm.engine.start_trace()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    if args.trace:
        llm.engine.save_trace(args.trace)
        print(f"[trace written to {args.trace}; open it in https://ui.perfetto.dev]", file=sys.stderr)
    total = 0
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            total += len(completion.token_ids)
            if len(outputs) > 1 or len(out.outputs) > 1:
                print(f"### {prompt}" + (f" [sample {completion.index + 1}]" if len(out.outputs) > 1 else ""))
            print(completion.text.strip() if not args.raw else completion.text)
            ttft = out.metrics.get("ttft_s")
            print(
                f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}"
                + (f", time to first token {ttft * 1000:.0f} ms" if ttft is not None else "")
                + "]",
                file=sys.stderr,
            )
    print(f"[{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from conveyor.engine.engine import Engine
    from conveyor.llm import LLM

    params = sampling_params_from(args)
    config = _one_engine(engine_config_from(args), "chat")
    llm = LLM(**dataclasses.asdict(config))
    engine: Engine = llm.engine
    history: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model. Ctrl-D or /exit leaves; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = _fit_history(llm, history, params.max_tokens)
            if prompt is None:
                raise InvalidRequestError(
                    f"that message alone does not fit the {engine.max_model_len}-token "
                    f"context (--max-model-len); send a shorter one"
                )
            request_id = engine.add_request(prompt, params)
        except InvalidRequestError as exc:  # this message is refused; the conversation goes on without it
            history.pop()
            print(f"conveyor: {exc}", file=sys.stderr)
            continue
        shown = 0
        text = ""
        sys.stdout.write("bot> ")
        try:
            while engine.has_work():
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    sys.stdout.write(text[shown:])
                    sys.stdout.flush()
                    shown = len(text)
        except KeyboardInterrupt:
            engine.abort(request_id)
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": text})


def _fit_history(llm: Any, history: list[dict[str, Any]], max_tokens: int | None) -> str | None:
    """The templated conversation, dropping its oldest exchanges (user message and reply together, never the
    system message or the newest message) until it leaves room for a reply: max_tokens, or half the context
    when that is less. Trims `history` only when the result fits; None (history untouched) when even the
    newest message alone does not."""
    engine = llm.engine
    room = min(max_tokens or engine.max_model_len, engine.max_model_len // 2)
    first = 1 if history and history[0]["role"] == "system" else 0
    kept = list(history)
    while True:
        prompt = llm.apply_chat_template(kept)
        if len(engine.tokenize(prompt)) + room <= engine.max_model_len:
            break
        if len(kept) - first <= 1:
            return None
        del kept[first : first + 2 if len(kept) - first > 2 else first + 1]  # an exchange: user, then its reply
    if len(kept) < len(history):
        print(
            f"(the {len(history) - len(kept)} oldest message(s) left the conversation to fit the "
            f"{engine.max_model_len}-token context)",
            file=sys.stderr,
        )
        history[:] = kept
    return prompt


def cmd_inspect(args: argparse.Namespace) -> int:
    """Prints each model's summary; exit status 1 when Conveyor refuses any of them."""
    from conveyor.model.inspect import inspect_model
    from conveyor.model.isa import describe_this_cpu

    summaries = [inspect_model(path) for path in args.paths]
    print("\n\n".join(s.render() for s in summaries))
    print(f"\nthis CPU: {describe_this_cpu()}")
    return 0 if all(s.runs for s in summaries) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "serve":
            config = engine_config_from(args)
            if config.data_parallel_size > 1:  # replicas on Ray behind a routing front
                from conveyor.data_parallel.serving.serve_replicas import serve_data_parallel

                return serve_data_parallel(args, config)
            from conveyor.server.main import serve

            return serve(args, config)
        if args.command == "inspect":
            return cmd_inspect(args)
        if args.command == "bench":
            from conveyor.bench.commands import cmd_bench

            return cmd_bench(args, None if args.bench_command in ("serve", "soak") else engine_config_from(args))
        return cmd_chat(args)
    except ConveyorError as exc:
        print(f"conveyor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
