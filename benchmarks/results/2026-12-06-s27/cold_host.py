"""Host time per 64-row decode step (schedule, prepare, commit) on a tiny model (everything cache-resident) against
the default model (each step streams ~580 MB through the caches), sync engine, W1-shaped requests.
    cold_host.py [tiny|default] [flush]   (flush: a 400 MB write after each tiny step)"""
import sys, time, collections, tempfile
sys.path.insert(0, "tests")
import conveyor  # noqa
import torch
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.core.scheduler import Scheduler
from conveyor.model.runner import ModelRunner
from conveyor.engine.output import OutputProcessor
acc = collections.defaultdict(float)
def wrap(owner, name, key):
    f = getattr(owner, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(owner, name, g)
wrap(Scheduler, "schedule", "schedule"); wrap(ModelRunner, "prepare", "prepare")
wrap(OutputProcessor, "commit", "commit"); wrap(ModelRunner, "_forward", "forward")
which = sys.argv[1]; flush = len(sys.argv) > 2
if which == "tiny":
    from conftest import build_tiny_model
    d = tempfile.mkdtemp(); build_tiny_model("llama", d)
    e = Engine(EngineConfig(model=d, dtype="bfloat16", async_batching=False, max_model_len=512))
else:
    e = Engine(EngineConfig(async_batching=False))
buf = torch.empty(400 << 20, dtype=torch.uint8)
w = random_workload(64, (32, 256), (128, 128), min(e.spec.vocab_size, 512), seed=0)
for rnd in range(2):
    for p, s in zip(w.prompts, w.params): e.add_request(p, s)
    for _ in range(8): e.step()
    acc.clear(); n = 0; t0 = time.perf_counter()
    while e.has_work() and n < 100:
        if flush:
            buf.fill_(n)
            t0 -= 0  # flush time excluded below
        e.step(); n += 1
    snap = dict(acc)
    while e.has_work(): e.step()
    print(which, "flush" if flush else "", ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in snap.items()), flush=True)
