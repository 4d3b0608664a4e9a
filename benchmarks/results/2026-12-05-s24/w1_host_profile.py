"""cProfile of one synchronous W1 run on the default model: where the host time outside the forwards goes."""
import cProfile
import pstats
import sys
import time

import conveyor  # noqa: F401
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine

engine = Engine(EngineConfig(async_batching=False))
workload = random_workload(64, (32, 256), (128, 128), engine.spec.vocab_size, seed=0)
engine.add_request(workload.prompts[0][:8], workload.params[0].clone(max_tokens=2))
while engine.has_work():
    engine.step()
prof = cProfile.Profile()
start = time.perf_counter()
prof.enable()
for p, s in zip(workload.prompts, workload.params):
    engine.add_request(p, s)
while engine.has_work():
    engine.step()
prof.disable()
print("wall", time.perf_counter() - start)
st = pstats.Stats(prof)
st.sort_stats(sys.argv[1] if len(sys.argv) > 1 else "tottime").print_stats(35)
