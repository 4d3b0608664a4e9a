"""Per-kernel wall time of W1's 64-row decode steps (sync engine, the decode stack off so every kernel is called
from Python; perf_counter around each native call, no profiler): ms per step by kernel over 40 steps, 3 rounds."""
import collections, time, statistics, sys
import conveyor  # noqa
import torch
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
sys.path.insert(0, __import__("os").path.dirname(__file__))
from prefill_ops_timed import Timed, install

e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
acc = collections.Counter()
install(m, acc)
stack = m.decode_stack
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
for r in range(3):
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
    for _ in range(30): e.step()
    for mode in ("stack", "loop"):
        m.decode_stack = stack if mode == "stack" else None
        acc.clear()
        t0 = time.perf_counter()
        for _ in range(20): e.step()
        wall = (time.perf_counter() - t0) / 20
        print(f"round {r} {mode}: step {wall * 1e3:.2f} ms; " + ", ".join(f"{k} {v / 20 * 1e3:.2f}" for k, v in acc.most_common()), flush=True)
    m.decode_stack = stack
    while e.has_work(): e.step()
e.close()
