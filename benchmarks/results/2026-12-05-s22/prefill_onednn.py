"""Session s22: the default model's four linears at 2048/1024/256/64 rows, hot (one weight set), ours (bf16_linear_amx)
against torch's F.linear (oneDNN, plain weight) and oneDNN on a prepacked weight. Run under the bench lock."""
import time, statistics
import conveyor  # noqa
import torch
from conveyor.model.native import load_kernels
from conveyor.model.layers import Projection
k = load_kernels()
for rows in (2048, 1024, 256, 64):
  tot_o = tot_d = tot_p = 0
  for (i, o) in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
    w = (torch.randn(o, i) * 0.05).to(torch.bfloat16)
    p = Projection(w, None, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    x = torch.randn(rows, i).to(torch.bfloat16)
    ours, dnn, pk = [], [], []
    for r in range(9):
        t = time.perf_counter(); k.bf16_linear_amx(x, p.tiles, o); ours.append(time.perf_counter() - t)
        t = time.perf_counter(); torch.nn.functional.linear(x, w); dnn.append(time.perf_counter() - t)
        t = time.perf_counter(); torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""); pk.append(time.perf_counter() - t)
    tot_o += statistics.median(ours); tot_d += statistics.median(dnn); tot_p += statistics.median(pk)
  print(f"rows {rows}: four linears, hot: ours {tot_o*1e3:.3f} ms, F.linear {tot_d*1e3:.3f} ms, prepacked oneDNN {tot_p*1e3:.3f} ms")
