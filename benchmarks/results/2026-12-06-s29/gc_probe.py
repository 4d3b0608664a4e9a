"""Python's garbage collections during a W1 run (sync or async engine): count, generation and time, by gc.callbacks.
Usage: gc_probe.py [async_batching: true|false]"""
import gc, sys, time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=sys.argv[1] == "true" if len(sys.argv) > 1 else False))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
events = []
t_start = {}
def cb(phase, info):
    if phase == "start": t_start["t"] = time.perf_counter()
    else: events.append((info["generation"], time.perf_counter() - t_start["t"], info["collected"]))
def run():
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
    t0 = time.perf_counter()
    while e.has_work(): e.step()
    return time.perf_counter() - t0
run()
gc.callbacks.append(cb)
wall = run()
gc.callbacks.remove(cb)
by_gen = {}
for g, dt, n in events:
    c, t, k = by_gen.get(g, (0, 0.0, 0)); by_gen[g] = (c + 1, t + dt, k + n)
print(f"W1 {wall:.3f} s; collections by generation: " + ", ".join(f"gen{g}: {c} ({t * 1e3:.1f} ms, {k} collected)" for g, (c, t, k) in sorted(by_gen.items())) + f"; thresholds {gc.get_threshold()}, counts {gc.get_count()}")
e.close()
