"""The 1B-class benchmark models: a random-weight Llama-3.2-1B-shaped HF folder and its GGUF forms, made the way
users make theirs (llama.cpp's own converter and quantizer); nothing is downloaded from a model hub.

    .venv/bin/python scripts/make_1b_benchmark_models.py [OUT_DIR]      # default /work/ckpt

writes, skipping any that already exist:

    OUT_DIR/llama-1b/              scripts/make_random_checkpoint.py (bf16 safetensors, 2.15 GB)
    OUT_DIR/llama-1b-bf16.gguf     convert_hf_to_gguf.py --outtype bf16
    OUT_DIR/llama-1b-q8_0.gguf     convert_hf_to_gguf.py --outtype q8_0
    OUT_DIR/llama-1b-q4_k_m.gguf   llama_model_quantize(bf16 file, LLAMA_FTYPE_MOSTLY_Q4_K_M)
    OUT_DIR/llama-1b-q4_0.gguf     llama_model_quantize(bf16 file, LLAMA_FTYPE_MOSTLY_Q4_0)
    OUT_DIR/llama-1b-q5_k_m.gguf   llama_model_quantize(bf16 file, LLAMA_FTYPE_MOSTLY_Q5_K_M)

The converter comes from the llama-cpp-python 0.3.36 sdist on PyPI (cached by tests/helpers/gguf_convert.py); the
quantizer needs llama-cpp-python itself (`bash scripts/install_llama_cpp.sh`). Every file is written under a
temporary name and renamed when complete, so a reader never sees half a file. About 4 minutes and 7 GB of disk.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llama.cpp's quantization types (enum llama_ftype in llama.h)
QUANTIZED = {"q4_k_m": 15, "q4_0": 2, "q5_k_m": 17}


def _converted(folder: str, target: str, outtype: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers.gguf_convert import converter_dir

    script = os.path.join(converter_dir(), "convert_hf_to_gguf.py")
    partial = f"{target}.partial{os.getpid()}"
    try:
        subprocess.run([sys.executable, script, folder, "--outfile", partial, "--outtype", outtype], check=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _quantized(source: str, target: str, ftype: int) -> None:
    try:
        import llama_cpp
    except ImportError:
        sys.exit(f"{target}: quantizing needs llama-cpp-python; run `bash scripts/install_llama_cpp.sh` first")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 2
    partial = f"{target}.partial{os.getpid()}"
    try:
        status = llama_cpp.llama_model_quantize(source.encode(), partial.encode(), params)
        if status != 0:
            sys.exit(f"llama_model_quantize({source} -> {target}, ftype {ftype}) returned {status}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", default="/work/ckpt")
    args = parser.parse_args()
    folder = os.path.join(args.out_dir, "llama-1b")
    steps: list[tuple[str, object]] = [
        (
            folder,
            lambda: subprocess.run(
                [sys.executable, os.path.join(ROOT, "scripts", "make_random_checkpoint.py"), folder], check=True
            ),
        ),
        (f"{folder}-bf16.gguf", lambda: _converted(folder, f"{folder}-bf16.gguf", "bf16")),
        (f"{folder}-q8_0.gguf", lambda: _converted(folder, f"{folder}-q8_0.gguf", "q8_0")),
    ] + [
        (
            f"{folder}-{name}.gguf",
            lambda name=name, ftype=ftype: _quantized(f"{folder}-bf16.gguf", f"{folder}-{name}.gguf", ftype),
        )
        for name, ftype in QUANTIZED.items()
    ]
    for target, make in steps:
        if os.path.exists(target):
            print(f"[exists] {target}")
            continue
        start = time.perf_counter()
        make()  # type: ignore[operator]
        print(f"[wrote] {target} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
