#!/usr/bin/env bash
# Optional peer for `conveyor bench --peer llama-cpp`: builds llama-cpp-python 0.3.36 (llama.cpp) from source
# into .venv (about 5 minutes on 2 cores), for the CPU at hand, as llama.cpp's own GGML_NATIVE build does:
#
#   bash scripts/install_llama_cpp.sh            native: every instruction set this CPU has (AMX off, below)
#   LLAMA_CPP_ISA=avx2 bash scripts/install_llama_cpp.sh    AVX2 + FMA only (the peer of CONVEYOR_ISA=avx2)
#
# AMX stays off on CPUs that have it: llama.cpp's AMX matmul crashed on the Intel machines (SIGSEGV in
# ggml_backend_amx_mul_mat on the first decode of the Q4_1 model). A rebuild for another tier replaces the first.
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
common="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
case "${LLAMA_CPP_ISA:-native}" in
    native)
        no_amx=""
        grep -qw amx_tile /proc/cpuinfo && no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        export CMAKE_ARGS="-DGGML_NATIVE=ON $common -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" ;;
    avx2)
        export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON $common" ;;
    *) echo "LLAMA_CPP_ISA=${LLAMA_CPP_ISA} is not one of native, avx2" >&2; exit 2 ;;
esac
echo "llama.cpp peer: CMAKE_ARGS=$CMAKE_ARGS"
# `python -m pip`, not `pip` or `activate`: a venv copied from another checkout keeps their paths in its scripts;
# --no-cache-dir and --force-reinstall: a wheel built for another tier must not be reused
.venv/bin/python -m pip install --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==0.3.36" -c .venv/constraints.txt
.venv/bin/python -m pip install -q "diskcache" -c .venv/constraints.txt
