"""W1 (async auto) wall, with sys.setswitchinterval(S) (argv[1], seconds) set before the engine starts."""
import sys, time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
if float(sys.argv[1]) > 0: sys.setswitchinterval(float(sys.argv[1]))
mode = {"true": True, "false": False}.get(sys.argv[2] if len(sys.argv) > 2 else "auto", "auto")
e = Engine(EngineConfig(async_batching=mode))
import os, threading
nice = int(sys.argv[3]) if len(sys.argv) > 3 else 0
def lower():
    tid = threading.get_native_id()
    if nice == 99:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    elif nice:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    return tid
if nice and getattr(e, "_host_thread", None) is not None:
    print("host tid", e._host_thread.submit(lower).result(), "nice", nice)
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
e.add_request(w.prompts[0][:8], w.params[0].clone(max_tokens=2))
while e.has_work(): e.step()
for run in range(2):
    e.reset_prefix_cache()
    t0 = time.perf_counter()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s)
    while e.has_work(): e.step()
    wall = time.perf_counter() - t0
    print(f"nice {nice} switch {sys.getswitchinterval()} async {mode}: W1 {wall:.2f} s {8192 / wall:.0f} tok/s")
e.close()
