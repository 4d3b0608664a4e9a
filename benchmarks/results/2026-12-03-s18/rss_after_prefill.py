"""RSS of the engine on a GGUF file after load, after W1's first 2048-token step and after W1 (synchronous): session
s18's ad hoc check of the slab buffer. Run from a checkout's root, base and main in turn:

    PYTHONPATH=. .venv/bin/python benchmarks/results/2026-12-03-s18/rss_after_prefill.py /work/ckpt/llama-1b-q4_k_m.gguf

Seen (17:59): after load 1.99 GiB base / 2.00 main; after the first step 2.34 / 2.38; after W1 2.42 / 2.39.
"""
import conveyor, torch, sys
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"): return int(line.split()[1]) / 2**20
engine = Engine(EngineConfig(model=sys.argv[1], async_batching=False, max_model_len=1024))
print(f"after load RSS {rss():.2f} GiB")
w = random_workload(64, (32, 128), (32, 32), engine.spec.vocab_size, seed=0)
for p, s in zip(w.prompts, w.params): engine.add_request(p, s)
engine.step()
print(f"after the first 2048-token step RSS {rss():.2f} GiB")
while engine.has_work(): engine.step()
print(f"after W1 RSS {rss():.2f} GiB")
