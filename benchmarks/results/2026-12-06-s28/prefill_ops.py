"""Per-kernel wall time of W1's first step (2048 prompt tokens), sync engine, perf_counter around each native call
(no profiler). Five rounds, each from a cold prefix cache; per round ms by kernel.
    .venv/bin/python prefill_ops.py"""
import collections, os, sys, time, statistics
import conveyor  # noqa
import torch
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
sys.path.insert(0, os.path.dirname(__file__))
from prefill_ops_timed import install

e = Engine(EngineConfig(async_batching=False))
m = e.runner.model
acc = collections.Counter()
install(m, acc)
orig_embed = torch.nn.functional.embedding
def emb(*a, **kw):
    t0 = time.perf_counter(); r = orig_embed(*a, **kw); acc["embedding"] += time.perf_counter() - t0; return r
torch.nn.functional.embedding = emb
w = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
rounds = []
for r in range(6):
    e.reset_prefix_cache()
    ids = [e.add_request(p, s, final_only=True) for p, s in zip(w.prompts, w.params)]
    acc.clear()
    t0 = time.perf_counter(); e.step(); wall = time.perf_counter() - t0
    row = dict(acc); row["wall"] = wall
    rounds.append(row)
    e.abort(ids)
    while e.has_work(): e.step()
keys = sorted(rounds[0], key=lambda k: -rounds[0][k])
for k in keys:
    vals = [r.get(k, 0) * 1e3 for r in rounds[1:]]
    print(f"{k:28s} " + " ".join(f"{v:7.1f}" for v in vals) + f"   median {statistics.median(vals):7.1f} ms")
e.close()
