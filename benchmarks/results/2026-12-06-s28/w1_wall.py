"""Default W1 (64 random prompts of 32-256 tokens, 128 greedy tokens each, admitted final_only as bench throughput
does), the engine's wall time over REPEATS runs (after one warm-up run), printed one line: the median and all.
    w1_wall.py [ASYNC: true|false] [REPEATS]"""
import statistics, sys, time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
mode = {"true": True, "false": False}.get(sys.argv[1] if len(sys.argv) > 1 else "auto", "auto")
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
e = Engine(EngineConfig(async_batching=mode))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
def run() -> float:
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params):
        e.add_request(p, s, final_only=True)
    t0 = time.perf_counter()
    while e.has_work():
        e.step()
    return time.perf_counter() - t0
run()
ts = [run() for _ in range(repeats)]
print(f"W1 wall median {statistics.median(ts):.3f} s ({' '.join(f'{t:.3f}' for t in ts)})")
e.close()
