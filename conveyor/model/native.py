"""Native CPU kernels, compiled once per machine at first use (torch.utils.cpp_extension).

Why: on the 2-core AVX-512 machine, decode attention over a paged cache (a gather of every
sequence's blocks into a padded copy, then SDPA) was ~45% of a 64-sequence bfloat16 decode
step, and the tiny per-layer ops of a single-sequence step (RMSNorm, residual adds, SiLU)
cost more in dispatch than in arithmetic. csrc/ holds:
  - decode_attention.cpp: reads K/V in place through the block table (2.8x faster than
    gather + SDPA at 64 sequences, 8x at one; no less exact, checked against float64);
    decode_attention_int8.cpp the same over an int8 cache's pages (kv_int8.h: their layout);
  - prefill_attention.cpp: the causal attention of every prompt chunk of a step in one call, reading K/V
    through the block tables, on AMX tiles (2-4x faster than one torch SDPA call per chunk; see the file);
  - norm_act.cpp: residual add fused with RMSNorm, and SiLU-and-mul (transformers' rounding order);
  - rotary_cache.cpp: rotary embedding of Q and K fused with the KV-cache write (the same); into an int8
    cache (kv_cache_dtype='int8') it writes the codes and scales conveyor/model/kv_int8.py defines, which
    both attention kernels also read in place;
  - quant_linear.cpp: int4 / int8 weight-only products for decode steps of a few rows (int4 one
    row at a time ~15% faster than torch's kernel, the int8 LM head ~1.7x);
  - f32_linear.cpp: float32 products over weights packed in 32-column panels, prefetched a panel
    ahead (all decoder linears of the default model at 8 rows 1.5-2.3x, at 64 rows 1.2-1.5x faster
    than torch's GEMM);
  - amx_product.cpp: the product on AMX tiles (Sapphire Rapids and later), for bfloat16 weights packed once
    at load (bf16_linear.cpp: every row count; 1.2-1.9x oneDNN's packed product over all linears of the
    default model at 1-64 rows, slower on big prefill chunks: benchmarks/RESULTS.md; and a greedy step's LM
    head with its argmax, the logits never written) and for GGUF weights dequantized on the fly;
  - gguf_linear.cpp / gguf_vnni.cpp / gguf_amx.cpp / gguf_bf16.cpp / gguf_dequant.cpp: products with
    GGUF-quantized weights kept in their blocks (few rows: int8 dot products; many rows: AMX tiles where the CPU
    has them, else bfloat16 rows into torch's GEMM; ggml's scalar dequantizers as the reference and the float
    path);
  - token_bitmask.cpp: structured output's grammar masks applied to the logits in place (one read of
    the masks, one write per forbidden token; torch's ops expand every bit into a float first), and
    a greedy row's argmax over its allowed tokens without the write;
  - argmax_rows.cpp: greedy sampling's argmax over bfloat16 or float32 logits (torch's max reduction
    reads them at ~5 GB/s idle, slower beside other work).

It is built for the CPU at hand (-march=native), so the build's name carries a hash of the
sources, the CPU's feature flags and torch's and Python's versions (never the checkout's path): another
CPU or a changed source builds anew (40-200 s on 2 cores, logged at WARNING), an unchanged one loads
from the extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) whichever checkout or
venv asks; concurrent first starts build once (native_build.py). `-ffast-math` applies to the compile
step only (it lets expf vectorize); it is not passed to the link step, so the process's
floating-point mode (denormals) is untouched.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Callable, Protocol

import torch

from conveyor.errors import ConfigError
from conveyor.model.native_build import cached_extension

logger = logging.getLogger(__name__)

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(q [seqs, heads, d], k_cache, v_cache [blocks, block_size, kv_heads, d] in q's dtype or int8 pages
(conveyor/model/kv_int8.py), block_tables [seqs, max_blocks] int64, context_lens [seqs] int64, scale)
-> [seqs, heads, d]."""

PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int,
                             torch.Tensor], None]
"""(q [tokens, heads, d] bfloat16, k_cache, v_cache [blocks, block_size, kv_heads, d] bfloat16 or int8 pages
(conveyor/model/kv_int8.py; every chunk's K/V already written), block_tables [chunks, max_blocks] int64, spans
[chunks, 3] int64 (first row, rows, context length), scale, sliding window (0 for none), out [tokens, heads, d])
-> None: the chunks' rows of out written."""


