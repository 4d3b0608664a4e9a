#!/usr/bin/env bash
# Set up (idempotent, with the test extras), check lint, formatting and types, then run the tests.
#
#   bash scripts/test.sh           what CI runs: lint, types and every test but the slow benchmarks
#   bash scripts/test.sh --fast    the fast tier for a change-test loop: lint, types and every package's quick tests
#
# Further arguments go to pytest (e.g. `bash scripts/test.sh --fast tests/core -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=full
if [ "${1:-}" = "--fast" ]; then tier=fast; shift; fi
bash scripts/setup.sh test
if [ "$tier" = full ]; then
    bash scripts/install_browser.sh  # Debian's chromium for tests/server/test_ui_browser.py (skipped without it)
fi
echo "lint, formatting and types: ruff check, ruff format --check, mypy"
.venv/bin/ruff check --quiet conveyor tests scripts benchmarks
.venv/bin/ruff format --check --quiet conveyor tests scripts benchmarks
.venv/bin/mypy
if [ "$tier" = fast ]; then marks="not slow and not full"; else marks="not slow"; fi
# --durations: the slowest tests, to keep the full tier under 15 minutes and the fast one under 2
exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "$marks" --durations=25 "$@"
