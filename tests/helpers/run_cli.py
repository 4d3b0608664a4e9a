"""Run several `conveyor ...` command lines in one process (one torch import for all), as the console script
does: `conveyor.cli.main(argv)`. Reads a JSON list of {"argv": [...], "stdin": "...", "cwd": "...", "env": {...}}
on stdin (all but argv optional: the line's standard input, working folder and added environment variables);
prints one JSON line per command: {"argv", "rc", "stdout", "stderr"}. Each command starts from the logging a fresh
process has (no handlers, WARNING), so its own logging.basicConfig (`-v`) takes effect and logs into its own
stderr; its folder and variables are undone after it."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import os
import sys

import conveyor  # noqa: F401  (before torch, as the console script imports it)
from conveyor.cli import main


def run(argv: list[str], stdin: str, cwd: str | None = None, env: dict[str, str] | None = None) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    saved, saved_cwd, saved_env = sys.stdin, os.getcwd(), dict(os.environ)
    sys.stdin = io.StringIO(stdin)
    os.environ.update(env or {})
    if cwd is not None:
        os.chdir(cwd)
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
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        logging.root.handlers.clear()  # the handler wrote to this command's stderr, which is gone
        gc.collect()
    return {"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    for item in json.load(sys.stdin):
        print(json.dumps(run(item["argv"], item.get("stdin", ""), item.get("cwd"), item.get("env"))), flush=True)
