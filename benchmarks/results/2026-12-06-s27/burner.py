"""Sync W1 decode steps with a background Python thread burning BURN ms of CPU every PERIOD ms (an async host turn's
cost stand-in): ms per step with and without it.   burner.py BURN_MS PERIOD_MS [ROUNDS]"""
import sys, time, threading, statistics, ctypes
spin = ctypes.CDLL(__import__("os").path.join(__import__("os").path.dirname(__import__("os").path.abspath(__file__)), "libspin.so")).spin_ns  # gcc -O2 -shared -fPIC -o libspin.so spin.c
spin.argtypes = [ctypes.c_long]
GIL = len(sys.argv) > 4 and sys.argv[4] == "gil"
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
burn, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
e = Engine(EngineConfig(async_batching=False))
stop = threading.Event(); active = threading.Event()
def burner():
    while not stop.is_set():
        if not active.is_set():
            time.sleep(0.005); continue
        if GIL:
            t = time.perf_counter()
            while time.perf_counter() - t < burn: pass
        else:
            spin(int(burn * 1e9))
        time.sleep(max(0.0, period - burn))
th = threading.Thread(target=burner, daemon=True); th.start()
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
def run(on):
    for p, s in zip(w.prompts, w.params): e.add_request(p, s)
    for _ in range(8): e.step()
    if on: active.set()
    n = 0; t0 = time.perf_counter()
    while e.has_work() and n < 100:
        e.step(); n += 1
    dt = (time.perf_counter() - t0) / n * 1e3
    active.clear()
    while e.has_work(): e.step()
    return dt
run(False)
res = {False: [], True: []}
for r in range(rounds):
    for on in (False, True):
        res[on].append(run(on))
print(f"burn {burn*1e3:.1f} ms every {period*1e3:.0f} ms: off " + " / ".join(f"{x:.2f}" for x in res[False]) +
      " ; on " + " / ".join(f"{x:.2f}" for x in res[True]) + " ms per step")
