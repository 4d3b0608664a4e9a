"""Minor page faults and system time during the default W1 (sync), after a warm-up request."""
import resource, time, sys
import conveyor  # noqa
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.bench.workloads import random_workload
engine = Engine(EngineConfig(async_batching=False))
wl = random_workload(64, (32, 256), (128, 128), engine.spec.vocab_size, seed=0)
engine.add_request(wl.prompts[0][:8], wl.params[0].clone(max_tokens=2))
while engine.has_work(): engine.step()
for rnd in range(2):
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    for p, prm in zip(wl.prompts, wl.params): engine.add_request(p, prm)
    n = 0
    while engine.has_work():
        engine.step(); n += 1
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(f"round {rnd}: wall {time.perf_counter()-t0:.2f} s, steps {n}, minor faults {r1.ru_minflt-r0.ru_minflt}, "
          f"user {r1.ru_utime-r0.ru_utime:.2f} s, sys {r1.ru_stime-r0.ru_stime:.2f} s")
