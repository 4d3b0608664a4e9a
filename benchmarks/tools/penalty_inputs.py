"""Time of build_sampling_tensors for N rows with a repetition penalty and 520-id histories (one in flight),
the host's per-step cost of penalties, in whichever checkout's package the interpreter imports (base keeps
the history in each row's SamplingSpec; this branch reads it from the persistent batch's int64 arrays):

    python benchmarks/penalty_inputs.py 256; /work/base/.venv/bin/python benchmarks/penalty_inputs.py 256
"""
import time, random, array, sys, torch
from conveyor.core.plan import SamplingSpec
from conveyor.model.sampling_inputs import build_sampling_tensors
n, L = int(sys.argv[1]), 520
rng = random.Random(0)
hist = [tuple(rng.randrange(49152) for _ in range(L)) for _ in range(n)]
base = "history" in SamplingSpec.__dataclass_fields__
ids = [str(i) for i in range(n)]
if base:
    specs = [SamplingSpec(0.0, 0, 1.0, 0, 8, repetition_penalty=1.1, history=h + (-1,), num_prompt_tokens=512) for h in hist]
    src = {r: i for i, r in enumerate(ids)}
    f = lambda: build_sampling_tensors(specs, lambda t: t, [], [], src, ids)
else:
    specs = [SamplingSpec(0.0, 0, 1.0, 0, 8, repetition_penalty=1.1, history_tail=(), history_start=L, num_history_placeholders=1, num_prompt_tokens=512) for h in hist]
    arrs = {r: array.array("q", h) for r, h in zip(ids, hist)}
    src = {r: i for i, r in enumerate(ids)}
    f = lambda: build_sampling_tensors(specs, lambda t: t, [], [], src, ids, arrs.__getitem__)
f()
best = []
for _ in range(7):
    s = time.perf_counter(); f(); best.append(time.perf_counter() - s)
best.sort()
print(("base" if base else "branch"), n, "median ms", round(best[3] * 1e3, 2), "min", round(best[0] * 1e3, 2))
