"""Which CPU is this, which ISA features that matter does it have, and which kernel tier does Conveyor run on it?

Every published result names these (benchmarks/README.md, "Rules"). Prints JSON: the CPU model name, cores,
torch threads, the flags that decide Conveyor's kernels (AMX, AVX-512 BF16 / VNNI, AVX-512 F, AVX2, FMA), the load
average, and the kernels' ISA tier (conveyor/model/isa.py: amx, avx512, avx2 or portable; CONVEYOR_ISA forces a
lower one) with what it offers, or "torch" (no native kernels) with the reason.

Loading the native kernels builds them on first use (minutes, once per machine); --no-kernels reads the CPU's
flags only and leaves the tier out.

    .venv/bin/python benchmarks/tools/machine.py
    .venv/bin/python benchmarks/tools/machine.py --no-kernels
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx512bw", "avx2", "fma")


def cpu_facts() -> dict[str, Any]:
    model: str | None = None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return {"cpu": model, "cores": os.cpu_count(), "isa": {flag: flag in flags for flag in FLAGS}}


def kernel_tier() -> dict[str, Any]:
    from conveyor.model import isa
    from conveyor.model.native import NativeUnavailable, load_kernels

    _, flags = isa.cpu_facts()
    try:
        kernels = load_kernels()
    except NativeUnavailable as exc:
        return {"tier": "torch", "reason": str(exc)}
    return {
        "tier": isa.requested_tier(flags),
        "cpu_best_tier": isa.cpu_tier(flags),
        "bf16_amx": kernels.bf16_amx_available(),
        "gguf_amx": kernels.gguf_amx_available(),
        "prefill_attention_amx": kernels.prefill_attention_available(),
        "avx512_bf16_products": kernels.quant_linear_vectorized(),
        "gguf_int8_dots": kernels.gguf_linear_vectorized(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-kernels", action="store_true", help="the CPU's flags only; do not load the kernels")
    args = parser.parse_args()
    facts = cpu_facts()
    import torch

    import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)

    facts["torch"] = torch.__version__
    facts["torch_threads"] = torch.get_num_threads()
    facts["load_average_1_5_15_min"] = [round(x, 2) for x in os.getloadavg()]
    if not args.no_kernels:
        facts["kernels"] = kernel_tier()
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
