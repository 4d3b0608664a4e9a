"""OpenVINO GenAI as a peer: its `ContinuousBatchingPipeline` (Intel's CPU serving engine) for throughput, its
`LLMPipeline` (the one-request pipeline its users call for latency) for single requests, on the same weights.

A GGUF file is handed to OpenVINO GenAI as it is: its own GGUF reader keeps the file's quantization (int4/int8
weights, activations quantized dynamically as ours are), like for like with our compact GGUF products. Its
tokens are checked against ours in every run (`conveyor bench` reports the share that agree); on random-weight
models they can part at near-ties. An HF folder is exported once by optimum-intel's `optimum-cli export
openvino` (fp16 weight storage, computed in the engine's dtype through `INFERENCE_PRECISION_HINT`) and cached under
~/.cache/conveyor-bench/openvino/; `ir_of_gguf=True` does the same for a GGUF file (dequantized to an HF folder by
transformers first: 16-bit weights, not the file's).

optimum-intel 2.2 pins transformers < 5.6 (ours is newer), so the export runs in a separate venv made by
`scripts/install_openvino.sh` (path in $CONVEYOR_OPENVINO_EXPORTER or the default below); the run itself only
needs `openvino-genai` in this venv. Settings matched to ours: the same thread count (`INFERENCE_NUM_THREADS`),
the same KV cache kind (`KV_CACHE_PRECISION`: the compute dtype against our exact cache, u8 - OpenVINO's CPU
default, lossy - against our kv_cache_dtype='int8'), the same sequence and token budgets (`SchedulerConfig`), no
prefix caching, greedy, EOS ignored.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from conveyor.bench.workloads import Workload

logger = logging.getLogger(__name__)

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "conveyor-bench")
DEFAULT_EXPORTER = os.path.join(CACHE, "optimum-intel-2.2.0", "bin", "python")
_PRECISION = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def exporter_python() -> str:
    return os.environ.get("CONVEYOR_OPENVINO_EXPORTER", DEFAULT_EXPORTER)


def cached_ir(model_path: str) -> str:
    """Where the IR of `model_path` lives (exported or not), keyed by the weights' contents (size and the first
    and last MiB of each file), not their path: every checkout of the same model shares one export."""
    if os.path.isfile(os.path.join(model_path, "openvino_model.xml")):
        return model_path
    real = os.path.realpath(model_path)
    files = sorted(os.path.join(real, f) for f in os.listdir(real)) if os.path.isdir(real) else [real]
    digest = hashlib.sha1()
    for path in files:
        if os.path.isfile(path):
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                digest.update(f"{os.path.basename(path)}:{size}:".encode() + f.read(2**20))
                f.seek(max(0, size - 2**20))
                digest.update(f.read(2**20))
    name = os.path.basename(real.rstrip("/")).removesuffix(".gguf")
    return os.path.join(CACHE, "openvino", f"{name}-{digest.hexdigest()[:12]}")


def unavailable(model_path: str) -> str | None:
    """None when the peer can run here, else a sentence saying why not."""
    if importlib.util.find_spec("openvino_genai") is None:
        return "openvino-genai is not installed; `bash scripts/install_openvino.sh` installs it"
    if model_path.endswith(".gguf"):  # read directly (its GGUF reader)
        return None
    if os.path.isfile(os.path.join(cached_ir(model_path), "openvino_model.xml")):
        return None
    if not os.path.isfile(exporter_python()):
        return (
            f"no OpenVINO IR of {model_path} yet and no optimum-intel to export one ({exporter_python()} is "
            f"missing); `bash scripts/install_openvino.sh` makes it"
        )
    return None


def export_ir(model_path: str) -> str:
    """The cached IR of `model_path`, exported first if missing (minutes for a 1B model; logged)."""
    model_path = os.path.abspath(model_path)  # the exporter runs elsewhere, and reads a relative path as a hub id
    target = cached_ir(model_path)
    if os.path.isfile(os.path.join(target, "openvino_model.xml")):
        return target
    staging = f"{target}.partial{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    start = time.perf_counter()
    try:
        source = model_path
        if model_path.endswith(".gguf"):
            source = os.path.join(staging, "hf")
            logger.warning("openvino peer: dequantizing %s to an HF folder with transformers", model_path)
            _run([sys.executable, "-m", "conveyor.bench.openvino_peer", "dequantize", model_path, source])
        logger.warning("openvino peer: exporting %s to an OpenVINO IR (optimum-cli, once per model)", model_path)
        ir = os.path.join(staging, "ir")
        _run(
            [
                exporter_python(),
                "-m",
                "optimum.commands.optimum_cli",
                "export",
                "openvino",
                "--model",
                source,
                "--task",
                "text-generation-with-past",
                "--weight-format",
                "fp16",
                ir,
            ]
        )
        os.replace(ir, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.warning("openvino peer: IR ready in %s (%.0f s)", target, time.perf_counter() - start)
    return target


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")


def dequantize(gguf_path: str, out_dir: str) -> None:
    """GGUF file -> HF folder (bfloat16 safetensors, tokenizer) through transformers' GGUF reader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # transformers refuses to save a model it read from GGUF; a plain model of the same config takes its tensors
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def _kv_shape(model_path: str) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a GGUF file or an IR's config.json."""
    if model_path.endswith(".gguf"):
        from conveyor.model.gguf_file import read_gguf

        meta = read_gguf(model_path)
        arch = meta.field("general.architecture")
        heads = meta.field(f"{arch}.attention.head_count")
        kv_heads = meta.field(f"{arch}.attention.head_count_kv", heads)
        head_dim = meta.field(f"{arch}.attention.key_length") or meta.field(f"{arch}.embedding_length") // heads
        return meta.field(f"{arch}.block_count"), kv_heads, head_dim
    with open(os.path.join(model_path, "config.json")) as f:
        spec = json.load(f)
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    return spec["num_hidden_layers"], spec["num_key_value_heads"], head_dim


