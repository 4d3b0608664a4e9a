"""Python function calls per scheduler step with N requests decoding: cProfile's call count, so the
host work of planning is compared without a clock (deterministic: no lock, no noise).

    python benchmarks/scheduler_calls.py 256            # this checkout
    PYTHONPATH=/work/base /work/base/.venv/bin/python benchmarks/scheduler_calls.py 256   # another one
"""
import cProfile, pstats, sys
from conveyor.core.kv_cache import BlockManager
from conveyor.core.scheduler import Scheduler, SchedulerLimits
from conveyor.core.request import Request
from conveyor.params import SamplingParams
n = int(sys.argv[1])
bm = BlockManager(40000, 16, True)
s = Scheduler(SchedulerLimits(n, 16384, 512), bm)
p = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
for i in range(n):
    s.add(Request(request_id=str(i), prompt_token_ids=[(i * 7 + j) % 500 + 2 for j in range(32)], params=p, seed=i,
                  arrival_index=i, max_model_len=512, eos_token_ids=(0,)))
def one():
    plan = s.schedule()
    for seq in plan.seqs:
        if seq.sampling is not None:
            s.commit_token(s.get(seq.request_id), 5)
one()
pr = cProfile.Profile(); pr.enable()
for _ in range(32): one()
pr.disable()
st = pstats.Stats(pr)
print(n, "calls per step:", round(sum(v[1] for v in st.stats.values()) / 32))
