"""The native kernels' ISA tiers (conveyor/model/isa.py): chosen from the CPU's flags, forced lower by
CONVEYOR_ISA, each compiling only what its instructions allow; and the kernel tests passing at every tier below
this CPU's own (the full tier builds each one)."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from conveyor.errors import ConfigError
from conveyor.model import isa, native, native_build
from helpers import REPO_ROOT

PORTABLE = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt"}
AVX2 = PORTABLE | {"avx", "avx2", "fma", "f16c", "bmi2"}
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx512cd"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx_vnni"}
ICE_LAKE = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}  # AVX-512 without BF16


def test_each_cpu_gets_its_best_tier() -> None:
    assert isa.cpu_tier(SAPPHIRE_RAPIDS) == "amx"
    assert isa.cpu_tier(ZEN4) == "avx512"
    assert isa.cpu_tier(ICE_LAKE) == "avx512"
    assert isa.cpu_tier(AVX2) == "avx2"
    assert isa.cpu_tier(AVX2 - {"fma"}) == "portable"  # AVX2 without FMA (a few VIA/Zhaoxin parts)
    assert isa.cpu_tier(PORTABLE) == "portable"
    assert isa.cpu_tier({"fp", "asimd", "sve"}) == "portable"  # ARM64's Features line


def test_a_lower_tier_can_be_forced_and_a_higher_or_unknown_one_is_refused() -> None:
    assert isa.requested_tier(SAPPHIRE_RAPIDS, "") == "amx"
    assert isa.requested_tier(SAPPHIRE_RAPIDS, "auto") == "amx"
    for tier in isa.TIERS:
        assert isa.requested_tier(SAPPHIRE_RAPIDS, tier.upper()) == tier
    with pytest.raises(ConfigError, match=r"CONVEYOR_ISA=amx asks for instructions this CPU lacks \(amx_bf16, "):
        isa.requested_tier(ZEN4, "amx")
    with pytest.raises(ConfigError, match="its best tier is avx2"):
        isa.requested_tier(AVX2, "avx512")
    with pytest.raises(
        ConfigError, match="'sse' is not a kernel tier; choose one of auto, amx, avx512, avx2, portable"
    ):
        isa.requested_tier(AVX2, "sse")


def test_a_forced_tier_builds_only_what_it_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """CONVEYOR_ISA=avx2 on a Sapphire Rapids: the sources an AVX2 CPU compiles, the compiler kept off AVX-512 and
    AMX, and a build of its own (another name than the CPU's own tier's)."""
    monkeypatch.setattr(native_build, "cpu_flags", lambda: " ".join(sorted(SAPPHIRE_RAPIDS)))
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    own_sources, own_flags = native._build_inputs()
    assert {"amx_product.cpp", "gguf_vnni.cpp"} <= {s.name for s in own_sources}
    assert not any(f.startswith("-mno-") for f in own_flags)
    for tier, expected in (("avx512", ZEN4), ("avx2", AVX2), ("portable", PORTABLE)):
        monkeypatch.setenv(isa.ISA_ENV, tier)
        sources, flags = native._build_inputs()
        assert sources == native.selected_sources(expected), tier
        assert "-march=native" in flags and "-mno-amx-tile" in flags, tier
        assert ("-mno-avx512f" in flags) == (tier != "avx512"), tier
        assert ("-mno-avx2" in flags) == (tier == "portable"), tier
        assert native.kernel_tier() == tier
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    forced = native.kernels_library()
    monkeypatch.delenv(isa.ISA_ENV)
    assert native.kernels_library() != forced


def test_inspect_names_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    model, flags = isa.cpu_facts()
    best = isa.cpu_tier(flags)
    assert f"{model}: native kernels' ISA tier {best}, this CPU's best" in isa.describe_this_cpu()
    monkeypatch.setenv(isa.ISA_ENV, "portable")
    if best != "portable":
        assert f"ISA tier portable, forced by CONVEYOR_ISA (this CPU's best is {best})" in isa.describe_this_cpu()


_KERNEL_TESTS = [
    # native kernels against their references: attention against SDPA, norms, rotary, argmax, masks, the int8
    # KV cache, the GGUF row kernel's products, the tiny models' greedy parity and the sampler
    "tests/model/test_native_attention.py",
    "tests/model/test_kv_int8.py",
    "tests/model/test_gguf_rows.py",
    "tests/model/test_gguf_quant.py::test_products_match_float64_over_the_dequantized_weights",
    "tests/model/test_parity_tiny.py",
]


def _lower_tiers() -> list[str]:
    _, flags = isa.cpu_facts()
    best = isa.cpu_tier(flags)
    return list(isa.TIERS[isa.TIERS.index(best) + 1 :])


@pytest.mark.parametrize("tier", _lower_tiers())
def test_kernel_tests_pass_at_a_forced_lower_tier(tier: str) -> None:
    """The kernel tests in a child process with CONVEYOR_ISA forcing the tier (its own build, made here)."""
    env = {**os.environ, isa.ISA_ENV: tier}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_KERNEL_TESTS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout


def test_the_portable_tier_compiles_for_arm64(tmp_path: Path) -> None:
    """Every source an ARM64 machine would build (the portable tier's; the binding unit with torch's headers),
    cross-compiled to aarch64 objects where a cross compiler is installed (Debian's g++-aarch64-linux-gnu).
    Compiled, not linked or run: no ARM64 torch here. The units are independent, so they compile side by side (one
    per core), the binding unit (the longest: torch's headers) first."""
    compiler = shutil.which("aarch64-linux-gnu-g++")
    if compiler is None:
        pytest.skip("no aarch64 cross compiler (apt install g++-aarch64-linux-gnu)")
    torch_include = Path(torch.__file__).parent / "include"
    sources = native.selected_sources(set())  # an ARM64 CPU's flags name none of the x86 extensions
    flags = [f for f in native._CFLAGS if f != "-march=native"] + ["-march=armv8.2-a+fp16+dotprod"]
    defines = native._defines(sources)

    def compile_unit(source: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [compiler, *flags, *defines, "-isystem", str(torch_include), "-isystem",
             str(torch_include / "torch" / "csrc" / "api" / "include"), "-isystem", sysconfig.get_paths()["include"],
             "-DTORCH_EXTENSION_NAME=conveyor_kernels", "-c", str(source), "-o", str(tmp_path / f"{source.stem}.o")],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    ordered = sorted(sources, key=lambda source: source.name != "bindings.cpp")  # the longest compile starts first
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_unit, ordered))
    for source, result in zip(ordered, results, strict=True):
        assert result.returncode == 0, f"{source.name}: {result.stderr[-3000:]}"
