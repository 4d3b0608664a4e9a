#!/usr/bin/env bash
# Set up (idempotent, with the test extras), then run the test suite (slow benchmarks excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/install_browser.sh  # Debian's chromium for tests/server/test_ui_browser.py (skipped without it)
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"  # the slowest tests, to keep the suite under 20 min
