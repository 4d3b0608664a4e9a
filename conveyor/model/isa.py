"""The native kernels' ISA tier: which instruction sets they are built for, chosen once from the CPU's flags.

Tiers, best first (each a CPU's flags as /proc/cpuinfo lists them):

- ``amx``: AMX-BF16 tiles with AVX-512 BF16 (Intel Sapphire Rapids and later): bfloat16 products on packed tiles,
  native prefill attention, the fused decode stack, GGUF products dequantized onto tiles;
- ``avx512``: AVX-512 F/BW/VL/DQ (with BF16 and VNNI: AMD Zen 4/5, Intel Cooper Lake; without BF16: Ice Lake and
  Skylake servers): float32 panels, int4/int8 and GGUF int8 dot products, oneDNN's bfloat16 products;
- ``avx2``: AVX2 + FMA (Intel since Haswell, AMD since Zen 1): GGUF int8 dot products (gguf_int8_avx2.cpp), the
  compiler-vectorized attention, norm, rotary and sampling kernels, torch's float32 products;
- ``portable``: none of those (other x86-64, ARM64): the same kernels in plain C++ the compiler vectorizes for the
  machine (NEON on ARM64).

The CPU's own tier is the default; ``CONVEYOR_ISA=amx|avx512|avx2|portable`` forces a lower one on any machine,
for tests and benchmarks (a higher one than the CPU has is refused by name). The kernels are then compiled as for a
CPU without the higher instruction sets (their sources left out, the compiler told not to use them), in a build
of their own beside the CPU's.
"""

from __future__ import annotations

import os
import platform

from conveyor.errors import ConfigError

TIERS = ("amx", "avx512", "avx2", "portable")
"""Best first."""

ISA_ENV = "CONVEYOR_ISA"

_NEEDS: dict[str, frozenset[str]] = {
    "amx": frozenset({"amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx2": frozenset({"avx2", "fma"}),
    "portable": frozenset(),
}

_DROPPED_PREFIXES: dict[str, tuple[str, ...]] = {
    # the flags a tier does not use: a CPU's flags less these choose the sources (native._SOURCE_NEEDS)
    "amx": (),
    "avx512": ("amx",),
    "avx2": ("amx", "avx512"),
    "portable": ("amx", "avx512", "avx2", "fma", "avx_vnni", "f16c", "avx"),
}

_COMPILER_OFF: dict[str, tuple[str, ...]] = {
    # what -march=native must not use at a forced tier (-mno-avx512f turns off every AVX-512 extension)
    "amx": (),
    "avx512": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "avx2": ("-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-mno-avx512f"),
    "portable": (
        "-mno-amx-tile",
        "-mno-amx-bf16",
        "-mno-amx-int8",
        "-mno-avx512f",
        "-mno-avxvnni",
        "-mno-avx2",
        "-mno-fma",
        "-mno-f16c",
        "-mno-avx",
    ),
}


def cpu_facts() -> tuple[str, set[str]]:
    """(this CPU's model name, its feature flags) as /proc/cpuinfo lists them (the machine's name and no flags
    where there is no /proc/cpuinfo)."""
    model, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "CPU part") and not model:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def describe_this_cpu() -> str:
    """One line for people: the CPU, its best tier and the tier in use ($CONVEYOR_ISA)."""
    model, flags = cpu_facts()
    best, used = cpu_tier(flags), requested_tier(flags)
    if used != best:
        return f"{model}: native kernels' ISA tier {used}, forced by {ISA_ENV} (this CPU's best is {best})"
    return f"{model}: native kernels' ISA tier {used}, this CPU's best (set {ISA_ENV} to force a lower one)"


def cpu_tier(flags: set[str]) -> str:
    """The best tier a CPU with these flags runs."""
    return next(tier for tier in TIERS if _NEEDS[tier] <= flags)


def requested_tier(flags: set[str], requested: str | None = None) -> str:
    """The tier to build for: `requested` (default: $CONVEYOR_ISA), or the CPU's own where none is asked."""
    best = cpu_tier(flags)
    asked = (os.environ.get(ISA_ENV) if requested is None else requested) or ""
    asked = asked.strip().lower()
    if not asked or asked == "auto":
        return best
    if asked not in TIERS:
        raise ConfigError(f"{ISA_ENV}={asked!r} is not a kernel tier; choose one of auto, {', '.join(TIERS)}")
    if TIERS.index(asked) < TIERS.index(best):
        raise ConfigError(
            f"{ISA_ENV}={asked} asks for instructions this CPU lacks ({', '.join(sorted(_NEEDS[asked] - flags))}); "
            f"its best tier is {best}, and any tier below it can be forced"
        )
    return asked


def tier_flags(flags: set[str], tier: str) -> set[str]:
    """The CPU's flags a build of this tier may use."""
    return {f for f in flags if not f.startswith(_DROPPED_PREFIXES[tier])}


def compiler_flags(flags: set[str], tier: str) -> list[str]:
    """What to add to -march=native so the compiler keeps to the tier (nothing where it is the CPU's own, or on
    machines other than x86-64, where -march=native alone decides)."""
    if tier == cpu_tier(flags) or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    return list(_COMPILER_OFF[tier])
