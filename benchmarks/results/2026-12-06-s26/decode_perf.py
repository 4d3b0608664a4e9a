"""W1 (sync), perf-recording this process for 3 s once every request has had its prompt step (pure decode)."""
import os, subprocess, time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
e = Engine(EngineConfig(async_batching=False))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
e.add_request(w.prompts[0][:8], w.params[0].clone(max_tokens=2))
while e.has_work(): e.step()
for p, s in zip(w.prompts, w.params): e.add_request(p, s)
for _ in range(8): e.step()
perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "4000", "-g", "-p", str(os.getpid()), "-o", "/tmp/s26/decode.perf", "--", "sleep", "2.5"])
time.sleep(0.3)
n = 0
t0 = time.perf_counter()
while e.has_work() and time.perf_counter() - t0 < 2.2:
    e.step(); n += 1
print("steps under perf", n, "per step ms", (time.perf_counter() - t0) / n * 1e3)
perf.wait()
while e.has_work(): e.step()
