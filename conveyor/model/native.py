"""Native CPU kernels, compiled once per machine at first use (torch.utils.cpp_extension).

Why: decode attention over a paged cache done by torch gathers every sequence's blocks into a padded copy before
SDPA, and the tiny per-layer ops of a small decode step (RMSNorm, residual adds, SiLU) cost more in dispatch than
in arithmetic. csrc/ holds, one op (or family) per source:
  - decode_attention.cpp: reads K/V in place through the block table (checked against float64);
    decode_attention_int8.cpp the same over an int8 cache's pages (kv_int8.h: their layout);
  - prefill_attention.cpp: the causal attention of every prompt chunk of a step in one call, reading K/V through
    the block tables, on AMX tiles;
  - norm_act.cpp: residual add fused with RMSNorm, and SiLU-and-mul (transformers' rounding order);
  - rotary_cache.cpp: rotary embedding of Q and K fused with the KV-cache write (the same); into an int8 cache
    (kv_cache_dtype='int8') it writes the codes and scales conveyor/model/kv_int8.py defines, which both attention
    kernels also read in place;
  - quant_linear.cpp: int4 / int8 weight-only products for decode steps of a few rows;
  - f32_linear.cpp: float32 products over weights packed in 32-column panels, prefetched a panel ahead;
  - amx_product.cpp: the product on AMX tiles, for bfloat16 weights packed once at load (bindings.cpp's
    bf16_linear_amx: every
    row count, and a greedy step's LM head with its argmax, the logits never written) and for GGUF weights
    dequantized on the fly; decode_layers.cpp: a pure-decode step's layers in one call over those products;
  - gguf_linear.cpp / gguf_vnni.cpp / gguf_amx.cpp / gguf_bf16.cpp / gguf_dequant.cpp: products with
    GGUF-quantized weights kept in their blocks (few rows: int8 dot products; many rows: AMX tiles where the CPU
    has them, else bfloat16 rows into torch's GEMM; ggml's scalar dequantizers as the reference and the float
    path);
  - token_bitmask.cpp: structured output's grammar masks applied to the logits in place, and a greedy row's
    argmax over its allowed tokens without the write;
  - argmax_rows.cpp: greedy sampling's argmax over bfloat16 or float32 logits.

Build layout. The kernel sources are plain C++ over pointers and sizes (scalar_types.h: the element types;
parallel.h: ATen's split of work, on OpenMP); only bindings.cpp includes torch: it checks the tensors (dtype,
shape, contiguity, device) and calls the kernels with raw pointers. ninja compiles the units in parallel
($MAX_JOBS, else every core). A source is compiled only where the CPU has the instructions it needs
(_SOURCE_NEEDS); each compiled one defines CONVEYOR_WITH_<NAME> for every unit, and where one is absent the
binding unit's functions for it say so (the *_available() / *_vectorized() functions answer False, the ops raise)
and fallbacks.cpp holds the stubs other kernels link against, so the engine takes torch's path there.

It is built for the CPU at hand (-march=native), so the build's name carries a hash of the sources, the flags,
the CPU's feature flags and torch's and Python's versions (never the checkout's path): another CPU or a changed
source builds anew, an unchanged one loads from the extension cache (~/.cache/torch_extensions, or
$TORCH_EXTENSIONS_DIR) whichever checkout or venv asks; concurrent first starts build once (native_build.py).
The engine (kernels='auto') never waits for a compiler: with no build in the cache it starts one in a background
process and runs on torch's ops meanwhile (load_kernels(wait=False)).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from conveyor.errors import ConfigError
from conveyor.model import isa, native_build

logger = logging.getLogger(__name__)

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(q [seqs, heads, d], k_cache, v_cache [blocks, block_size, kv_heads, d] in q's dtype or int8 pages
(conveyor/model/kv_int8.py), block_tables [seqs, max_blocks] int64, context_lens [seqs] int64, scale)
-> [seqs, heads, d]."""

PrefillAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, torch.Tensor], None
]
"""(q [tokens, heads, d] bfloat16, k_cache, v_cache [blocks, block_size, kv_heads, d] bfloat16 or int8 pages
(conveyor/model/kv_int8.py; every chunk's K/V already written), block_tables [chunks, max_blocks] int64, spans
[chunks, 3] int64 (first row, rows, context length), scale, sliding window (0 for none), out [tokens, heads, d])
-> None: the chunks' rows of out written."""


class NativeKernels(Protocol):
    """The compiled module (see csrc/bindings.cpp)."""

    def __hash__(self) -> int:
        """A module hashes by identity (per-module caches key on it: gguf_projection.amx_rows)."""
        ...

    decode_attention: DecodeAttention
    prefill_attention: PrefillAttention

    def prefill_attention_available(self) -> bool:
        """Whether prefill_attention can run here (built with AMX, AMX-BF16 granted); bfloat16, head_dim a
        multiple of 32."""
        ...

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden [rows, dim] += delta in place (when given); -> RMSNorm(hidden) * weight [rows, dim]."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * inner] -> silu(gate) * up [rows, inner]."""
        ...

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
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

    def f32_linear(
        self, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
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
        """logits [rows, vocab] float32 or bfloat16 -> [rows] int64: torch's max(dim=-1).indices
        (csrc/argmax_rows.cpp)."""
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
        """Whether the GGUF products were built with vectorized int8 dot products: AVX-512 VNNI + BF16, or AVX2 +
        FMA (else gguf_quant dequantizes at load)."""
        ...

    def gguf_dequantize(self, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """blocks [rows, row bytes] uint8 of GGML type id `kind` -> float32 [rows, in_features]."""
        ...

    def gguf_linear_rows(
        self, x: torch.Tensor, blocks: torch.Tensor, kind: int, in_features: int, int8_float32: bool = False
    ) -> torch.Tensor:
        """x [rows, in] float32/bfloat16, blocks [out, row bytes] -> x W^T [rows, out] in x's dtype (few rows).
        bfloat16 x, and float32 x where int8_float32, is quantized to int8 for the types with integer dot
        products (per 32 columns, and per 256 for the K-quants); other float32 x is multiplied exactly."""
        ...

    def gguf_linear_rows_parts(
        self,
        x: torch.Tensor,
        blocks: list[torch.Tensor],
        kinds: list[int],
        in_features: int,
        int8_float32: bool = False,
    ) -> torch.Tensor:
        """x [rows, in], blocks[i] [out_i, row bytes_i] of GGML type kinds[i] -> x [W_1; W_2; ...]^T
        [rows, sum out_i] (few rows; the activations quantized once for all of them, as gguf_linear_rows)."""
        ...

    def gguf_linear_tiles(self, x: torch.Tensor, blocks: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
        """The same product by dequantized tiles of W and torch's GEMM (many rows)."""
        ...

    def decode_layers(
        self,
        hidden: torch.Tensor,
        input_norms: list[torch.Tensor],
        qkv_tiles: list[torch.Tensor],
        o_tiles: list[torch.Tensor],
        post_norms: list[torch.Tensor],
        gate_up_tiles: list[torch.Tensor],
        down_tiles: list[torch.Tensor],
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        heads: int,
        kv_heads: int,
        head_dim: int,
        inner: int,
        eps: float,
        scale: float,
    ) -> torch.Tensor:
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

    def gguf_linear_amx_parts(
        self, x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int], in_features: int
    ) -> torch.Tensor:
        """gguf_linear_amx over a row stack of matrices of mixed types (as gguf_linear_rows_parts), in one
        call: one packing of x, one output [rows, sum out_i]."""
        ...

    def gguf_silu_gate_amx_parts(
        self, x: torch.Tensor, blocks: list[torch.Tensor], kinds: list[int], in_features: int
    ) -> torch.Tensor:
        """The same operands as gguf_linear_amx_parts, for a SiLU MLP's interleaved gate/up stack -> silu(gate) * up
        [rows, sum out_i / 2], the activation applied to the product's accumulators."""
        ...

    def gguf_pack_tiles(
        self, blocks: list[torch.Tensor], kinds: list[int], in_features: int, gate_up: bool, tiles: torch.Tensor
    ) -> None:
        """A row stack of GGUF matrices (as gguf_linear_amx_parts) dequantized to bfloat16 into `tiles` [rows / 16
        (rounded up to even), in / 32, 16, 32], laid out as pack_bf16_tiles (of interleave_gate_up's rows where
        gate_up) lays them out, for bf16_linear_amx / bf16_silu_gate_amx; the values gguf_linear_amx multiplies."""
        ...


_CSRC = Path(__file__).parent / "csrc"

_HEADERS = [
    _CSRC / name
    for name in (
        "scalar_types.h",
        "parallel.h",
        "vec_bf16.h",
        "gguf_vnni.h",
        "gguf_amx.h",
        "gguf_bf16.h",
        "gguf_dequant.h",
        "amx_product.h",
        "kernels.h",
        "kv_int8.h",
        "decode_attention.h",
        "stack_parts.h",
        "team.h",
    )
]

_AVX512_BF16 = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_AMX = ("amx_tile", "amx_bf16", *_AVX512_BF16)
_SOURCE_NEEDS: dict[str, tuple[str, ...]] = {
    # source: the /proc/cpuinfo flags it needs (all of them); compiled only where the CPU has every one
    "bindings.cpp": (),
    "fallbacks.cpp": (),
    "decode_attention.cpp": (),
    "decode_attention_int8.cpp": (),
    "norm_act.cpp": (),
    "rotary_cache.cpp": (),
    "argmax_rows.cpp": (),
    "token_bitmask.cpp": (),
    "gguf_linear.cpp": (),
    "gguf_dequant.cpp": (),
    "f32_linear.cpp": ("avx512f",),
    "quant_linear.cpp": _AVX512_BF16,
    "gguf_vnni.cpp": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "gguf_int8_avx2.cpp": ("avx2", "fma"),  # empty where gguf_vnni.cpp is compiled (the same interface)
    "gguf_bf16.cpp": ("avx512f", "avx512bw", "avx512_bf16"),
    "amx_product.cpp": _AMX,
    "gguf_amx.cpp": _AMX,
    "prefill_attention.cpp": _AMX,
    "decode_layers.cpp": _AMX,
}
"""bindings.cpp's bf16_linear_amx, bf16_silu_gate_amx and bf16_linear_argmax_amx are amx_product.cpp's packed products
behind their checks; decode_layers.cpp runs them with the small ops in one parallel region."""


def selected_sources(cpu_flags: set[str] | None = None) -> list[Path]:
    """The sources this CPU can use (all of _SOURCE_NEEDS' where cpu_flags has what each needs)."""
    flags = set(native_build.cpu_flags().split()) if cpu_flags is None else cpu_flags
    return [_CSRC / name for name, needs in _SOURCE_NEEDS.items() if set(needs) <= flags]


def _defines(sources: list[Path]) -> list[str]:
    """-DCONVEYOR_WITH_<STEM> for each compiled kernel source: the binding unit and fallbacks.cpp read them."""
    return [
        f"-DCONVEYOR_WITH_{source.stem.upper()}"
        for source in sources
        if source.name not in ("bindings.cpp", "fallbacks.cpp")
    ]


_CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
]
"""No -ffast-math: it lets the compiler assume there are no infinities or NaNs, while the kernels mask with -inf
and test for NaN. -fno-math-errno and -fno-trapping-math are safe (no errno from sqrt, no FP traps: every value
is still IEEE), and let sqrt and the comparisons inline. The exponentials that need to be fast are explicit
(vec_bf16.h's exp_ps / exp2_ps); the scalar fallbacks call libm's expf. -ffp-contract=off: no fused multiply-adds
the source does not write, so that float32 results round like torch's separate kernels (explicit FMA intrinsics
are unaffected)."""
_LDFLAGS = ["-fopenmp"]


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
        raise NoToolchain(
            f"building the native kernels needs {' and '.join(missing)} on PATH "
            f"(install a C++ compiler such as g++, and `pip install ninja`)"
        )


def kernel_tier() -> str:
    """The ISA tier the kernels are built for here (conveyor/model/isa.py): the CPU's best, or $CONVEYOR_ISA's."""
    return isa.requested_tier(set(native_build.cpu_flags().split()))


def _build_inputs() -> tuple[list[Path], list[str]]:
    """This CPU's sources and the flags they compile with at the tier in use (the defines name the sources
    compiled)."""
    flags = set(native_build.cpu_flags().split())
    tier = isa.requested_tier(flags)
    sources = selected_sources(isa.tier_flags(flags, tier))
    return sources, [*_CFLAGS, *isa.compiler_flags(flags, tier), *_defines(sources)]


def kernels_library() -> Path:
    """Where this machine's build of the kernels lies in the extension cache (present once built)."""
    sources, cflags = _build_inputs()
    return native_build.library_path("conveyor_kernels", sources, _HEADERS, cflags, _LDFLAGS)


_BACKGROUND_BUILD = (
    "import logging; logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(message)s')\n"
    "from conveyor.model.native import load_kernels\n"
    "load_kernels(); print('native kernels: built')\n"
)


def _start_background_build(library: Path) -> None:
    """A detached process that builds the kernels (this checkout's package, this interpreter); logs where to look."""
    _require_toolchain()
    package_parent = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    log = native_build.start_background_build(library, [sys.executable, "-c", _BACKGROUND_BUILD], env=env)
    if log is None:
        logger.warning(
            "native kernels: not built yet for this CPU; another process is building them (lock %s); "
            "using torch's ops for this run, later runs use the native ones",
            library.parent.parent / f"{library.stem}.lock",
        )
    else:
        logger.warning(
            "native kernels: not built yet for this CPU; building them in the background (log: %s); "
            "using torch's ops for this run, later runs use the native ones",
            log,
        )


def start_build() -> bool:
    """For scripts/setup.sh: True where this machine's build is ready; else start it in the background (logged as
    the engine's first start logs it) and return False at once. Raises NativeUnavailable where it cannot be built."""
    _require_linux()
    library = kernels_library()
    if library.exists():
        return True
    _start_background_build(library)
    return False


def _require_linux() -> None:
    import platform

    if platform.system() != "Linux":
        raise NoToolchain(f"native kernels are built on Linux only (this is {platform.system()})")


def load_kernels(wait: bool = True) -> NativeKernels | None:
    """The compiled kernels; raises NativeUnavailable (with the reason and the fix) where they cannot be had.
    wait=False (the engine's kernels='auto'): where this machine has no build yet, start one in a background
    process and return None at once (the caller runs torch's ops); wait=True builds in the foreground."""
    _require_linux()
    if not wait:
        library = kernels_library()
        if not library.exists():
            _start_background_build(library)
            return None
    return _load_kernels()


@functools.cache
def _load_kernels() -> NativeKernels:
    sources, cflags = _build_inputs()
    try:
        module = native_build.cached_extension(
            "conveyor_kernels", sources, _HEADERS, cflags, _LDFLAGS, "native kernels", before_build=_require_toolchain
        )
    except NoToolchain:
        raise
    except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError / OSError
        text = str(exc).strip().splitlines()
        raise NativeUnavailable(f"building the native kernels failed: {text[-1] if text else exc!r}") from exc
    kernels: NativeKernels = module
    flags = set(native_build.cpu_flags().split())
    logger.info("native kernels: ISA tier %s (this CPU's best: %s)", isa.requested_tier(flags), isa.cpu_tier(flags))
    return kernels


def resolve_kernels(backend: str, device: torch.device) -> NativeKernels | None:
    """config.kernels -> the native kernels, or None for the torch reference ops."""
    if backend == "torch" or (backend == "auto" and device.type != "cpu"):
        return None
    if device.type != "cpu":
        raise ConfigError(f"kernels='native' are CPU kernels and cannot run on {device}; use kernels='auto' or 'torch'")
    try:
        # 'auto' never waits for a compiler: torch's ops while the kernels build in the background
        return load_kernels(wait=backend != "auto")
    except NativeUnavailable as exc:
        if backend == "native":
            raise ConfigError(
                f"kernels='native' was requested, but {exc}; or use kernels='auto' (falls back to torch) or 'torch'"
            ) from exc
        logger.warning("native kernels unavailable (%s); using torch's ops (gather + SDPA attention, slower)", exc)
        return None
