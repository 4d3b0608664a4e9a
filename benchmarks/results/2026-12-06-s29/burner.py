"""A competing 2-thread torch process (1024^2 float32 matmuls in a loop) for SECONDS seconds."""
import sys, time
import torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    a @ a
