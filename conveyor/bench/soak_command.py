"""`conveyor bench soak`: its flags, and the run (a server of its own unless given --url), report and exit status."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from typing import Any

from conveyor.bench.soak import RSS_BOUND_MIB, SoakConfig, run_soak, text_report
from conveyor.bench.soak_server import local_server


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return value


def add_soak_parser(kinds: Any, count: Any) -> None:
    soak = kinds.add_parser(
        "soak",
        help="N clients for a while against one server, well-formed and malformed requests mixed; fails unless "
        "every well-formed request completed, every bad one got a 4xx, nothing was lost, the server ended idle "
        "with bounded memory growth and the same greedy answer",
        allow_abbrev=False,
    )
    soak.add_argument("--clients", type=count, default=48, help="concurrent clients, each on one keep-alive connection")
    soak.add_argument("--duration", type=_positive, default=600.0, help="seconds of load (new requests stop then)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    soak.add_argument("--url", default=None, help="soak this running server instead of starting one")
    soak.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for its memory")
    soak.add_argument("--model", default=None, help="the model the started server serves (default: the embedded one)")
    soak.add_argument(
        "--max-model-len", type=count, default=4096, help="the started server's (and the too-long test's)"
    )
    soak.add_argument(
        "--max-body-bytes", type=count, default=4 * 2**20, help="the server's body cap (oversized bodies go past it)"
    )
    soak.add_argument("--long-prompt-tokens", type=count, default=3000, help="length of the long prompts")
    soak.add_argument("--serve-args", default="", help="more `conveyor serve` flags for the started server, quoted")
    soak.add_argument(
        "--rss-bound-mib", type=_positive, default=RSS_BOUND_MIB, help="allowed RSS growth in the second half"
    )
    soak.add_argument("--server-log", default=None, help="the started server's output (default: a temporary file)")
    soak.add_argument("--out", default=None, help="write the report as JSON here")


def cmd_soak(args: argparse.Namespace) -> int:
    config = SoakConfig(
        url=args.url or "",
        clients=args.clients,
        duration_s=args.duration,
        seed=args.seed,
        server_pid=args.server_pid,
        max_body_bytes=args.max_body_bytes,
        max_model_len=args.max_model_len,
        long_tokens=args.long_prompt_tokens,
        rss_bound_mib=args.rss_bound_mib,
    )
    if args.url:
        result = asyncio.run(run_soak(config))
    else:
        log_path = args.server_log or tempfile.mkstemp(prefix="conveyor-soak-server-", suffix=".log")[1]
        print(f"[starting conveyor serve; its output goes to {log_path}]", file=sys.stderr, flush=True)
        extra = shlex.split(args.serve_args)
        with local_server(args.max_model_len, args.max_body_bytes, args.model, extra, log_path) as server:
            config.url, config.server_pid = server.url, server.process.pid
            result = asyncio.run(run_soak(config))
        result["server_exit_code"] = server.exit_code
        if server.exit_code != 0:  # a server that did not drain and stop cleanly fails the soak too
            result["passed"] = False
    result["command"] = "conveyor " + " ".join(sys.argv[1:])
    print(text_report(result))
    if "server_exit_code" in result:
        print(f"server exit status after SIGTERM: {result['server_exit_code']}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"[saved {args.out}]", file=sys.stderr)
    return 0 if result["passed"] else 1
