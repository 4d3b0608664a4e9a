"""Run llama.cpp's convert_hf_to_gguf.py several times in one interpreter (one torch import for all), each run as
`python convert_hf_to_gguf.py FOLDER --outfile OUT --outtype TYPE` runs it: the script executed as __main__ with
that argv and its own folder first on sys.path. Usage: `python run_converter.py SCRIPT`, a JSON list of argv lists
on stdin; prints one JSON line per run: {"rc", "log"} (rc 0 when the script returned, its output in log)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import runpy
import sys
import traceback


def run(script: str, argv: list[str]) -> dict[str, object]:
    log = io.StringIO()
    sys.argv = [script, *argv]
    logging.root.handlers.clear()  # the script's logging.basicConfig configures each run afresh, as in a new process
    rc: object = 0
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "log": log.getvalue()[-3000:]}


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.path[0] = os.path.dirname(script)  # where `python SCRIPT` looks first (the script imports `conversion`)
    out = sys.stdout
    for argv in json.load(sys.stdin):
        print(json.dumps(run(script, argv)), file=out, flush=True)
