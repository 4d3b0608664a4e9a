"""How much memory does a loaded model take: weights held against the checkpoint's bytes, KV cache, and RSS over both?

The bytes of weights the model holds (GGUF blocks, float tensors, AMX tiles, oneDNN packs) against the
checkpoint's tensor bytes (a GGUF file's, or a Hugging Face folder's safetensors), the KV cache, and the
process RSS after load (anonymous and file-backed), which also holds torch's runtime and the tokenizer;
`rss_minus_weights_and_kv` is what the engine costs beyond weights and KV. Also the load time. Prints JSON.

    .venv/bin/python benchmarks/tools/gguf_memory.py /work/ckpt/llama-1b-q4_k_m.gguf --gguf-weights compact
    .venv/bin/python benchmarks/tools/gguf_memory.py /work/ckpt/llama-1b --kv-cache-memory default
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import conveyor  # noqa: F401  (sets the OpenMP spin count before torch loads)


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, RssAnon, RssFile, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _checkpoint_bytes(model: str) -> int:
    """The tensor bytes of a GGUF file, or of a folder's safetensors files."""
    if os.path.isdir(model):
        from safetensors import safe_open

        total = 0
        for name in sorted(os.listdir(model)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(model, name), "pt") as f:
                    for key in f:
                        piece = f.get_slice(key)
                        total += math.prod(piece.get_shape()) * _DTYPE_BYTES[piece.get_dtype()]
        return total
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(model).tensors)


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


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
        return sum(
            _tensor_bytes(v, seen)
            for k, v in fields.items()
            if k not in ("kernels", "rotary", "local_rotary", "spec", "ops")
        )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--gguf-weights", default="compact")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="'default': the engine's own sizing rule")
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    from conveyor import LLM

    file_bytes = _checkpoint_bytes(args.model)
    before = _rss_bytes()
    start = time.perf_counter()
    kv = {} if args.kv_cache_memory == "default" else {"kv_cache_memory": args.kv_cache_memory}
    gguf = {} if os.path.isdir(args.model) else {"gguf_weights": args.gguf_weights}
    llm = LLM(model=args.model, max_model_len=args.max_model_len, **gguf, **kv)
    load_s = time.perf_counter() - start
    runner = llm.engine.runner
    model = runner.model
    weights = _tensor_bytes([model.embed, model.final_norm, model.lm_head, model.layers], set())
    kv_bytes = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in runner.kv_caches)
    rss = _rss_bytes()
    print(
        json.dumps(
            {
                "model": args.model,
                "gguf_weights": gguf.get("gguf_weights"),
                "file_tensor_bytes": file_bytes,
                "weight_bytes_held": weights,
                "ratio": round(weights / file_bytes, 3),
                "kv_cache_bytes": kv_bytes,
                "kv_cache_memory": args.kv_cache_memory,
                "rss_before_load": before,
                "rss_after_load": rss,
                "rss_anon": _status_bytes("RssAnon"),
                "rss_file": _status_bytes("RssFile"),
                "rss_minus_weights_and_kv": rss - weights - kv_bytes,
                "peak_rss": _status_bytes("VmHWM"),
                "load_s": round(load_s, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
