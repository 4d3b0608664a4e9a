#!/usr/bin/env bash
# Optional peer for `conveyor bench --peer openvino` (conveyor/bench/openvino_peer.py):
# - openvino-genai 2026.4.1 into .venv (the run: ContinuousBatchingPipeline), wheels only, no torch;
# - optimum-intel 2.2 in a venv of its own (the one-time IR export, `optimum-cli export openvino`), because it
#   pins transformers < 5.6 and would downgrade ours. Default place ~/.cache/conveyor-bench/optimum-intel-2.2.0
#   ($CONVEYOR_OPENVINO_EXPORTER names its python if elsewhere); torch there is the same pinned CPU build.
# Idempotent; a few minutes the first time (downloads ~1 GB of wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
pip_q() { "$1" -m pip install --disable-pip-version-check -q "${@:2}" 2>&1 | grep -v -E "is ignored" || true; }
.venv/bin/python -c "import openvino_genai" 2>/dev/null \
    || pip_q .venv/bin/python -c .venv/constraints.txt "openvino-genai==2026.4.1.0"
exporter="${CONVEYOR_OPENVINO_EXPORTER:-$HOME/.cache/conveyor-bench/optimum-intel-2.2.0/bin/python}"
if ! "$exporter" -c "import optimum.intel, openvino_tokenizers" 2>/dev/null; then
    venv="$(dirname "$(dirname "$exporter")")"
    [ -x "$exporter" ] || "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$venv"
    pip_q "$exporter" -c .venv/constraints.txt "torch==2.13.0" "optimum-intel[openvino]==2.2.0" \
        "openvino==2026.4.1" "openvino-tokenizers==2026.4.1.0"
    # optimum pulls a torchvision built for another torch (its ops fail to register, and transformers then
    # cannot import PreTrainedModel); text models need none
    "$exporter" -m pip uninstall -y -q torchvision 2>/dev/null || true
fi
.venv/bin/python -c "import openvino_genai" && "$exporter" -c "import optimum.intel" \
    && echo "openvino peer: ready (openvino-genai in .venv, optimum-intel at $exporter)"
