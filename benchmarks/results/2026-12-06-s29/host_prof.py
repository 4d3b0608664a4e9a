"""Sync W1 (requests admitted final_only, as bench throughput admits them): 100 pure-decode steps, for py-spy."""
import time, sys
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=sys.argv[1] == "async" if len(sys.argv) > 1 else False))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
e.add_request(w.prompts[0][:8], w.params[0].clone(max_tokens=2))
while e.has_work(): e.step()
for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
for _ in range(8): e.step()
print("START", flush=True)
n = 0; t0 = time.perf_counter()
while e.has_work() and n < 400:
    e.step(); n += 1
print(f"{n} steps {(time.perf_counter()-t0)/n*1e3:.2f} ms/step", flush=True)
