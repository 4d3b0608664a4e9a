"""What does building a step's sampling tensors cost the host when every row has a repetition penalty?

Times build_sampling_tensors for N rows with a repetition penalty and 520-id histories (one id still in
flight), as the runner calls it with the persistent batch's int64 history arrays; median and best of 7 calls.

    .venv/bin/python benchmarks/tools/penalty_inputs.py 256
"""

import array
import random
import sys
import time

from conveyor.core.plan import SamplingSpec
from conveyor.model.sampling_inputs import build_sampling_tensors

n, L = int(sys.argv[1]), 520
rng = random.Random(0)
hist = [tuple(rng.randrange(49152) for _ in range(L)) for _ in range(n)]
ids = [str(i) for i in range(n)]
specs = [
    SamplingSpec(
        0.0,
        0,
        1.0,
        0,
        8,
        repetition_penalty=1.1,
        history_tail=(),
        history_start=L,
        num_history_placeholders=1,
        num_prompt_tokens=512,
    )
    for _ in hist
]
arrs = {r: array.array("q", h) for r, h in zip(ids, hist)}
src = {r: i for i, r in enumerate(ids)}


def build() -> None:
    build_sampling_tensors(specs, lambda t: t, [], [], src, ids, arrs.__getitem__)


build()
times = []
for _ in range(7):
    start = time.perf_counter()
    build()
    times.append(time.perf_counter() - start)
times.sort()
print(n, "rows: median ms", round(times[3] * 1e3, 2), "min", round(times[0] * 1e3, 2))
