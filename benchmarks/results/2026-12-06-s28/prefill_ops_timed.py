"""perf_counter wrappers around a model's native kernels (shared by the s28 timing scripts)."""
import time
import torch

class Timed:
    def __init__(self, kernels, acc):
        self._k, self._acc = kernels, acc
    def __getattr__(self, name):
        v = getattr(self._k, name)
        if not callable(v):
            return v
        def call(*a, **kw):
            t0 = time.perf_counter(); r = v(*a, **kw); self._acc[name] += time.perf_counter() - t0; return r
        return call

def install(m, acc):
    timed = Timed(m.kernels, acc)
    m.ops.kernels = timed
    m.ops.decode_attention = timed.decode_attention
    if m.ops.prefill_attention is not None:
        m.ops.prefill_attention = timed.prefill_attention
    for layer in m.layers:
        for part in vars(layer).values():
            for holder in (part, getattr(part, "projection", None)):
                if getattr(holder, "kernels", None) is m.kernels:
                    holder.kernels = timed
    if getattr(m.lm_head, "kernels", None) is m.kernels:
        m.lm_head.kernels = timed
    if m.decode_stack is not None:
        m.decode_stack.kernels = timed
    return timed
