#!/usr/bin/env bash
# The browser the web-page tests drive: Debian's chromium from apt (Playwright for Python comes with the
# test extras from pip; it never downloads a browser of its own here). Idempotent; installs only when
# missing; never fails the caller: without it tests/server/test_ui_browser.py skips and says why.
set -uo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: no apt-get here; the browser tests will be skipped (they need /usr/bin/chromium)" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
        echo "install_browser: not root and no passwordless sudo; run 'apt-get install -y chromium' as root" \
             "to enable the browser tests (they are skipped until then)" >&2
        exit 0
    fi
fi
echo "install_browser: apt-get install chromium (once; about 100 MB)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }; then
    echo "install_browser: installing chromium failed; the browser tests will be skipped" >&2
fi
exit 0
