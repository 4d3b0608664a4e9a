"""Async W1: per decode step, the host turn's wall time and the forward's (run_here), medians over the pure
decode steps; HS=0/1 switches the host-turn share."""
import time, statistics, collections
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.runtime.base import Executor
acc = collections.defaultdict(list)
orig_g = Engine._guarded
def g(self, ht):
    t = time.perf_counter()
    try: return orig_g(self, ht)
    finally: acc["turn"].append(time.perf_counter() - t)
Engine._guarded = g
orig_r = Executor.run_here
def r(self, *a, **k):
    t = time.perf_counter()
    try: return orig_r(self, *a, **k)
    finally: acc["forward"].append(time.perf_counter() - t)
Executor.run_here = r
import sys, os
if os.environ.get("SWI"): sys.setswitchinterval(float(os.environ["SWI"]))
e = Engine(EngineConfig(async_batching=sys.argv[1] == "async"))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
for rnd in range(2):
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
    for _ in range(10): e.step()
    acc.clear(); n = 0; t0 = time.perf_counter()
    while e.has_work() and n < 100:
        e.step(); n += 1
    wall = (time.perf_counter() - t0) / n * 1e3
    while e.has_work(): e.step()
    print(f"{wall:.2f} ms/step; turn median {statistics.median(acc['turn'] or [0])*1e3:.2f} ms; forward median {statistics.median(acc['forward'])*1e3:.2f} ms")
