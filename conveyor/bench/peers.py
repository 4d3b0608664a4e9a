"""The same workload on a peer engine, in the same process, for side-by-side numbers.

- hf-generate:   transformers `generate` in static batches (left padding), the model loaded by
                 transformers from the same file, in the dtype our engine computes in (like with like)
- hf-continuous: transformers' continuous batching (`generate_batch`), same model
- llama-cpp:     llama.cpp (llama-cpp-python's C API) on the same GGUF file, batched, when installed
                 (optional: scripts/install_llama_cpp.sh)
- openvino:      OpenVINO GenAI's ContinuousBatchingPipeline on an IR of the same weights, when installed
                 (optional: scripts/install_openvino.sh; conveyor/bench/openvino_peer.py says how)
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any

from conveyor.bench.workloads import Workload
from conveyor.errors import ConfigError

PEERS = ("hf-generate", "hf-continuous", "llama-cpp", "openvino")


@dataclass
class PeerResult:
    peer: str
    seconds: float
    output_tokens: int
    note: str = ""
    tokens: list[list[int]] | None = None
    """Each request's output tokens, in workload order, where the peer returns them."""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def check_peer(peer: str, model_path: str) -> str | None:
    """None when the peer can run here, else a sentence saying why not."""
    if peer not in PEERS:
        raise ConfigError(f"unknown peer {peer!r}; choose among {', '.join(PEERS)}")
    if peer == "llama-cpp":
        if not model_path.endswith(".gguf"):
            return f"llama.cpp reads GGUF files only, and the model is {model_path}"
        if importlib.util.find_spec("llama_cpp") is None:
            return (
                "llama-cpp-python is not installed; `bash scripts/install_llama_cpp.sh` builds it (a plain "
                "`pip install llama-cpp-python` builds for this CPU, AMX included, whose matmul crashed here)"
            )
        return None
    if peer == "openvino":
        from conveyor.bench.openvino_peer import unavailable

        return unavailable(model_path)
    if not model_path.endswith(".gguf"):
        return None
    if importlib.util.find_spec("accelerate") is None:
        return "transformers needs `accelerate` to load a GGUF file; `pip install accelerate`"
    return None


def hf_model(model_path: str, dtype: str) -> Any:
    """transformers' model of the same file in `dtype` ('bfloat16', 'float32', ...: the dtype ours computes in)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if model_path.endswith(".gguf"):
        from transformers import GgufConfig

        # dense weights in `dtype`: transformers would otherwise keep quantized blocks where its optional
        # `kernels` package has a GGUF matmul, computing in float32 (not the dtype compared)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path),
            gguf_file=os.path.basename(model_path),
            dtype=torch_dtype,
            quantization_config=GgufConfig(dequantize=True),
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.eval()


def run_hf_generate(model_path: str, workload: Workload, batch_size: int, dtype: str) -> PeerResult:
    import torch

    model = hf_model(model_path, dtype)
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))  # less padding
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            longest = max(len(workload.prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), longest, dtype=torch.long)
            mask = torch.zeros(len(idx), longest, dtype=torch.long)
            for row, i in enumerate(idx):  # left padding
                p = workload.prompts[i]
                ids[row, longest - len(p) :] = torch.tensor(p)
                mask[row, longest - len(p) :] = 1
            new = max(workload.params[i].max_tokens or 16 for i in idx)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=-1,
                pad_token_id=0,
            )
            produced += sum(workload.params[i].max_tokens or 16 for i in idx)
    return PeerResult("hf-generate", time.perf_counter() - start, produced, f"static batches of {batch_size}, {dtype}")


def run_hf_continuous(model_path: str, workload: Workload, dtype: str) -> PeerResult:
    from transformers import GenerationConfig

    model = hf_model(model_path, dtype)
    new = max(p.max_tokens or 16 for p in workload.params)
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(workload.prompts, generation_config=config, progress_bar=False)
    seconds = time.perf_counter() - start
    produced = sum(len(getattr(o, "generated_tokens", []) or []) for o in outputs.values())
    return PeerResult("hf-continuous", seconds, produced, f"transformers generate_batch, defaults, {dtype}")


def run_llama_cpp(model_path: str, workload: Workload, threads: int) -> PeerResult:
    from conveyor.bench.llama_cpp_peer import run_workload

    seconds, produced = run_workload(model_path, workload, threads)
    return PeerResult(
        "llama-cpp",
        seconds,
        produced,
        "llama-cpp-python C API: up to 64 sequences per llama_decode, one KV stream each",
    )


def run_openvino(
    model_path: str,
    workload: Workload,
    dtype: str,
    threads: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_dtype: str = "auto",
) -> PeerResult:
    from conveyor.bench.openvino_peer import run_workload

    seconds, tokens, note = run_workload(
        model_path, workload, dtype, threads, max_num_seqs, max_num_batched_tokens, kv_cache_dtype
    )
    return PeerResult("openvino", seconds, sum(len(t) for t in tokens), note, tokens)
