"""Execute pages' Python blocks, each page's in order in one namespace of its own (a page's blocks build on each
other), as a reader pasting one page into a fresh interpreter would; the pages run one after another in this
process (one torch import for all). Reads a JSON list of {"page", "blocks": [{"where", "code"}]} on stdin; a page
stops at its first block that raises, naming it, and the next page goes on. Prints one line per page: RESULT and
the JSON {"page", "failed": the failing block's place or null, "output": what the page printed}; exits 1 when
any page failed. At the end of a page the LLMs it built are closed."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import sys
import traceback

import conveyor  # noqa: F401  (before torch, as the docs' own imports would)

RESULT = "@@page-result "


def run_page(blocks: list[dict[str, str]]) -> tuple[str | None, str]:
    namespace: dict[str, object] = {"__name__": "__main__"}
    output = io.StringIO()
    failed = None
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        for block in blocks:
            print(f"--- {block['where']}", flush=True)
            try:
                exec(compile(block["code"], block["where"], "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                print(f"FAILED: the block at {block['where']}", flush=True)
                failed = block["where"]
                break
        for value in namespace.values():
            close = getattr(value, "close", None)
            if type(value).__name__ == "LLM" and callable(close):
                try:
                    close()
                except BaseException:
                    traceback.print_exc()
                    print("FAILED: closing the page's LLM", flush=True)
                    failed = failed or "the page's LLM.close()"
    namespace.clear()
    gc.collect()
    return failed, output.getvalue()


if __name__ == "__main__":
    out = sys.stdout
    any_failed = False
    for page in json.load(sys.stdin):
        failed, output = run_page(page["blocks"])
        any_failed = any_failed or failed is not None
        print(RESULT + json.dumps({"page": page["page"], "failed": failed, "output": output}), file=out, flush=True)
    sys.exit(1 if any_failed else 0)
