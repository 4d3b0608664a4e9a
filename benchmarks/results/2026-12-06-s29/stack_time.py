"""W1's pure-decode sub-steps (sync engine): the median wall time of decode_layers calls, of the LM head's argmax
product, and of whole plans (8 sub-steps), over one W1 run after a warm-up run; prints one line."""
import statistics, time
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
import os
e = Engine(EngineConfig(async_batching=False, block_size=int(os.environ.get("BLOCK", "16"))))
m = e.runner.model
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
stack_times, head_times = [], []
orig_call = type(m.decode_stack).__call__
def timed_stack(self, *a, **kw):
    t0 = time.perf_counter(); r = orig_call(self, *a, **kw); stack_times.append(time.perf_counter() - t0); return r
orig_head = type(m.lm_head).first_argmax
def timed_head(self, *a, **kw):
    t0 = time.perf_counter(); r = orig_head(self, *a, **kw); head_times.append(time.perf_counter() - t0); return r
from conveyor.model.runner import ModelRunner
fwd_times = []
orig_fwd = ModelRunner._forward
def timed_fwd(self, step):
    t0 = time.perf_counter(); r = orig_fwd(self, step)
    if step.later is not None and len(step.later.positions) == 7:
        fwd_times.append(time.perf_counter() - t0)
    return r
def run():
    e.reset_prefix_cache()
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, final_only=True)
    t0 = time.perf_counter()
    while e.has_work(): e.step()
    return time.perf_counter() - t0
run()
type(m.decode_stack).__call__ = timed_stack
type(m.lm_head).first_argmax = timed_head
ModelRunner._forward = timed_fwd
wall = run()
print(f"W1 {wall:.3f} s; decode_layers median {statistics.median(stack_times) * 1e3:.2f} ms (n={len(stack_times)}), "
      f"head {statistics.median(head_times) * 1e3:.2f} ms; 8-step forwards {len(fwd_times)}, median per step "
      f"{statistics.median(fwd_times) / 8 * 1e3:.2f} ms")
e.close()
