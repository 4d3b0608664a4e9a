"""Memory of a GGUF model loaded with its quantized weights kept compact: the bytes of weights the model holds
(GGUF blocks, float tensors, oneDNN packs) against the file's tensor bytes, and the process RSS after load
(which also holds the KV cache, torch's runtime and the tokenizer). Prints JSON.

    .venv/bin/python benchmarks/gguf_memory.py /work/ckpt/llama-1b-q4_k_m.gguf --gguf-weights compact
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor_bytes(obj: object, seen: set[int]) -> int:
    """Bytes of every tensor reachable from a projection / layer object (each storage counted once)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_mkldnn:
            return obj.numel() * obj.element_size()
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o, seen) for o in obj)
    if hasattr(obj, "__dict__") or hasattr(obj, "__dataclass_fields__"):
        fields = vars(obj) if hasattr(obj, "__dict__") else {n: getattr(obj, n) for n in obj.__dataclass_fields__}
        return sum(_tensor_bytes(v, seen) for k, v in fields.items() if k not in ("kernels", "rotary", "local_rotary",
                                                                                    "spec", "ops"))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--gguf-weights", default="compact")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    args = parser.parse_args()
    from gguf import GGUFReader

    from conveyor import LLM

    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(args.model).tensors)
    before = _rss_bytes()
    start = time.perf_counter()
    llm = LLM(model=args.model, gguf_weights=args.gguf_weights, kv_cache_memory=args.kv_cache_memory,
              max_model_len=1024)
    load_s = time.perf_counter() - start
    model = llm.engine.runner.model
    weights = _tensor_bytes([model.embed, model.final_norm, model.lm_head, model.layers], set())
    print(json.dumps({"model": args.model, "gguf_weights": args.gguf_weights, "file_tensor_bytes": file_bytes,
                      "weight_bytes_held": weights, "ratio": round(weights / file_bytes, 3),
                      "rss_before_load": before, "rss_after_load": _rss_bytes(),
                      "kv_cache_memory": args.kv_cache_memory, "load_s": round(load_s, 1)}, indent=1))


if __name__ == "__main__":
    main()
