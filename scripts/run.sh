#!/usr/bin/env bash
# Set up (idempotent), then run conveyor on the embedded default model.
# With no arguments it answers "What is the capital of France?"; otherwise the
# arguments go to the `conveyor` command (e.g. `bash scripts/run.sh chat`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then set -- generate "What is the capital of France?"; fi
exec .venv/bin/conveyor "$@"
