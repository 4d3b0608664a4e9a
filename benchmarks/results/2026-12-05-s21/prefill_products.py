"""1B prefill-sized bf16 AMX products: TFLOP/s with one weight reused vs cycling 16 layers' weights (as the engine)."""
import statistics, sys, time
import conveyor  # noqa
import torch
from conveyor.model.native import load_kernels
from conveyor.model.layers import pack_bf16_tiles, interleave_gate_up
k = load_kernels()
import os
torch.set_num_threads(int(os.environ.get("T", "2")))
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
layers = 16
torch.manual_seed(0)
shapes = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
res = {}
for name, (out, inp) in shapes.items():
    ws = []
    for _ in range(layers):
        w = (torch.randn(out, inp) * 0.02).to(torch.bfloat16)
        ws.append(pack_bf16_tiles(interleave_gate_up(w) if name == "gate_up" else w))
    x = torch.randn(rows, inp).to(torch.bfloat16)
    def call(t):
        return k.bf16_silu_gate_amx(x, t, out // 2) if name == "gate_up" else k.bf16_linear_amx(x, t, out)
    flop = 2 * rows * out * inp
    for mode in ("same", "cycle"):
        ts = []
        for rep in range(3):
            t0 = time.perf_counter()
            for i in range(layers):
                call(ws[0] if mode == "same" else ws[i])
            ts.append((time.perf_counter() - t0) / layers)
        med = statistics.median(ts)
        print(f"{name:8s} {mode:5s} {med*1e3:7.2f} ms  {flop/med/1e12:5.2f} TFLOP/s", flush=True)