def pipeline_source(model_path: str, ir_of_gguf: bool = False) -> tuple[str, str]:
    """(what OpenVINO GenAI loads, how to name it in a note): a GGUF file itself, else the cached IR."""
    if model_path.endswith(".gguf") and not ir_of_gguf:
        return os.path.abspath(model_path), "the GGUF file itself (its GGUF reader)"
    return export_ir(model_path), "an optimum-cli fp16 IR"


class OpenVINOPipeline:
    """A ContinuousBatchingPipeline over the GGUF file or the IR, sized like our engine."""

    def __init__(
        self,
        model_path: str,
        dtype: str,
        threads: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_tokens: int,
        kv_cache_dtype: str = "auto",
    ) -> None:
        import openvino_genai as ov_genai

        source, described = pipeline_source(model_path)
        layers, kv_heads, head_dim = _kv_shape(source)
        precision = _PRECISION.get(dtype, "f32")
        kv_precision = "u8" if kv_cache_dtype == "int8" else precision  # its 8-bit cache against our int8 one
        kv_bytes = kv_tokens * 2 * layers * kv_heads * head_dim * {"f32": 4, "u8": 1}.get(kv_precision, 2)
        scheduler = ov_genai.SchedulerConfig()
        scheduler.max_num_seqs = max_num_seqs
        scheduler.max_num_batched_tokens = max_num_batched_tokens
        scheduler.cache_size = max(1, math.ceil(1.25 * kv_bytes / 2**30))  # GB, 25% over the workload's need
        scheduler.enable_prefix_caching = False
        scheduler.dynamic_split_fuse = True  # chunked prefill under the token budget, as ours
        self.properties = {
            "INFERENCE_NUM_THREADS": threads,
            "INFERENCE_PRECISION_HINT": precision,
            "KV_CACHE_PRECISION": kv_precision,
        }
        self.ov_genai = ov_genai
        self.pipe = ov_genai.ContinuousBatchingPipeline(source, scheduler, "CPU", self.properties)
        self.note = (
            f"openvino-genai {ov_genai.__version__.split('-')[0]} ContinuousBatchingPipeline on "
            f"{described}; {precision} compute, {kv_precision} KV cache, {threads} threads, max_num_seqs "
            f"{max_num_seqs}, max_num_batched_tokens {max_num_batched_tokens}, cache {scheduler.cache_size} GB"
        )

    def config(self, new_tokens: int) -> Any:
        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = new_tokens
        config.ignore_eos = True
        config.do_sample = False
        return config

    @staticmethod
    def ids(prompt: list[int]) -> Any:
        import numpy as np
        import openvino as ov

        return ov.Tensor(np.array([prompt], dtype=np.int64))

    def generate(self, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
        results = self.pipe.generate([self.ids(p) for p in prompts], [self.config(n) for n in new_tokens])
        return [list(r.m_generation_ids[0]) for r in results]


def run_workload(
    model_path: str,
    workload: Workload,
    dtype: str,
    threads: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_dtype: str = "auto",
) -> tuple[float, list[list[int]], str]:
    """The whole workload in one `generate` call (its own continuous batching) -> (seconds, each request's output
    tokens, note)."""
    wants = [p.max_tokens or 16 for p in workload.params]
    longest = max(len(p) + n for p, n in zip(workload.prompts, wants))
    pipeline = OpenVINOPipeline(
        model_path,
        dtype,
        threads,
        max_num_seqs,
        max_num_batched_tokens,
        min(max_num_seqs, len(wants)) * longest,
        kv_cache_dtype,
    )
    pipeline.generate([workload.prompts[0][:8]], [2])  # warm-up (first inference compiles kernels)
    start = time.perf_counter()
    outputs = pipeline.generate(workload.prompts, wants)
    seconds = time.perf_counter() - start
    short = [i for i, (out, want) in enumerate(zip(outputs, wants)) if len(out) != want]
    if short:
        raise RuntimeError(
            f"openvino peer: {len(short)} requests did not produce their max_tokens (first: request "
            f"{short[0]}, {len(outputs[short[0]])} of {wants[short[0]]} tokens)"
        )
    return seconds, outputs, pipeline.note


def _token_times(ov_genai: Any) -> Any:
    """A streamer that notes when each token arrives."""

    class TokenTimes(ov_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def write(self, token: Any) -> Any:
            self.times.extend([time.perf_counter()] * (len(token) if isinstance(token, list) else 1))
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return TokenTimes()


class OpenVINOLatency:
    """One request at a time through `LLMPipeline` (conveyor.bench.latency.LatencyRunner): the pipeline OpenVINO
    GenAI's users call for a single stream, with its prompt prefilled at once. Its prefix cache is off: on by
    default, it would serve each repeat of the same prompt from the previous run's KV (a first token in
    milliseconds), while ours is cleared before each run. TTFT and TPOT are wall-clock times seen by a streamer."""

    def __init__(
        self,
        model_path: str,
        prompt: list[int],
        output_len: int,
        dtype: str,
        threads: int,
        max_num_batched_tokens: int,
        kv_cache_dtype: str = "auto",
    ) -> None:
        import openvino_genai as ov_genai

        source, described = pipeline_source(model_path)
        precision = _PRECISION.get(dtype, "f32")
        kv_precision = "u8" if kv_cache_dtype == "int8" else precision
        layers, kv_heads, head_dim = _kv_shape(source)
        element = {"f32": 4, "u8": 1}.get(kv_precision, 2)
        kv_bytes = (len(prompt) + output_len) * 2 * layers * kv_heads * head_dim * element
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        scheduler.cache_size = max(1, math.ceil(1.25 * kv_bytes / 2**30))  # GB
        self.ov_genai = ov_genai
        self.pipe = ov_genai.LLMPipeline(
            source,
            "CPU",
            INFERENCE_NUM_THREADS=threads,
            INFERENCE_PRECISION_HINT=precision,
            KV_CACHE_PRECISION=kv_precision,
            scheduler_config=scheduler,
        )
        self.note = (
            f"openvino-genai {ov_genai.__version__.split('-')[0]} LLMPipeline on {described}; {precision} compute, "
            f"{kv_precision} KV cache, {threads} threads"
        )
        self.prompt, self.output_len = prompt, output_len

    def once(self) -> tuple[float, float]:
        import numpy as np
        import openvino as ov

        config = self.ov_genai.GenerationConfig()
        config.max_new_tokens = config.min_new_tokens = self.output_len
        config.ignore_eos = True
        config.do_sample = False
        ids = np.array([self.prompt], dtype=np.int64)
        inputs = self.ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        streamer = _token_times(self.ov_genai)
        start = time.perf_counter()
        self.pipe.generate(inputs, config, streamer)
        end = time.perf_counter()
        if len(streamer.times) != self.output_len:
            raise RuntimeError(f"openvino peer: the request produced {len(streamer.times)} of {self.output_len} tokens")
        return streamer.times[0] - start, (end - streamer.times[0]) / (self.output_len - 1)

    def close(self) -> None:
        del self.pipe


if __name__ == "__main__":  # python -m conveyor.bench.openvino_peer dequantize GGUF OUT_DIR (used by export_ir)
    if len(sys.argv) != 4 or sys.argv[1] != "dequantize":
        sys.exit("usage: python -m conveyor.bench.openvino_peer dequantize GGUF_FILE OUT_DIR")
    dequantize(sys.argv[2], sys.argv[3])
