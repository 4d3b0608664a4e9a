"""Sync W1 decode steps: perf_counter totals of some host/glue functions per step."""
import time, collections, sys
import conveyor  # noqa
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.core.scheduler import Scheduler
from conveyor.model.runner import ModelRunner
from conveyor.engine.output import OutputProcessor
from conveyor.model.rope import RotaryEmbedding
from conveyor.model import sampling_inputs, llama
acc = collections.defaultdict(float)
def wrap(owner, name, key):
    f = getattr(owner, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: acc[key] += time.perf_counter() - t
    setattr(owner, name, g)
wrap(Scheduler, "schedule", "schedule")
wrap(ModelRunner, "prepare", "prepare")
wrap(ModelRunner, "_forward", "forward")
wrap(OutputProcessor, "commit", "commit")
wrap(RotaryEmbedding, "tables", "rotary.tables")
from conveyor.model import runner as runner_mod, attention as attn_mod
wrap(runner_mod, "build_sampling_tensors", "build_sampling_tensors")
wrap(runner_mod, "build_attention_batch", "build_attention_batch")
import conveyor.model.gguf_quant as gq
wrap(llama, "embedding_rows", "embedding_rows")
wrap(llama.LlamaModel, "greedy_tokens", "greedy_tokens")
wrap(llama.DecodeStack if hasattr(llama, "DecodeStack") else llama.LlamaModel, "__call__", "decode_stack")
e = Engine(EngineConfig(async_batching=False))
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
for rnd in range(2):
    for p, s in zip(w.prompts, w.params): e.add_request(p, s, **({"final_only": True} if __import__("os").environ.get("FINAL") == "1" else {}))
    for _ in range(8): e.step()
    acc.clear(); n = 0; t0 = time.perf_counter()
    while e.has_work() and n < 100:
        e.step(); n += 1
    wall = time.perf_counter() - t0
    snap = dict(acc)
    while e.has_work(): e.step()
    print(f"{wall / n * 1e3:.2f} ms per step; " + ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in snap.items()))
