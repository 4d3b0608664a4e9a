"""A tensor-parallel worker process (ranks 1..N-1): `python -m conveyor.tensor_parallel.worker`.

It reads a JSON header from stdin (config, rank, rendezvous port), joins the gloo group, loads and shards
the model, builds its runner with the KV cache size rank 0 sends, says "ready" on stdout, then runs every
step plan that arrives on stdin (plan_wire bytes) until STOP or end of file. Sampling runs here too, on the
gathered logits with the same per-row seeds, so each rank's copy of the sampled ids (which fill the next
step's placeholder tokens) equals rank 0's without another message.
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys

import torch
import torch.distributed as dist

from conveyor.config import EngineConfig
from conveyor.device import detect_device
from conveyor.model.loader import load_model
from conveyor.model.runner import ModelRunner
from conveyor.tensor_parallel.group import TensorParallelGroup
from conveyor.tensor_parallel.plan_wire import decode_plan
from conveyor.tensor_parallel.shard import shard_spec, shard_weights, vocab_range
from conveyor.tensor_parallel.wire import read_frame

logger = logging.getLogger("conveyor.tensor_parallel.worker")

RENDEZVOUS_TIMEOUT_S = 120.0


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, even mid-step (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # elsewhere the closed stdin pipe still ends the worker between steps


def main() -> int:
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-worker %(levelname)s %(message)s")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    header_bytes = read_frame(stdin)
    if not header_bytes:
        return 0
    header = json.loads(header_bytes)
    config = EngineConfig(**header["config"])
    rank, size = int(header["rank"]), int(header["size"])
    torch.set_num_threads(int(header["num_threads"]))
    store = dist.TCPStore(header["host"], int(header["port"]), size, False)
    loaded = load_model(config.model, header["dtype"])
    start, end = vocab_range(loaded.spec, rank, size)
    group = TensorParallelGroup(store, rank, size, start, end)
    full = loaded.spec
    loaded.weights = shard_weights(full, loaded.weights, rank, size)
    loaded.spec = shard_spec(full, size)
    budget = json.loads(read_frame(stdin) or b"null")
    if budget is None:
        return 0
    runner_config = config.replace(kv_cache_memory=int(budget["kv_cache_bytes"]))
    runner = ModelRunner(runner_config, loaded, int(header["max_model_len"]), detect_device("cpu"))
    runner.model.parallel = group
    stdout.write(b"ready\n")
    stdout.flush()
    previous = None
    while True:
        data = read_frame(stdin)
        if not data:  # STOP, or rank 0 is gone
            return 0
        plan = decode_plan(data)
        prepared = runner.prepare(plan, previous)
        prepared.grammar = None  # rank 0 refuses constrained rows under tensor parallelism
        runner.forward(prepared)
        previous = plan


if __name__ == "__main__":
    sys.exit(main())