class NativeKernels(Protocol):
    """The compiled module (see csrc/bindings.cpp)."""

    decode_attention: DecodeAttention
    prefill_attention: PrefillAttention

    def prefill_attention_available(self) -> bool:
        """Whether prefill_attention can run here (built with AMX, AMX-BF16 granted); bfloat16, head_dim a
        multiple of 32."""
        ...

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """hidden [rows, dim] += delta in place (when given); -> RMSNorm(hidden) * weight [rows, dim]."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * inner] -> silu(gate) * up [rows, inner]."""
        ...

    def rotary_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """qkv [tokens, (heads + 2 kv_heads) * d], cos/sin [tokens, d] -> rotated [tokens, heads + kv_heads, d];
        writes rotated K and V to the cache slots."""
        ...

    def quant_linear_vectorized(self) -> bool:
        """Whether int4_linear / int8_linear were built with AVX-512 BF16 (else they raise)."""
        ...

    def int4_linear(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] bfloat16, blocks from quant.pack_int4_blocks, bias [out] bfloat16 -> [rows, out] bfloat16."""
        ...

    def int8_linear(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [rows, in] bfloat16, codes from quant.pack_int8_rows, scale [out] float32 -> [rows, out] bfloat16."""
        ...

    def f32_linear_vectorized(self) -> bool:
        """Whether f32_linear was built with AVX-512 (else it raises)."""
        ...

    def f32_linear(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] float32, panels from layers.pack_f32_panels, bias [out] float32 -> [rows, out] float32."""
        ...


    def apply_token_bitmask_(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits [batch, vocab] float32/bfloat16 (contiguous rows), rows [k] int64, bitmask [k, words] int32:
        sets every token a row's mask forbids to -inf, in place (conveyor/structured/bitmask.py's layout)."""
        ...

    def argmax_allowed(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """The same inputs -> [k] int64: row rows[i]'s first largest logit among the tokens mask i allows (the
        argmax of the masked row, without writing it); 0 for a mask that allows nothing. For finite logits (a
        model's): a NaN is never chosen, where torch's argmax would choose it."""
        ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, vocab] float32 or bfloat16 -> [rows] int64: torch's max(dim=-1).indices (csrc/argmax_rows.cpp)."""
        ...

    def bf16_amx_available(self) -> bool:
        """Whether bf16_linear_amx can run here (built with AMX, the CPU has AMX-BF16, Linux granted tile
        data)."""
        ...

    def bf16_linear_amx(self, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
        """x [rows, in] bfloat16, tiles from layers.pack_bf16_tiles -> x W^T [rows, out] bfloat16 on AMX tiles (any
        rows; raises where bf16_amx_available() is false)."""
        ...

    def bf16_linear_argmax_amx(self, x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
        """The same operands as bf16_linear_amx -> [rows] int64: argmax_rows(bf16_linear_amx(x, tiles, out_features)),
        the first NaN, else the first largest value of each row, without writing the product."""
        ...

    def bf16_silu_gate_amx(self, x: torch.Tensor, tiles: torch.Tensor, inner: int) -> torch.Tensor:
        """x [rows, in] bfloat16, tiles of [Wg; Wu] [2 inner, in] from layers.pack_bf16_tiles(interleave_gate_up(W))
        -> silu(x Wg^T) * (x Wu^T) [rows, inner] bfloat16, rounded as bf16_linear_amx then silu_and_mul would."""
        ...

    def gguf_linear_vectorized(self) -> bool:
        """Whether the GGUF products were built with AVX-512 BF16 and VNNI (else gguf_quant dequantizes at load)."""
        ...

    def gguf_dequantize(self, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """blocks [rows, row bytes] uint8 of GGML type id `kind` -> float32 [rows, in_features]."""
        ...

    def gguf_linear_rows(self, x: torch.Tensor, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """x [rows, in] float32/bfloat16, blocks [out, row bytes] -> x W^T [rows, out] in x's dtype (few rows)."""
        ...

    def gguf_linear_rows_parts(self, x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int],
                               in_features: int) -> torch.Tensor:
        """x [rows, in], blocks[i] [out_i, row bytes_i] of GGML type kinds[i] -> x [W_1; W_2; ...]^T
        [rows, sum out_i] (few rows; the activations quantized once for all of them)."""
        ...

    def gguf_linear_tiles(self, x: torch.Tensor, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """The same product by dequantized tiles of W and torch's GEMM (many rows)."""
        ...

    def decode_layers(self, hidden: torch.Tensor, input_norms: list[torch.Tensor], qkv_tiles: list[torch.Tensor],
                      o_tiles: list[torch.Tensor], post_norms: list[torch.Tensor],
                      gate_up_tiles: list[torch.Tensor], down_tiles: list[torch.Tensor],
                      k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cos_table: torch.Tensor,
                      sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor,
                      context_lens: torch.Tensor, heads: int, kv_heads: int, head_dim: int, inner: int, eps: float,
                      scale: float) -> torch.Tensor:
        """A pure-decode step's plain Llama layers in one call (decode_layers.cpp; model/decode_stack.py): hidden
        [tokens, hidden] (updated in place) -> the last layer's output [tokens, hidden], before the final norm;
        cos_table, sin_table: RotaryEmbedding's float32 tables, of which it takes the rows at `positions`."""
        ...

    def gguf_amx_available(self) -> bool:
        """Whether gguf_linear_amx can run here (built with AMX, the CPU has AMX-BF16, Linux granted tile data)."""
        ...

    def gguf_linear_amx(self, x: torch.Tensor, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """The same product for bfloat16 x on AMX tiles, weights dequantized 32 rows at a time for each chunk of
        activation rows (many rows); raises where gguf_amx_available() is false."""
        ...

    def gguf_linear_amx_parts(self, x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int],
                              in_features: int) -> torch.Tensor:
        """gguf_linear_amx over a row stack of matrices of mixed types (as gguf_linear_rows_parts), in one
        call: one packing of x, one output [rows, sum out_i]."""
        ...

    def gguf_pack_tiles(self, blocks: list[torch.Tensor], kinds: list[int], in_features: int, gate_up: bool,
                        tiles: torch.Tensor) -> None:
        """A row stack of GGUF matrices (as gguf_linear_amx_parts) dequantized to bfloat16 into `tiles` [rows / 16
        (rounded up to even), in / 32, 16, 32], laid out as pack_bf16_tiles (of interleave_gate_up's rows where
        gate_up) lays them out, for bf16_linear_amx / bf16_silu_gate_amx; the values gguf_linear_amx multiplies."""
        ...


_HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vec_bf16.h", "gguf_vnni.h",
                                                                              "gguf_amx.h", "gguf_dequant.h",
                                                                              "amx_product.h", "kernels.h",
                                                                              "kv_int8.h", "decode_attention.h",
                                                                              "stack_parts.h", "team.h")]
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bindings.cpp", "decode_attention.cpp",
                                                            "decode_attention_int8.cpp",
                                                            "prefill_attention.cpp", "norm_act.cpp",
                                                            "rotary_cache.cpp", "quant_linear.cpp", "argmax_rows.cpp",
                                                            "f32_linear.cpp", "token_bitmask.cpp",
                                                            "gguf_linear.cpp", "gguf_vnni.cpp", "gguf_amx.cpp",
                                                            "gguf_bf16.cpp", "gguf_dequant.cpp", "amx_product.cpp",
                                                            "bf16_linear.cpp",
                                                            "decode_layers.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-ffp-contract=off", "-fno-strict-aliasing"]
"""-ffp-contract=off: no fused multiply-adds the source does not write, so that float32 results round
like torch's separate kernels (the attention kernel's explicit FMA intrinsics are unaffected)."""
_LDFLAGS = ["-fopenmp", "-lmvec"]


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


class NoToolchain(NativeUnavailable):
    """This machine has nothing to build them with (not Linux, or no C++ compiler / ninja); a build
    that was attempted and failed raises plain NativeUnavailable."""


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package installs it beside this interpreter,
    which is not on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    if scripts and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _require_toolchain() -> None:
    """Only a build needs these; a cached build loads without them."""
    _ensure_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise NoToolchain(f"building the native kernels needs {' and '.join(missing)} on PATH "
                          f"(install a C++ compiler such as g++, and `pip install ninja`)")


@functools.cache
def load_kernels() -> NativeKernels:
    """The compiled kernels; raises NativeUnavailable (with the reason and the fix) where they cannot be had."""
    import platform

    if platform.system() != "Linux":
        raise NoToolchain(f"native kernels are built on Linux only (this is {platform.system()})")
    try:
        module = cached_extension("conveyor_kernels", _SOURCES, _HEADERS, _CFLAGS, _LDFLAGS, "native kernels",
                                  before_build=_require_toolchain)
    except NoToolchain:
        raise
    except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError / OSError
        text = str(exc).strip().splitlines()
        raise NativeUnavailable(f"building the native kernels failed: {text[-1] if text else exc!r}") from exc
    kernels: NativeKernels = module
    return kernels


def resolve_kernels(backend: str, device: torch.device) -> NativeKernels | None:
    """config.kernels -> the native kernels, or None for the torch reference ops."""
    if backend == "torch" or (backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ConfigError(f"kernels='native' are CPU kernels and cannot run on {device}; "
                          f"use kernels='auto' or 'torch'")
    try:
        return load_kernels()
    except NativeUnavailable as exc:
        if backend == "native":
            raise ConfigError(f"kernels='native' was requested, but {exc}; "
                              f"or use kernels='auto' (falls back to torch) or 'torch'") from exc
        logger.warning("native kernels unavailable (%s); using torch's ops (gather + SDPA attention, slower)", exc)
        return None
