"""Every fenced block of README.md, docs/**/*.md and benchmarks/README.md is checked, so the docs cannot rot.

Fast (seconds): every block is parsed and checked without a model (tests/docs/doc_blocks.py says how, per
language); links and images resolve; the README stays a landing page. Full tier (`full` marker): each page's
runnable commands run for real: its Python blocks in order in one namespace of their own; `conveyor generate | chat
| inspect` and `--help` lines through the CLI's entry point; its first plain `conveyor serve` line as a server on a
free port, with the page's curl lines and Python clients pointed at it, then stopped by SIGTERM (exit status 0, as
documented). The pages share child interpreters (one for every page's CLI lines, one for every page's Python
blocks) and the servers of the same flags.
Commands that cannot run here (Ray clusters, tensor-parallel processes, benchmarks of minutes, peers' installs,
the setup scripts) stay parse-only: their flags are still checked by the real parser in the fast part.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from docs.doc_blocks import (
    DOC_PORT,
    ROOT,
    Block,
    Command,
    DocError,
    all_blocks,
    bash_commands,
    check_block,
    doc_files,
    extract_blocks,
)

OWN_PAGES = [
    "README.md",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "performance.md"),
]
"""The pages this test also holds to the timeless style (docs/performance.md is the dated record)."""


# ---- fast ---------------------------------------------------------------------------------------------------


def test_every_block_is_checked() -> None:
    blocks = all_blocks()
    assert len(blocks) > 20, "the docs lost their code blocks, or the extraction broke"
    errors, warnings = [], []
    for block in blocks:
        try:
            check_block(block, warnings)
        except DocError as exc:
            errors.append(str(exc))
    for w in warnings:
        print("warning:", w)
    assert not errors, "\n".join(errors)


PLANTED = {
    "a removed flag": '```bash\nconveyor generate "x" --no-such-flag\n```\n',
    "a bad choice": "```bash\nconveyor serve --dtype float8\n```\n",
    "a bad bench flag": "```bash\nconveyor bench throughput --num-prompt 8\n```\n",
    "run.sh's arguments": "```bash\nbash scripts/run.sh generate --temprature 0.7 hi\n```\n",
    "a missing script": "```bash\nbash scripts/no_such_script.sh\n```\n",
    "a flag the script lacks": "```bash\nbash scripts/test.sh --no-such-tier\n```\n",
    "an unknown command": "```bash\nmake install\n```\n",
    "no language": "```\nconveyor generate hi\n```\n",
    "an unknown extra": "```bash\npip install 'conveyor[nope]'\n```\n",
    "a bad SamplingParams field": "```python\nfrom conveyor import SamplingParams\nSamplingParams(max_token=3)\n```\n",
    "a bad LLM option": "```python\nfrom conveyor import LLM\nLLM(kv_cache_mem='1GiB')\n```\n",
    "a missing import": "```python\nfrom conveyor import NoSuchThing\n```\n",
    "bad JSON": '```json\n{"a": 1,}\n```\n',
    "a curl elsewhere": "```bash\ncurl https://example.com/v1/models\n```\n",
    "a bad flag after &&": "```bash\nexport X=1 && conveyor chat --no-such-flag\n```\n",
    "a bad flag behind flock": "```bash\nflock /tmp/l conveyor bench latency --no-such-flag &\n```\n",
}


@pytest.mark.parametrize("name", PLANTED)
def test_a_planted_mistake_is_caught(name: str) -> None:
    """The checks can fail: each planted mistake is refused."""
    (block,) = extract_blocks(pathlib.Path("planted.md"), "Some prose.\n\n" + PLANTED[name])
    with pytest.raises(DocError):
        check_block(block, [])


def test_the_extraction_sees_what_a_reader_sees() -> None:
    text = (
        '- a list item:\n\n  ```bash\n  conveyor generate "a" \\\n    --max-tokens 4   # a comment\n'
        "  curl http://127.0.0.1:8000/x -d '{\n    \"a\": 1}' | grep a\n  ```\n\n"
        "<!-- doc-test: parse-only (needs Ray) -->\n```python\nprint(1)\n```\n"
    )
    bash, python = extract_blocks(pathlib.Path("x.md"), text)
    assert (bash.lang, python.lang, python.parse_only) == ("bash", "python", "needs Ray")
    first, second = bash_commands(bash)
    assert first.argv == ["conveyor", "generate", "a", "--max-tokens", "4"]
    assert second.argv[:2] == ["curl", "http://127.0.0.1:8000/x"] and second.pipe == [["grep", "a"]]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    lines, inside, found = path.read_text().splitlines(), False, set()
    for line in lines:
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def test_links_and_images_resolve() -> None:
    """Relative links (and #anchors) of every page point at files and headings that exist; images exist."""
    errors = []
    for page in doc_files():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if path_part and not dest.exists():
                if dest.name == "performance.md" or dest == ROOT / "benchmarks" / "README.md":
                    continue  # written by another change; checked once it lands
                errors.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                errors.append(f"{page.relative_to(ROOT)}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not errors, "\n".join(errors)


def test_the_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move reference material into docs/"


@pytest.mark.parametrize("page", OWN_PAGES)
def test_pages_are_timeless(page: str) -> None:
    """No development history: session ids, results-file citations, dates of runs (docs/performance.md has those)."""
    text = (ROOT / page).read_text()
    for pattern in (
        r"\b[Ss]ession s\d+",
        r"\bs\d{2}\b(?!\w)",
        r"RESULTS\.md, \"",
        r"\b20\d\d-\d\d-\d\d\b",
        r"last measured",
        r"\bre-measured\b",
    ):
        found = re.search(pattern, text)
        assert not found, f"{page}: history in the docs: {found.group(0)!r}"


# ---- full tier: run the commands -------------------------------------------------------------------------------


def _default_model() -> str:
    from conveyor.model.loader import default_model_path

    return default_model_path()


PLACEHOLDERS = {"path/to/model.gguf": _default_model}
"""Placeholders of the docs that the full tier fills with a real file."""
UNRUNNABLE_FLAGS = ("--tensor-parallel-size", "--data-parallel-size", "--ray-address")
CHAT_INPUT = "What is the capital of France?\n"
"""What a documented `conveyor chat` line is sent before end of input: a question whose greedy answer is one short
sentence, so the documented line runs at its own --max-tokens (512 by default) without spending it all."""
PAGE_RESULT = "@@page-result "
"""How tests/docs/run_python.py starts the line that reports a page."""


def _runnable_argv(cmd: Command) -> list[str] | None:
    """The argv to run for a `conveyor` line, placeholders filled; None when it stays parse-only."""
    if cmd.kind != "conveyor" or cmd.pipe or cmd.env:
        return None
    argv = [PLACEHOLDERS[a]() if a in PLACEHOLDERS else a for a in cmd.argv[1:]]
    if any(flag in argv for flag in UNRUNNABLE_FLAGS):
        return None
    if "--help" in argv or "-h" in argv:
        return argv
    if argv[0] in ("generate", "chat"):
        model = argv[argv.index("--model") + 1] if "--model" in argv else None
        return argv if model is None or os.path.exists(model) else None
    if argv[0] == "inspect":
        return argv if all(os.path.exists(p) for p in argv[1:] if not p.startswith("-")) else None
    return None


def _page_server_args(commands: list[Command]) -> list[str] | None:
    """The first plain `conveyor serve` line of a page (no key, no replicas, no missing model): its flags."""
    for cmd in commands:
        if cmd.kind == "conveyor" and cmd.argv[1:2] == ["serve"] and not cmd.env:
            args = cmd.argv[2:]
            if any(f in args for f in (*UNRUNNABLE_FLAGS, "--api-key", "--model", "--no-ui")):
                continue
            out, skip = [], False
            for a in args:  # the test picks the host and port
                if skip:
                    skip = False
                elif a in ("--host", "--port"):
                    skip = True
                else:
                    out.append(a)
            return out
    return None


def _pages_with_runs() -> list[str]:
    pages = []
    for f in doc_files():
        blocks = extract_blocks(f)
        commands = [c for b in blocks if b.lang == "bash" and not b.parse_only for c in bash_commands(b)]
        if (
            any(b.lang == "python" and not b.parse_only for b in blocks)
            or any(_runnable_argv(c) for c in commands)
            or _page_server_args(commands) is not None
        ):
            pages.append(str(f.relative_to(ROOT)))
    return pages


def _run(args: list[str], stdin: str, cwd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(args, input=stdin, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _line_key(run: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    """What makes two pages' CLI lines the same run: the argv and the input."""
    return tuple(run["argv"]), run["stdin"]


@pytest.fixture(scope="module")
def servers() -> Any:
    """Servers by their flags, shared by the pages that start the same one; each must exit 0 on SIGTERM."""
    started: dict[tuple[str, ...], Any] = {}
    yield started
    for server in started.values():
        server.begin_stop()
    codes = {args: server.stop() for args, server in started.items()}
    assert all(rc == 0 for rc in codes.values()), (
        f"`conveyor serve` exit status on SIGTERM (the docs promise 0): {codes}"
    )


@dataclasses.dataclass
class PagePlan:
    """What the full tier runs of one page."""

    page: str
    runs: list[dict[str, Any]]
    """Its `conveyor` lines: {"argv", "stdin", "where"}."""
    curls: list[Command]
    python: list[Block]
    server: tuple[str, ...] | None
    """The flags of the server its curl lines and clients talk to (None: it needs none)."""


def _plan(page: str) -> PagePlan:
    blocks = extract_blocks(ROOT / page)
    commands = [c for b in blocks if b.lang == "bash" and not b.parse_only for c in bash_commands(b)]
    python = [b for b in blocks if b.lang == "python" and not b.parse_only]
    needs_server = any(f"127.0.0.1:{DOC_PORT}" in b.text for b in python) or any(c.kind == "curl" for c in commands)
    server_args = _page_server_args(commands)
    runs = [
        {"argv": argv, "stdin": CHAT_INPUT if argv[0] == "chat" else "", "where": c.block.where}
        for c in commands
        if (argv := _runnable_argv(c)) is not None
    ]
    curls = [c for c in commands if c.kind == "curl"]
    server = tuple(server_args or []) if needs_server or server_args is not None else None
    return PagePlan(page, runs, curls, python, server)


PLANTED_CLI = [["inspect", "missing.gguf"], ["generate", "--help"]]
"""Lines the runners' own test adds to the CLI runner's input: one that fails (no such file), one that does not."""
PLANTED_PAGES = [
    {
        "page": "planted.md",
        "blocks": [
            {"where": "planted.md:1", "code": "x = 1"},
            {"where": "planted.md:5", "code": "raise ValueError(x)"},
        ],
    },
    {"page": "next.md", "blocks": [{"where": "next.md:1", "code": "assert 'x' not in globals()"}]},
]
"""Pages the runners' own test adds to the Python runner's input: one whose second block raises, then one that
must run after it in a namespace of its own."""


@pytest.fixture(scope="module")
def doc_runs(request: pytest.FixtureRequest, servers: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """The runnable commands of every page whose test_page_runs is collected (and the runners' own planted
    failures when their test is), run together so that they share child interpreters: all CLI lines in one
    (tests/helpers/run_cli.py, each line as the console script runs it), all Python blocks in another
    (tests/docs/run_python.py, each page in a namespace of its own); each page's curl lines go to its server.
    A line that several pages document (the same argv and input) runs once. The servers start while the CLI
    lines run. -> {"failures": {page: [...]}, "planted_cli": [results], "planted_python": (exit status, [page
    results])}."""
    from helpers.server_process import ServerProcess

    tests = [item for item in request.session.items if item.module is request.module]
    wanted = {item.callspec.params["page"] for item in tests if getattr(item, "originalname", "") == "test_page_runs"}
    planted = any(getattr(item, "originalname", "") == "test_the_runners_report_failures" for item in tests)
    plans = [_plan(page) for page in _pages_with_runs() if page in wanted]
    failures: dict[str, list[str]] = {plan.page: [] for plan in plans}
    found: dict[str, Any] = {"failures": failures}
    keys = list(dict.fromkeys(plan.server for plan in plans if plan.server is not None))
    for key in keys:
        if key not in servers:
            servers[key] = ServerProcess(*key)

    with tempfile.TemporaryDirectory() as cwd:
        runs = [(plan.page, run) for plan in plans for run in plan.runs]
        if planted:
            runs += [("", {"argv": argv, "stdin": "", "where": "planted"}) for argv in PLANTED_CLI]
        if runs:
            unique = list(dict.fromkeys(_line_key(run) for _, run in runs))
            done = _run(
                [sys.executable, str(ROOT / "tests/helpers/run_cli.py")],
                json.dumps([{"argv": list(argv), "stdin": stdin} for argv, stdin in unique]),
                cwd,
                1800,
            )
            results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            by_line = dict(zip(unique, results))
            found["planted_cli"] = [by_line.get(_line_key(run)) for page, run in runs if not page]
            for page, run in runs:
                if not page:
                    continue
                result = by_line.get(_line_key(run))
                if result is None:
                    failures[page].append(
                        f"{run['where']}: the CLI runner stopped before `conveyor {shlex.join(run['argv'])}`:\n"
                        f"{done.stderr[-3000:]}"
                    )
                elif result["rc"] != 0:
                    failures[page].append(
                        f"{run['where']}: `conveyor {shlex.join(run['argv'])}` exited "
                        f"{result['rc']}:\n{result['stderr'][-2000:]}"
                    )
                elif run["argv"][0] != "inspect" and "--help" not in run["argv"] and not result["stdout"].strip():
                    failures[page].append(f"{run['where']}: `conveyor {shlex.join(run['argv'])}` printed nothing")

        down: dict[tuple[str, ...], str] = {}
        for key in keys:
            try:
                servers[key].wait_ready(timeout=300)
            except (RuntimeError, TimeoutError) as exc:
                down[key] = f"`conveyor serve {shlex.join(key)}` did not come up: {exc}"
        for plan in plans:
            if plan.server in down:
                failures[plan.page].append(down[plan.server])

        def local(text: str, plan: PagePlan) -> str:
            port = servers[plan.server].port if plan.server is not None else DOC_PORT
            return text.replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{port}")

        for plan in plans:
            if plan.server in down:
                continue
            for c in plan.curls:
                line = local(c.line, plan).replace("curl ", "curl --fail-with-body -sS --max-time 120 ", 1)
                done = _run(["bash", "-o", "pipefail", "-c", line], "", cwd, 180)
                if done.returncode != 0 or not done.stdout.strip():
                    failures[plan.page].append(
                        f"{c.block.where}: {c.line.strip()!r} failed ({done.returncode}): "
                        f"{done.stdout[-1000:]} {done.stderr[-1000:]}"
                    )
        pages = (PLANTED_PAGES if planted else []) + [
            {"page": plan.page, "blocks": [{"where": b.where, "code": local(b.text, plan)} for b in plan.python]}
            for plan in plans
            if plan.python and plan.server not in down
        ]
        if pages:
            done = _run([sys.executable, str(ROOT / "tests/docs/run_python.py")], json.dumps(pages), cwd, 1800)
            reported = [
                json.loads(line[len(PAGE_RESULT) :])
                for line in done.stdout.splitlines()
                if line.startswith(PAGE_RESULT)
            ]
            by_page = {result["page"]: result for result in reported}
            found["planted_python"] = (done.returncode, reported[: len(PLANTED_PAGES)] if planted else [])
            for page in pages[len(PLANTED_PAGES) if planted else 0 :]:
                result = by_page.get(page["page"])
                if result is None:
                    failures[page["page"]].append(
                        f"Python blocks of {page['page']}: the runner stopped first:\n"
                        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                    )
                elif result["failed"] is not None:
                    failures[page["page"]].append(f"Python blocks of {page['page']}:\n{result['output'][-6000:]}")
    return found


@pytest.mark.full
@pytest.mark.parametrize("page", _pages_with_runs())
def test_page_runs(page: str, doc_runs: dict[str, Any]) -> None:
    failures = doc_runs["failures"][page]
    assert not failures, "\n\n".join(failures)


@pytest.mark.full
def test_the_runners_report_failures(doc_runs: dict[str, Any]) -> None:
    """The full tier can fail: a command that exits non-zero and a Python block that raises are reported (planted
    among the pages' own, in the same runners); the next page's blocks still run, in a namespace of their own."""
    assert [r["rc"] != 0 for r in doc_runs["planted_cli"]] == [True, False]
    returncode, results = doc_runs["planted_python"]
    assert returncode == 1 and [(r["page"], r["failed"]) for r in results] == [
        ("planted.md", "planted.md:5"),
        ("next.md", None),
    ]
    assert "FAILED: the block at planted.md:5" in results[0]["output"] and "ValueError: 1" in results[0]["output"]


def test_the_full_tier_runs_something_of_each_kind() -> None:
    """The full tier is not empty by accident: it runs Python blocks, CLI lines, a server and curl lines."""
    pages = _pages_with_runs()
    assert "README.md" in pages and "docs/usage.md" in pages and "docs/server.md" in pages
    commands = [
        c
        for f in pages
        for b in extract_blocks(ROOT / f)
        if b.lang == "bash" and not b.parse_only
        for c in bash_commands(b)
    ]
    kinds = {next(iter(_runnable_argv(c) or ("-",))) for c in commands}
    assert {"generate", "chat", "inspect"} <= kinds
    assert any(c.kind == "curl" for c in commands)
