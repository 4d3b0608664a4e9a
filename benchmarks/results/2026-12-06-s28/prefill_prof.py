"""W1's prompt steps only (64 requests of max_tokens 1, final_only), 6 rounds from a cold prefix cache, for py-spy."""
import time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
w = random_workload(64, (32, 256), (1, 1), e.spec.vocab_size, seed=0)
def run():
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
    t0 = time.perf_counter()
    while e.has_work(): e.step()
    return time.perf_counter() - t0
run()
print("START", flush=True)
ts = [run() for _ in range(6)]
print("prompt phase s:", " ".join(f"{t:.3f}" for t in ts), flush=True)
