"""Experiment: the model's weight tensors moved into one arena on transparent huge pages, then W1 (sync) timed
by step, against the same engine without the move (alternating engines in one process)."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.bench.workloads import random_workload
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.host_memory import advise_huge_pages
from conveyor.model.decode_stack import DecodeStack

HUGE = 2 << 20


def collect(obj, out, seen, depth=0):
    if depth > 6:
        return
    items = []
    if isinstance(obj, list):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor):
        items = [(k, v) for k, v in vars(obj).items() if k not in ("kernels", "spec", "ops", "rotary", "local_rotary", "decode_stack", "parallel")]
    for key, v in items:
        if isinstance(v, torch.Tensor):
            if v.numel() * v.element_size() >= 64 * 1024 and v.is_contiguous() and not v.is_mkldnn:
                out.append((obj, key, v))
        elif isinstance(v, (list,)) or (hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type))):
            if id(v) not in seen:
                seen.add(id(v))
                collect(v, out, seen, depth + 1)


def to_huge(engine):
    model = engine.runner.model
    refs = []
    collect(model, refs, set())
    uniq = {}
    for _, _, t in refs:
        uniq.setdefault(t.data_ptr(), t)
    total = sum(-(-t.numel() * t.element_size() // 4096) * 4096 for t in uniq.values())
    arena = torch.empty(total + HUGE, dtype=torch.uint8)
    advise_huge_pages(arena.data_ptr(), total + HUGE)
    offset = (-arena.data_ptr()) % HUGE
    moved = {}
    for ptr, t in uniq.items():
        n = t.numel() * t.element_size()
        dst = arena[offset:offset + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        moved[ptr] = dst
        offset += -(-n // 4096) * 4096
    for obj, key, t in refs:
        new = moved[t.data_ptr()]
        if isinstance(obj, list):
            obj[key] = new
        else:
            setattr(obj, key, new)
    if model.decode_stack is not None:
        model.decode_stack = DecodeStack(model, model.kernels)
    print(f"moved {len(uniq)} tensors, {total / 2**20:.0f} MiB", flush=True)
    return arena


def w1(engine, wl):
    times = []
    from conveyor.model.runner import ModelRunner
    for p, s in zip(wl.prompts, wl.params):
        engine.add_request(p, s)
    start = time.perf_counter()
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return time.perf_counter() - start, statistics.median(times[-100:])


plain = Engine(EngineConfig(async_batching=False))
huge = Engine(EngineConfig(async_batching=False))
keep = to_huge(huge)
wl = random_workload(64, (32, 256), (128, 128), plain.spec.vocab_size, seed=0)
for e in (plain, huge):
    w1(e, random_workload(4, (8, 16), (4, 4), plain.spec.vocab_size, seed=1))
outs = {}
import re
print("AnonHugePages MiB", sum(int(x) for x in re.findall(r"AnonHugePages:\s+(\d+)", open("/proc/self/smaps").read())) / 1024)
for rnd in range(4):
    for name, e in (("plain", plain), ("huge", huge)) if rnd % 2 == 0 else (("huge", huge), ("plain", plain)):
        wl = random_workload(64, (32, 256), (128, 128), plain.spec.vocab_size, seed=10 + rnd)
        wall, step = w1(e, wl)
        print(f"{name:6s} W1 wall {wall:.2f} s, decode step median {step * 1e3:.1f} ms", flush=True)
# same tokens?
a = plain.generate([wl.prompts[0]], wl.params[0].clone(max_tokens=16)) if hasattr(plain, "generate") else None
