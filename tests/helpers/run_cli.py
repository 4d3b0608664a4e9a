"""Run several `conveyor ...` command lines in one process (one torch import for all), as the console script
does: `conveyor.cli.main(argv)`. Reads a JSON list of {"argv": [...], "stdin": "..."} on stdin; prints one JSON
line per command: {"argv", "rc", "stdout", "stderr"}. Each command starts from the logging a fresh process has
(no handlers, WARNING), so its own logging.basicConfig (`-v`) takes effect and logs into its own stderr."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import sys

import conveyor  # noqa: F401  (before torch, as the console script imports it)
from conveyor.cli import main


def run(argv: list[str], stdin: str) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception as exc:  # reported as a failure of this command, not of the runner
                import traceback

                traceback.print_exc()
                rc = f"raised {type(exc).__name__}: {exc}"
    finally:
        sys.stdin = saved
        logging.root.handlers.clear()  # the handler wrote to this command's stderr, which is gone
        gc.collect()
    return {"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    for item in json.load(sys.stdin):
        print(json.dumps(run(item["argv"], item.get("stdin", ""))), flush=True)
