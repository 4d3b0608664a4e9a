#!/usr/bin/env bash
# Optional peer for `conveyor bench --peer llama-cpp`: builds llama-cpp-python 0.3.36 (llama.cpp) from source
# into .venv (about 5 minutes on 2 cores). AVX-512 kernels on, AMX off: on the Intel dev/CI machines llama.cpp's
# AMX matmul crashed (SIGSEGV in ggml_backend_amx_mul_mat on the first decode of the Q4_1 model).
set -euo pipefail
cd "$(dirname "$0")/.."
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# `python -m pip`, not `pip` or `activate`: a venv copied from another checkout keeps their paths in its scripts
.venv/bin/python -m pip install --no-binary llama-cpp-python "llama-cpp-python==0.3.36" -c .venv/constraints.txt
