"""Sync W1 prompt steps: prefill products (>= 1536 rows) through oneDNN (F.linear) against ours, alternating in one
process. The plain weights are unpacked from the tiles on every call, or with `plain` as the first argument once
and kept (an experiment only: twice the weight memory).

    flock /work/bench.lock .venv/bin/python prefill_onednn_engine.py [plain]
"""
import sys, time, statistics
import conveyor  # noqa
import torch
from conveyor.config import EngineConfig
from conveyor.engine.engine import Engine
from conveyor.bench.workloads import random_workload
from conveyor.model import layers as L
from conveyor.model.runner import ModelRunner
from conveyor.model.layers import Projection, SiluGateProjection, unpack_bf16_tiles

orig_p, orig_s = Projection.__call__, SiluGateProjection.__call__
THRESH = 1536
PLAIN = {}
KEEP = sys.argv[1:] == ["plain"]
def plain(tiles, out):
    if not KEEP:
        return unpack_bf16_tiles(tiles, out)
    if id(tiles) not in PLAIN:
        PLAIN[id(tiles)] = unpack_bf16_tiles(tiles, out)
    return PLAIN[id(tiles)]
def p_call(self, x):
    if self.tiles is not None and x.shape[0] >= THRESH:
        return torch.nn.functional.linear(x, plain(self.tiles, self.out_features))
    return orig_p(self, x)
def s_call(self, x):
    if x.shape[0] >= THRESH:
        w = plain(self.tiles, 2 * self.inner)  # interleaved gate/up rows
        gu = torch.nn.functional.linear(x, w)  # [n, 2 inner] interleaved in 16-row groups
        n = x.shape[0]
        g = gu.view(n, -1, 2, 16)
        return (torch.nn.functional.silu(g[:, :, 0].float()).to(torch.bfloat16) * g[:, :, 1]).reshape(n, self.inner)
    return orig_s(self, x)
e = Engine(EngineConfig(async_batching=False))
wl = random_workload(64, (32, 256), (128, 128), e.spec.vocab_size, seed=0)
records = []
of = ModelRunner._forward
def timed(self, step):
    t = time.perf_counter(); out = of(self, step)
    if out.sample is not None: out.sample.tokens.tolist()
    records.append((int(step.input_ids.shape[0]), time.perf_counter() - t)); return out
ModelRunner._forward = timed
for rnd in range(4):
    for arm in ("ours", "onednn"):
        Projection.__call__, SiluGateProjection.__call__ = (orig_p, orig_s) if arm == "ours" else (p_call, s_call)
        e.reset_prefix_cache(); records.clear()
        reqs = [e.add_request(p, pa.clone(max_tokens=4)) for p, pa in zip(wl.prompts, wl.params)]
        t = time.perf_counter()
        while e.has_work(): e.step()
        big = [s for n, s in records if n >= 1536]
        print(rnd, arm, f"prompt steps >=1536 tokens: {len(big)}, total {sum(big)*1e3:.0f} ms, each {[round(s*1e3) for s in big]}")
