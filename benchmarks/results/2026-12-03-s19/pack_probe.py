"""Session s19's probe: a prompt step's GGUF products on the packed path (gguf_pack_tiles, then bf16_linear_amx or,
for the gate/up stack, bf16_silu_gate_amx) against the per-chunk AMX product (gguf_linear_amx_parts, then
silu_and_mul for gate/up), on the 1B file's layer 0, arms alternating in one process; checks first that both give
the same bits. Median ms per call.

    .venv/bin/python benchmarks/results/2026-12-03-s19/pack_probe.py /work/ckpt/llama-1b-q4_k_m.gguf [ROWS,ROWS,...]

(The row counts, 512,768,1024,2048 unless given, were added in session s20.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)
import gguf
import numpy as np
import torch

from conveyor.model.native import load_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: the alternating-arms timer
from ab_gguf_prefill import medians  # noqa: E402


ROWS = tuple(int(r) for r in sys.argv[2].split(",")) if len(sys.argv) > 2 else (512, 768, 1024, 2048)


def main() -> None:
    kernels = load_kernels()
    torch.set_num_threads(2)
    tensors = {t.name: t for t in gguf.GGUFReader(sys.argv[1]).tensors}

    def matrix(name: str) -> tuple[torch.Tensor, int, int]:
        t = tensors[name]
        blocks = torch.from_numpy(np.array(t.data).reshape(int(t.shape[1]), -1).view(np.uint8).copy())
        return blocks, int(t.tensor_type), int(t.shape[0])

    stacks = {"qkv": [matrix(f"blk.0.attn_{n}.weight") for n in "qkv"],
              "gate_up": [matrix("blk.0.ffn_gate.weight"), matrix("blk.0.ffn_up.weight")],
              "down": [matrix("blk.0.ffn_down.weight")]}
    for name, parts in stacks.items():
        blocks, kinds, in_features = [p[0] for p in parts], [p[1] for p in parts], parts[0][2]
        out_features = sum(b.shape[0] for b in blocks)
        gate = name == "gate_up"
        tiles = torch.empty(-(-out_features // 32) * 2, in_features // 32, 16, 32, dtype=torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()

            def per_chunk() -> torch.Tensor:
                y = kernels.gguf_linear_amx_parts(x, blocks, kinds, in_features)
                return kernels.silu_and_mul(y) if gate else y

            def packed() -> torch.Tensor:
                kernels.gguf_pack_tiles(blocks, kinds, in_features, gate, tiles)
                if gate:
                    return kernels.bf16_silu_gate_amx(x, tiles, out_features // 2)
                return kernels.bf16_linear_amx(x, tiles, out_features)

            same = torch.equal(per_chunk().view(torch.int16), packed().view(torch.int16))
            got = medians({"per_chunk": per_chunk, "packed": packed,
                           "pack_only": lambda: kernels.gguf_pack_tiles(blocks, kinds, in_features, gate, tiles)},
                          repeats=6)
            print(f"{name} {out_features}x{in_features} types {kinds} rows {rows}: same bits {same}, {got}", flush=True)


if __name__ == "__main__":
    main()
