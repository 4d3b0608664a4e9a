"""EngineConfig: the one frozen configuration that flows downward from the edge.

Built once (by `LLM(...)` or the CLI), validated in `__post_init__`, never mutated.
What start-up discovers (the model's shape, the number of KV blocks) lives in separate
objects (`model.spec.ModelSpec`, `core.kv_cache.CachePlan`), not here.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from conveyor.errors import ConfigError

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's (and PyTorch's) other names for dtypes: accepted everywhere and stored as the name they stand for."""
SUPPORTED_QUANTIZATIONS = (None, "int4_latency", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
"""int4_latency: 4-bit weights for small batches plus a bfloat16 copy for large ones; q*: GGUF formats kept
compact (conveyor/model/gguf_quant.py)."""
RENAMED_QUANTIZATIONS = {"int4": "int4_latency"}
"""Old names still accepted (with a logged note), and what they are called now."""
SUPPORTED_DEVICES = ("auto", "cpu", "cuda")
SUPPORTED_KERNELS = ("auto", "native", "torch")
SUPPORTED_GGUF_WEIGHTS = ("auto", "compact", "dequantize")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "int8")
SUPPORTED_TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory_size(value: int | float | str) -> int | float:
    """'2GiB' -> 2147483648; 0.25 -> 0.25 (a fraction of available memory); 10**9 -> 10**9."""
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(
            f"kv_cache_memory={value!r} is not a size; give bytes (e.g. 2000000000), "
            "a string like '2GiB', or a fraction of available memory in (0, 1]"
        )
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ConfigError(
                f"kv_cache_memory={value!r} must be positive: bytes (e.g. 2000000000), "
                "a string like '2GiB', or a fraction of available memory in (0, 1]"
            )
        if isinstance(value, float) and value > 1:
            return int(value)
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"kv_cache_memory={value!r} is not a size I can read; use bytes, "
            "a unit among B, KB, MB, GB, KiB, MiB, GiB (e.g. '2GiB'), or a fraction like 0.2"
        )
    amount = float(match.group(1))
    if amount <= 0:
        raise ConfigError(
            f"kv_cache_memory={value!r} must be positive: bytes, a size like '2GiB', or a fraction "
            "of available memory in (0, 1]"
        )
    if unit == "" and amount <= 1:
        return amount
    return int(amount * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user can choose about an engine. Each field is also a CLI flag."""

    model: str | None = None
    """Path to a .gguf file or a Hugging Face checkpoint folder; None = the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Compute and KV-cache dtype: 'auto' (float32 for float32 checkpoints; otherwise bfloat16 where
    the CPU/GPU computes it natively, else float32), float32, bfloat16 or float16 ('half' and 'float', vLLM's
    names, mean float16 and float32; float16 computes in float16 on a CPU too)."""
    quantization: str | None = None
    """Weight-only quantization of a checkpoint at load: None; 'q8_0', 'q4_0', 'q4_1', 'q5_0', 'q5_1',
    'q4_k', 'q5_k' or 'q6_k' (CPU with the native kernels: decoder weights and the LM head quantized into
    that GGUF format and kept compact, as a GGUF file of those types is; the LM head in Q8_0); or
    'int4_latency' (formerly 'int4', still accepted; CPU, dtype bfloat16: 4-bit decoder weights in groups of 32
    and an 8-bit LM head for small batches, plus bfloat16 copies of the same weights for large ones, so it takes
    more weight memory than bfloat16, not less). GGUF files need none of this: their quantized weights stay compact."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'."""
    kernels: str = "auto"
    """'auto' (on CPU, native kernels for decode attention, residual add + RMSNorm, SiLU-and-mul, rotary +
    KV-cache write and the int4/int8 products, built once per machine where a C++ compiler exists; else
    torch's ops), 'native' (those, or an error saying why not) or 'torch' (torch's ops only: gather +
    SDPA attention, torch's int4/int8 kernels; any device)."""
    gguf_weights: str = "auto"
    """How a GGUF file's quantized weights of types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K are held:
    'compact' (the file's own blocks, multiplied by the native GGUF kernels: weight memory near the file's
    size, the fastest single-request decoding; CPU with AVX2 + FMA or AVX-512 VNNI, or an error saying why
    not; products of few rows (up to 4 bfloat16 or 32 float32 ones) round the activations to int8 per 32
    columns (per 256 for the K-quants) and use integer dot products, as llama.cpp does with its Q8 activations,
    so greedy answers follow llama.cpp's rather than the exact product's where the two differ),
    'dequantize' (to the compute dtype at load: several times the memory, exact products, faster large
    batches), or 'auto' (compact where the kernels run and the dequantized weights would take over 1 GiB, as a
    1B model's do; else dequantize, so the embedded 135M model keeps its batch throughput and exact products)."""
    kv_cache_dtype: str = "auto"
    """How the KV cache stores keys and values: 'auto' (in the compute dtype: exact) or 'int8' (CPU: per token
    and KV head, int8 codes and a float32 scale, half a bfloat16 cache's bytes and of decode attention's memory
    traffic; lossy, up to 1/254 of a row's largest value per element, like OpenVINO's default u8 cache;
    conveyor/model/kv_int8.py)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's own context length."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = 128
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    kv_cache_memory: int | float | str | None = None
    """KV cache size: bytes, a string like '2GiB', or a fraction of available memory. None = on CPU, room for
    max(max_num_seqs x 256, max_model_len) tokens, capped at 20% of available memory and 2 GiB (a 1B-class
    Llama at 128 sequences: 1 GiB); on CUDA, 80% of free memory capped at max_num_seqs full-length requests."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    async_batching: bool | Literal["auto"] = "auto"
    """Overlap host work with device compute: 'auto', True or False."""
    num_scheduler_steps: int = 8
    """Most decode steps one plan runs back to back (the runner feeds each step's tokens to the next, with no
    scheduling, preparing or committing between them), taken only when nothing waits and every running request
    is a plain greedy decode whose output is returned once, at its end (LLM.generate, `bench throughput`: not a
    streamed one) and can take that many tokens; stops (EOS, stop ids and strings) are then found when the
    tokens are committed, and tokens past one are dropped. 1: one step per plan always. Tensor parallelism and
    sliding windows take one step per plan."""
    seed: int | None = 0
    """Seed of the seeds given to requests that bring none of their own; None = a random one."""
    num_threads: int | None = None
    """CPU threads for torch; None = torch's default."""
    structured_output_timeout: float = 10.0
    """Seconds a structured-output grammar (JSON schema, regex, choice, EBNF) may take to compile; a
    slower one is refused with an error naming it. Compiled grammars are cached per schema."""
    tensor_parallel_size: int = 1
    """Processes that each hold a 1/N shard of every layer (attention heads, MLP width, vocabulary) and of
    the KV cache, joined by one torch.distributed group (gloo, CPU only for now). N must divide the model's
    heads, MLP width and vocabulary, and either divide its KV heads or be a multiple of them (KV heads are
    then replicated: each rank keeps the one its query heads read); other sizes are refused by name."""
    data_parallel_size: int = 1
    """Engine replicas, each a Ray actor holding its own tensor-parallel group (tensor_parallel_size
    processes, placed by a Ray placement group) and its own KV cache; a router in the front process sends
    each request to one replica by prefix affinity, balanced by outstanding tokens. Needs `conveyor[ray]`."""
    ray_address: str | None = None
    """Ray cluster to join for data_parallel_size > 1 ('auto', or the head's host:port as printed by
    `ray start --head`); None = start a private local cluster and shut it down on exit."""
    tool_call_parser: str = "auto"
    """How tool calls are written by the model: 'auto' (chosen from the chat template), 'hermes'
    (Hermes / Qwen <tool_call> JSON), 'llama3_json' (Llama 3.x JSON) or 'mistral' ([TOOL_CALLS])."""

    def __post_init__(self) -> None:
        if self.quantization in RENAMED_QUANTIZATIONS:
            new_name = RENAMED_QUANTIZATIONS[self.quantization]
            logging.getLogger(__name__).warning(
                "quantization=%r is now called %r (it keeps bfloat16 copies of the "
                "weights; 'q4_0' / 'q4_k' keep them compact)",
                self.quantization,
                new_name,
            )
            object.__setattr__(self, "quantization", new_name)
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(
                f"dtype={self.dtype!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_DTYPES)} ('auto' is the default; 'half' and 'float' are float16 and float32)"
            )
        if self.quantization not in SUPPORTED_QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r} is not supported; choose one of "
                f"{', '.join(str(q) for q in SUPPORTED_QUANTIZATIONS)}"
            )
        if self.quantization is not None and self.dtype not in ("auto", "bfloat16"):
            raise ConfigError(
                f"quantization={self.quantization!r} computes with bfloat16 activations, but dtype={self.dtype!r}; "
                f"leave dtype at 'auto' or pass dtype='bfloat16'"
            )
        if self.device not in SUPPORTED_DEVICES:
            raise ConfigError(f"device={self.device!r} is not supported; choose one of {', '.join(SUPPORTED_DEVICES)}")
        if self.gguf_weights not in SUPPORTED_GGUF_WEIGHTS:
            raise ConfigError(
                f"gguf_weights={self.gguf_weights!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_GGUF_WEIGHTS)} ('auto' is the default)"
            )
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)} ('auto' is the default)"
            )
        if self.kv_cache_dtype == "int8" and self.device == "cuda":
            raise ConfigError(
                "kv_cache_dtype='int8' runs on CPU only for now; pass device='cpu', or leave "
                "kv_cache_dtype at 'auto' on a GPU"
            )
        if self.kernels not in SUPPORTED_KERNELS:
            raise ConfigError(
                f"kernels={self.kernels!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_KERNELS)} ('auto' is the default)"
            )
        for name, lowest in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ConfigError(f"{name}={value!r} must be an integer >= {lowest}")
        if self.block_size > 1024:
            raise ConfigError(f"block_size={self.block_size} is too large; use at most 1024 (16 is typical)")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(
                f"max_model_len={self.max_model_len!r} must be an integer >= 2 (or None for the model's own)"
            )
        if self.kv_cache_memory is not None:
            object.__setattr__(self, "kv_cache_memory", parse_memory_size(self.kv_cache_memory))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63
        ):
            raise ConfigError(f"seed={self.seed!r} must be an integer in [0, 2**63), or None for a random one")
        if self.async_batching not in (True, False, "auto"):
            raise ConfigError(f"async_batching={self.async_batching!r} must be 'auto', True or False")
        steps = self.num_scheduler_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 64:
            raise ConfigError(f"num_scheduler_steps={steps!r} must be an integer in [1, 64] (1: one step per plan)")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ConfigError(f"num_threads={self.num_threads!r} must be a positive integer (or None)")
        timeout = self.structured_output_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ConfigError(f"structured_output_timeout={timeout!r} must be a number of seconds in (0, 3600]")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= 64:
            raise ConfigError(f"tensor_parallel_size={tp!r} must be an integer in [1, 64] (1: one process)")
        if tp > 1 and self.device == "cuda":
            raise ConfigError(
                f"tensor_parallel_size={tp} runs on CPU (gloo) only for now; NCCL on CUDA is not "
                f"built yet: pass device='cpu', or tensor_parallel_size=1 on a GPU"
            )
        dp = self.data_parallel_size
        if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= 256:
            raise ConfigError(f"data_parallel_size={dp!r} must be an integer in [1, 256] (1: no replicas)")
        if self.ray_address is not None:
            if not isinstance(self.ray_address, str) or not self.ray_address.strip():
                raise ConfigError(f"ray_address={self.ray_address!r} must be 'auto' or a Ray head's host:port")
            if dp == 1:
                raise ConfigError(
                    f"ray_address={self.ray_address!r} is used only with data_parallel_size > 1; "
                    f"pass --data-parallel-size N, or leave the address out"
                )
        if self.tool_call_parser not in SUPPORTED_TOOL_CALL_PARSERS:
            raise ConfigError(
                f"tool_call_parser={self.tool_call_parser!r} is not supported; choose one of "
                f"{', '.join(SUPPORTED_TOOL_CALL_PARSERS)}"
            )

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def field_docs() -> dict[str, str]:
    """Field name -> its docstring (the string literal after it), for CLI help."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(EngineConfig))
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(node.target, ast.Name)
        ):
            docs[node.target.id] = str(following.value.value)
    return docs
