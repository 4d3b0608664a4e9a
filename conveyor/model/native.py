"""Native CPU kernels, compiled once per machine at first use (torch.utils.cpp_extension).

Why: decode attention over a paged cache is a gather of every sequence's blocks into a padded
copy plus SDPA in torch; on the 2-core AVX-512 machine that was ~45% of a 64-sequence bfloat16
decode step. The kernel in csrc/decode_attention.cpp reads K/V in place through the block
table: 2.8x faster at 64 sequences and 8x at one (benchmarks/RESULTS.md), and no less exact
(checked against a float64 reference in tests/test_native_attention.py).

It is built for the CPU at hand (-march=native), so the build's name carries a hash of the
source, the CPU's feature flags and torch's version: another CPU or a changed source builds
anew (about 25 s on 2 cores), an unchanged one loads from torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR). `-ffast-math` applies to the compile
step only (it lets expf vectorize); it is not passed to the link step, so the process's
floating-point mode (denormals) is untouched.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(q [seqs, heads, d], k_cache, v_cache [blocks, block_size, kv_heads, d], block_tables [seqs, max_blocks]
int64, context_lens [seqs] int64, scale) -> [seqs, heads, d]."""

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-strict-aliasing"]
_LDFLAGS = ["-fopenmp", "-lmvec"]


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _build_name() -> str:
    digest = hashlib.sha1()
    digest.update(_SOURCE.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(_cpu_flags().encode())
    digest.update(torch.__version__.encode())
    return f"conveyor_decode_attention_{digest.hexdigest()[:12]}"


def _ensure_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package installs it beside this interpreter,
    which is not on PATH when the venv's python is run without activating the venv."""
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    if scripts and Path(scripts, "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load_decode_attention() -> DecodeAttention:
    """The compiled kernel; raises NativeUnavailable (with the reason and the fix) where it cannot be had."""
    import platform

    if platform.system() != "Linux":
        raise NativeUnavailable(f"native kernels are built on Linux only (this is {platform.system()})")
    _ensure_ninja_on_path()
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        raise NativeUnavailable(f"building the native attention kernel needs {' and '.join(missing)} on PATH "
                                f"(install a C++ compiler such as g++, and `pip install ninja`)")
    from torch.utils.cpp_extension import load

    name = _build_name()
    logger.info("native attention kernel: loading %s (built once per machine, ~25 s on 2 cores)", name)
    try:
        module = load(name, [str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False)
    except Exception as exc:  # compiler errors arrive as RuntimeError / CalledProcessError / OSError
        text = str(exc).strip().splitlines()
        raise NativeUnavailable(f"building the native attention kernel failed: {text[-1] if text else exc!r}") from exc
    op: DecodeAttention = module.decode_attention
    return op


def resolve_decode_attention(backend: str, device: torch.device) -> DecodeAttention | None:
    """config.attention_backend -> the native kernel, or None for the torch reference (gather + SDPA)."""
    if backend == "torch" or (backend == "auto" and device.type != "cpu"):
        return None
    from conveyor.errors import ConfigError

    if device.type != "cpu":
        raise ConfigError(f"attention_backend='native' is a CPU kernel and cannot run on {device}; "
                          f"use attention_backend='auto' or 'torch'")
    try:
        return load_decode_attention()
    except NativeUnavailable as exc:
        if backend == "native":
            raise ConfigError(f"attention_backend='native' was requested, but {exc}; "
                              f"or use attention_backend='auto' (falls back to torch) or 'torch'") from exc
        logger.warning("native attention kernel unavailable (%s); using the torch reference (gather + SDPA, "
                       "slower)", exc)
        return None
