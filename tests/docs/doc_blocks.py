"""The fenced code blocks of the documentation, and the cheap checks of each (no model, no server).

Every block must carry a language this module knows how to check:

    python   compiled; names imported from conveyor must exist; keywords of LLM(...) / SamplingParams(...) /
             EngineConfig(...) calls must be options or fields. Executed for real in the full tier.
    bash     split into commands (quotes, line continuations, comments, pipes, VAR=value prefixes); each command
             must be one this module knows: `conveyor ...` (parsed by the real CLI parser), `bash scripts/*.sh` or
             `bash benchmarks/*.sh` (the file exists; run.sh's arguments are conveyor's, parsed too; test.sh's
             flags must be handled by the script), `curl http://127.0.0.1:8000/...`, `pip install 'conveyor[...]'`
             (the extra exists), `ray start|stop`, `python FILE|-m MODULE` (the file or module exists).
    json     parsed.
    text     output, diagrams: skipped on purpose.

A block whose preceding line is `<!-- doc-test: parse-only (reason) -->` gets only the cheap checks in the full tier
too (a Python block that needs several processes, say). Anything else (a missing or unknown language, an unknown
command) is an error, so a new block cannot go in unchecked.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import io
import json
import pathlib
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_PORT = 8000
"""The port the docs' commands and clients use; the full tier rewrites it to the port its server got."""
LANGUAGES = ("python", "bash", "json", "text")
PARSE_ONLY = re.compile(r"<!--\s*doc-test:\s*parse-only\s*\((?P<reason>[^)]*)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[^\s`]*)\s*$")
PENDING_SCRIPT_FLAGS = {("scripts/test.sh", "--fast")}
"""Flags the docs show for a script that another change adds: a warning, not a failure, until the script has them
(then they are checked like any other)."""


