"""kernels='auto' never waits for a compiler: with no build in the cache it starts one background build (one, even
when asked again while it runs), says so in one WARNING line and answers through torch's ops; and the sources are
chosen by the CPU's flags (nothing compiled that the CPU cannot run)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

from conveyor.model import native, native_build

# Stands in for the real build (a compile of minutes; the real one is what the native_kernels fixture and
# test_native_build.py check): it holds the build's lock as cached_extension does (native_build._exclusive, which
# takes over the lock its starter handed it), notes that it ran, and keeps the lock a while, as a build would.
FAKE_BUILD = """
import time
from conveyor.model import native, native_build
library = native.kernels_library()
with native_build._exclusive(library.parent.parent / (library.stem + ".lock"), "fake build"):
    with open(library.parent.parent / "builds.txt", "a") as out:
        out.write("built\\n")
    time.sleep(4)
"""


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_auto_with_an_empty_cache_uses_torch_and_starts_one_background_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if native_build.cpu_flags() == "" or not Path("/proc/cpuinfo").exists():
        pytest.skip("needs Linux's /proc/cpuinfo")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_BACKGROUND_BUILD", FAKE_BUILD)
    monkeypatch.setattr(native, "_require_toolchain", lambda: None)  # the fake needs no compiler
    library = native.kernels_library()
    assert library.parent.parent == tmp_path and not library.exists()

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="conveyor.model.native"):
        assert native.resolve_kernels("auto", torch.device("cpu")) is None
    assert time.monotonic() - started < 10, "the auto path waited"
    lines = [r.getMessage() for r in caplog.records if "not built yet" in r.getMessage()]
    assert len(lines) == 1 and "building them in the background (log: " in lines[0]
    assert "using torch's ops" in lines[0]
    log = tmp_path / f"{library.stem}.log"
    assert str(log) in lines[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="conveyor.model.native"):
        assert native.load_kernels(wait=False) is None  # asked again at once: the lock is the build's already
    assert "another process is building them" in caplog.text
    _wait_for(tmp_path / "builds.txt")

    deadline = time.monotonic() + 60
    while True:  # the fake build ends (its lock released); it ran once
        try:
            with open(tmp_path / f"{library.stem}.lock", "a+") as handle:
                import fcntl

                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
        except BlockingIOError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert (tmp_path / "builds.txt").read_text() == "built\n"


def test_explicit_native_kernels_without_a_toolchain_fail_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels='native' builds in the foreground: with no build and no compiler it raises (no background build)."""
    from conveyor.errors import ConfigError

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, no ninja
    monkeypatch.setattr(native, "_ensure_ninja_on_path", lambda: None)
    native._load_kernels.cache_clear()
    try:
        with pytest.raises(ConfigError, match="needs c\\+\\+ and ninja on PATH"):
            native.resolve_kernels("native", torch.device("cpu"))
    finally:
        native._load_kernels.cache_clear()
    assert not list(tmp_path.glob("*.log"))


AVX2 = {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "avx512cd"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_sources_are_chosen_by_the_cpus_flags() -> None:
    names = {
        flags_name: {s.name for s in native.selected_sources(flags)}
        for flags_name, flags in (("avx2", AVX2), ("zen4", ZEN4), ("spr", SAPPHIRE_RAPIDS))
    }
    amx = {"amx_product.cpp", "gguf_amx.cpp", "prefill_attention.cpp", "decode_layers.cpp"}
    avx512 = {"f32_linear.cpp", "quant_linear.cpp", "gguf_vnni.cpp", "gguf_bf16.cpp"}
    assert not (amx | avx512) & names["avx2"]
    assert avx512 <= names["zen4"] and not amx & names["zen4"]
    assert amx | avx512 <= names["spr"]
    assert {"bindings.cpp", "fallbacks.cpp", "decode_attention.cpp", "norm_act.cpp"} <= names["avx2"]
    every_source = {p.name for p in (Path(native.__file__).parent / "csrc").glob("*.cpp")}
    assert every_source == set(native._SOURCE_NEEDS), "each kernel source needs a row in native._SOURCE_NEEDS"
    defines = native._defines(native.selected_sources(SAPPHIRE_RAPIDS))
    assert "-DCONVEYOR_WITH_AMX_PRODUCT" in defines and "-DCONVEYOR_WITH_BINDINGS" not in defines


def test_no_fast_math_and_only_the_binding_unit_includes_torch() -> None:
    assert not any(flag in native._CFLAGS for flag in ("-ffast-math", "-ffinite-math-only", "-Ofast"))
    csrc = Path(native.__file__).parent / "csrc"
    for source in [*csrc.glob("*.cpp"), *csrc.glob("*.h")]:
        if source.name == "bindings.cpp":
            continue
        text = source.read_text()
        for header in ("<torch/", "<ATen/", "<c10/"):
            assert f"#include {header}" not in text, f"{source.name} includes {header}"
