"""A prompt step product whose weights are one or two 32-column blocks costs about its activation packing: bf16_linear_amx at 2048 rows, outputs 32 / 64 / 576 wide, inputs 576 and 1536; one and two threads, median ms. (Session s23, ad hoc; the outputs are in outputs/pack_cost.txt.)

    flock /work/bench.lock .venv/bin/python benchmarks/results/2026-12-05-s23/pack_cost.py
"""
import conveyor, torch, time, statistics
from conveyor.model.native import load_kernels
from conveyor.model.layers import pack_bf16_tiles
k = load_kernels()
def med(fn, reps=50):
    for _ in range(3): fn()
    ts=[]
    for _ in range(reps):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1e3
torch.manual_seed(0)
for threads in (1, 2):
    torch.set_num_threads(threads)
    for in_f in (576, 1536):
        for out_f in (32, 64, 576):
            w = torch.randn(out_f, in_f).bfloat16() * 0.05
            t = pack_bf16_tiles(w)
            x = torch.randn(2048, in_f).bfloat16()
            ms = med(lambda: k.bf16_linear_amx(x, t, out_f))
            print(f"{threads} thr 2048 rows {in_f}->{out_f}: {ms:.3f} ms", flush=True)
