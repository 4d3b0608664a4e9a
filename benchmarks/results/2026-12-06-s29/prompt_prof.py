"""Sync W1's prompt-carrying steps, for perf: a warm-up W1, then the next W1's steps until no prompt is left
(prints START before them and the time they took)."""
import time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
def admit():
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
admit()
while e.has_work(): e.step()
admit()
time.sleep(1.0)
print("START", flush=True)
t0 = time.perf_counter()
for _ in range(5): e.step()
print(f"5 steps {time.perf_counter() - t0:.3f} s", flush=True)
time.sleep(3)
while e.has_work(): e.step()
e.close()
