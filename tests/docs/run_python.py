"""Execute a page's Python blocks in order in one namespace (a page's blocks build on each other), as a reader
pasting them into one interpreter would. Reads a JSON list of {"where", "code"} on stdin; exits 1 at the first
block that raises, naming it."""

from __future__ import annotations

import json
import sys
import traceback

import conveyor  # noqa: F401  (before torch, as the docs' own imports would)

if __name__ == "__main__":
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in json.load(sys.stdin):
        print(f"--- {block['where']}", flush=True)
        try:
            exec(compile(block["code"], block["where"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: the block at {block['where']}", flush=True)
            sys.exit(1)
    for value in namespace.values():
        close = getattr(value, "close", None)
        if type(value).__name__ == "LLM" and callable(close):
            close()