def doc_files() -> list[pathlib.Path]:
    """README.md, docs/**/*.md and benchmarks/README.md (when present)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md"]
    return [f for f in files if f.is_file()]


class DocError(Exception):
    """A documented block that does not hold up."""


@dataclass
class Block:
    path: pathlib.Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    text: str
    parse_only: str | None = None
    """The reason given by a `doc-test: parse-only` marker."""

    @property
    def where(self) -> str:
        try:
            name = self.path.relative_to(ROOT)
        except ValueError:
            name = self.path
        return f"{name}:{self.line}"


def extract_blocks(path: pathlib.Path, text: str | None = None) -> list[Block]:
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence)) and lines[j].strip().strip(fence[0]) == ""
        ):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise DocError(f"{path}:{i + 1}: a code block that never closes")
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = PARSE_ONLY.search(before)
        blocks.append(
            Block(path, i + 1, m.group("lang"), "\n".join(body) + "\n", marker.group("reason") if marker else None)
        )
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for f in doc_files() for b in extract_blocks(f)]


# ---- bash -------------------------------------------------------------------------------------------------


@dataclass
class Command:
    """One simple command of a bash block (a pipeline's first command; the rest are in `pipe`)."""

    block: Block
    line: str
    """The command as written (continuations joined), for running it through bash."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    pipe: list[list[str]] = field(default_factory=list)

    @property
    def kind(self) -> str:
        head = self.argv[0]
        if head in ("conveyor", ".venv/bin/conveyor"):
            return "conveyor"
        if head == "bash":
            return "script"
        if head in ("python", "python3", ".venv/bin/python"):
            return "python"
        if head in ("curl", "pip", "ray", "export"):
            return head
        raise DocError(
            f"{self.block.where}: no check knows the command {head!r} ({self.line.strip()!r}); "
            f"teach tests/docs/doc_blocks.py to check it, or use a ```text block"
        )


def bash_commands(block: Block) -> list[Command]:
    """The block's commands: continuation lines joined, quotes spanning lines kept whole, comments dropped."""
    text = block.text.replace("\\\n", " ")
    commands: list[Command] = []
    pending = ""
    for raw in text.splitlines():
        pending = pending + "\n" + raw if pending else raw
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        line, pending = pending, ""
        if not tokens:
            continue
        sequence: list[list[str]] = [[]]  # `a && b; c &`: each command is checked
        for tok in tokens:
            if tok in ("&&", "||", ";", "&"):
                sequence.append([])
            else:
                sequence[-1].append(tok)
        for words in filter(None, sequence):
            parts: list[list[str]] = [[]]  # `a | b`: a is the command, b a filter after it
            for tok in words:
                if tok == "|":
                    parts.append([])
                else:
                    parts[-1].append(tok)
            first = parts[0]
            while first[:1] == ["flock"] and len(first) > 2:  # `flock LOCKFILE command ...`: the command is checked
                first = first[2:]
            env = {}
            while first and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", first[0]):
                key, _, value = first.pop(0).partition("=")
                env[key] = value
            if not first:
                raise DocError(f"{block.where}: {line!r} sets variables and runs nothing; use `export`")
            commands.append(Command(block, line, first, env, parts[1:]))
    if pending:
        raise DocError(f"{block.where}: an unclosed quote in {pending!r}")
    return commands


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser and its subparsers without argparse's prefix matching, so that a shortened flag in the docs
    (which the CLI accepts today, but which breaks when another flag gains the same prefix) is refused."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _strict(sub)
    return parser


@functools.lru_cache(maxsize=1)
def _cli_parser() -> argparse.ArgumentParser:
    from conveyor.cli import build_parser

    return _strict(build_parser())  # parsing does not change a parser: one serves every command


def parse_conveyor(argv: list[str]) -> None:
    """Parse `conveyor ARGV` with the CLI's own parser; an unknown or renamed flag raises DocError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _cli_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "-h" in argv):
            return
        raise DocError(
            f"`conveyor {shlex.join(argv)}` is refused by the CLI's parser: "
            f"{err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else exc}"
        ) from None


def _pyproject_extras() -> set[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the section's keys, read plainly
        section = (
            (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
        )
        return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.MULTILINE))
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


def check_command(cmd: Command, warnings: list[str]) -> None:
    """The cheap check of one command (see the module docstring)."""
    where, argv = cmd.block.where, cmd.argv
    for part in cmd.pipe:
        if part and part[0] not in ("grep", "head", "jq", "python", "python3"):
            raise DocError(f"{where}: no check knows {part[0]!r} after a pipe in {cmd.line.strip()!r}")
    kind = cmd.kind
    if kind == "conveyor":
        parse_conveyor(argv[1:])
    elif kind == "script":
        if len(argv) < 2:
            raise DocError(f"{where}: `bash` without a script")
        script = argv[1]
        if not re.fullmatch(r"(scripts|benchmarks)/[\w./-]+\.sh", script) or not (ROOT / script).is_file():
            raise DocError(f"{where}: {script} is not a script of this repository")
        args = argv[2:]
        if script == "scripts/run.sh" and args:
            parse_conveyor(args)  # run.sh hands its arguments to `conveyor`
        elif args:
            source = (ROOT / script).read_text()
            for flag in (a.split("=")[0] for a in args if a.startswith("-")):
                if flag in source:
                    continue
                if (script, flag) in PENDING_SCRIPT_FLAGS:
                    warnings.append(f"{where}: {script} does not handle {flag} yet")
                    continue
                raise DocError(f"{where}: {script} does not handle the flag {flag}")
    elif kind == "curl":
        urls = [a for a in argv[1:] if a.startswith("http")]
        if len(urls) != 1 or not urls[0].startswith(f"http://127.0.0.1:{DOC_PORT}/"):
            raise DocError(
                f"{where}: a curl line must name one URL on http://127.0.0.1:{DOC_PORT}/ "
                f"(the full tier runs it against its server): {cmd.line.strip()!r}"
            )
        for i, a in enumerate(argv):
            if a in ("-d", "--data") and argv[i + 1].lstrip().startswith("{"):
                json.loads(argv[i + 1])
    elif kind == "pip":
        if argv[1:2] != ["install"]:
            raise DocError(f"{where}: only `pip install` is known: {cmd.line.strip()!r}")
        for spec in argv[2:]:
            m = re.fullmatch(r"conveyor\[([\w,-]+)\]", spec)
            if not m:
                raise DocError(f"{where}: pip installs only conveyor's extras in the docs, not {spec!r}")
            missing = set(m.group(1).split(",")) - _pyproject_extras()
            if missing:
                raise DocError(f"{where}: pyproject.toml has no extra {sorted(missing)}")
    elif kind == "ray":
        if argv[1:2] not in (["start"], ["stop"], ["status"]):
            raise DocError(f"{where}: unknown ray subcommand in {cmd.line.strip()!r}")
    elif kind == "python":
        if argv[1:2] == ["-m"]:
            if importlib.util.find_spec(argv[2]) is None:
                raise DocError(f"{where}: no module {argv[2]}")
        elif len(argv) < 2 or not (ROOT / argv[1]).is_file():
            raise DocError(f"{where}: no file {argv[1:2]}")
    elif kind == "export" and not all(re.fullmatch(r"[A-Z_][A-Z0-9_]*(=.*)?", a) for a in argv[1:]):
        raise DocError(f"{where}: a strange export: {cmd.line.strip()!r}")


# ---- python -----------------------------------------------------------------------------------------------


def _known_keywords() -> dict[str, set[str]]:
    from conveyor.config import EngineConfig
    from conveyor.params import SamplingParams

    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    sampling = set(SamplingParams.model_fields) | {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}
    return {"LLM": engine, "EngineConfig": engine, "SamplingParams": sampling}


def check_python(block: Block) -> None:
    """Compiles; `from conveyor... import X` names exist; LLM / SamplingParams / EngineConfig keywords exist."""
    try:
        tree = ast.parse(block.text, filename=block.where)
    except SyntaxError as exc:
        raise DocError(f"{block.where}: not Python: {exc}") from None
    known = _known_keywords()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "conveyor":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    raise DocError(f"{block.where}: {node.module} has no {alias.name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known:
            for kw in node.keywords:
                if kw.arg is not None and kw.arg not in known[node.func.id]:
                    raise DocError(f"{block.where}: {node.func.id}(...) has no option {kw.arg!r}")


# ---- every block ------------------------------------------------------------------------------------------


def check_block(block: Block, warnings: list[str]) -> None:
    """The cheap check of any block; raises DocError."""
    if block.lang not in LANGUAGES:
        raise DocError(
            f"{block.where}: a code block needs one of the languages {', '.join(LANGUAGES)} "
            f"(got {block.lang or 'none'}); `text` for output and diagrams"
        )
    if block.lang == "python":
        check_python(block)
    elif block.lang == "json":
        try:
            json.loads(block.text)
        except json.JSONDecodeError as exc:
            raise DocError(f"{block.where}: not JSON: {exc}") from None
    elif block.lang == "bash":
        for cmd in bash_commands(block):
            check_command(cmd, warnings)


def iter_commands(blocks: list[Block]) -> Iterator[Command]:
    for b in blocks:
        if b.lang == "bash":
            yield from bash_commands(b)
