"""`conveyor serve --data-parallel-size M`: start the replicas on Ray, then serve the front until SIGTERM,
then tear everything down (replicas, their TP workers, placement groups, and Ray if it was started here)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from conveyor.config import EngineConfig
from conveyor.data_parallel.replicas import ReplicaSet
from conveyor.data_parallel.serving.front import Front, build_front_app
from conveyor.errors import ConfigError
from conveyor.server.main import DrainingServer, api_keys, model_name
from conveyor.server.state import ServerOptions

logger = logging.getLogger("conveyor.serve")


def _stop_starting(sig: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + sig)  # unwinds ReplicaSet's start, which then ends what it started


def serve_data_parallel(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.vllm_metrics:
        logger.warning(
            "--vllm-metrics is not exported by the data-parallel front yet; the conveyor_* series "
            "(per replica and totals) are"
        )
    unserved = [
        flag
        for flag, given in (
            ("--root-path", bool(args.root_path.strip("/ "))),
            ("--enable-force-include-usage", args.enable_force_include_usage),
            ("--return-tokens-as-token-ids", args.return_tokens_as_token_ids),
            ("--enable-prompt-tokens-details", args.enable_prompt_tokens_details),
        )
        if given
    ]
    if unserved:
        raise ConfigError(
            f"{', '.join(unserved)} {'is' if len(unserved) == 1 else 'are'} not honoured by the data-parallel front "
            f"yet; leave {'it' if len(unserved) == 1 else 'them'} out, or serve one replica (--data-parallel-size 1)"
        )
    options = ServerOptions(
        model_name=args.served_model_name or model_name(config),
        api_keys=api_keys(args),
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        allowed_origins=tuple(args.allowed_origins),
        ui=False,
    )
    previous = signal.signal(signal.SIGTERM, _stop_starting)
    print(
        f"conveyor: starting {config.data_parallel_size} replicas x {config.tensor_parallel_size} "
        f"tensor-parallel ranks on Ray",
        flush=True,
    )
    try:
        replicas = ReplicaSet(
            config, "conveyor.data_parallel.serving.replica_app:build_replica_app", options.model_name
        )
    except SystemExit as exc:
        print("conveyor: stopped while starting the replicas", flush=True)
        return int(exc.code or 0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        front = Front(replicas, options, config.block_size)
        server = DrainingServer(
            uvicorn.Config(
                build_front_app(front), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
            ),
            front,
            args.shutdown_timeout,
            work=front,
        )
        print(
            f"conveyor: serving {options.model_name} on http://{args.host}:{args.port} from "
            f"{config.data_parallel_size} replicas (OpenAI API under /v1; GET /health, /metrics)",
            flush=True,
        )
        server.run()
        try:
            asyncio.run(front.close())
        except RuntimeError:  # its connections belonged to the server's loop, which has ended
            pass
    finally:
        replicas.close()
    return 0
