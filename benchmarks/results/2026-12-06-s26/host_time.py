"""Sync W1 decode steps: wall per step split into scheduler.schedule, runner.prepare, the forward's native calls,
the rest of runner._forward/run_here, and output commit (perf_counter wrappers, no profiler)."""
import time, statistics, collections
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.core.scheduler import Scheduler
from conveyor.model.runner import ModelRunner
from conveyor.engine.output import OutputProcessor
from conveyor.runtime.base import Executor
acc = collections.defaultdict(float)
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(cls, name, g)
wrap(Scheduler, "schedule", "schedule")
wrap(ModelRunner, "prepare", "prepare")
wrap(ModelRunner, "_forward", "forward")
wrap(Executor, "run_here", "run_here")
wrap(OutputProcessor, "commit", "commit")
e = Engine(EngineConfig(async_batching=False))
k = e.runner.model.kernels
class Timed:
    def __init__(self, inner): self._inner = inner
    def __getattr__(self, name):
        f = getattr(self._inner, name)
        if not callable(f): return f
        def g(*a, **kw):
            t = time.perf_counter()
            try: return f(*a, **kw)
            finally: acc["k:" + name] += time.perf_counter() - t
        return g
m = e.runner.model
tk = Timed(m.kernels)
m.lm_head.kernels = tk
if m.decode_stack is not None: m.decode_stack.kernels = tk
if e.runner.sampling_kernels is m.kernels: e.runner.sampling_kernels = tk
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
e.add_request(w.prompts[0][:8], w.params[0].clone(max_tokens=2))
while e.has_work(): e.step()
for p, s in zip(w.prompts, w.params): e.add_request(p, s)
for _ in range(8): e.step()
acc.clear()
n = 0; t0 = time.perf_counter()
while e.has_work() and n < 100:
    e.step(); n += 1
wall = time.perf_counter() - t0
print(f"{n} steps, {wall / n * 1e3:.2f} ms per step; " + ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in acc.items()))
