"""The code states what is true and why, not how it got there.

Comments, docstrings and other prose in `conveyor/` carry no development history: no run ids
("s21", "Session s17"), no citations of benchmark logs (`RESULTS.md`, `benchmarks/results/...`) and no
timings measured on one machine ("~0.35 ms per step", "2.8x faster", "5 GB/s"). Those belong in the
benchmark records; the code keeps the reason in timeless words and, where a constant was tuned, names
the `conveyor bench ...` command that tunes it.

Where the rules look:

- run ids and benchmark-log citations: every comment and every string literal of a `.py` file (tokens
  from `tokenize`, so a variable named `s1` is code, not history); the comments of C++ / JS / CSS files
  (`//` and `/* */`, string literals skipped); the comments and the text outside `<script>`/`<style>` of
  HTML.
- machine timings (a number followed by ms / µs / us / ns / GB/s / MB/s / tok/s / GFLOP/s / TFLOP/s, or
  "N.Nx faster/slower"): comments and docstrings only (in C++ / JS / CSS / HTML: comments). Other strings
  are user-facing text (help, log and error messages) where a unit follows a format placeholder or a
  configured default, which is a fact of the interface, not a measurement. In prose a number with a unit
  is still allowed when it states a default or a limit: the words just before it say so (`_LIMIT_WORDS`).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "conveyor"

RUN_ID = re.compile(r"\bs[0-9]{1,2}\b")
RESULTS = re.compile(r"RESULTS\.md|benchmarks/results")
_NUM = r"\d(?:[\d.,]*\d)?"
TIMING = re.compile(
    rf"(?<![\w.]){_NUM}(?:\s?(?:-|\u2013|to)\s?{_NUM})?\s?(?:ms|µs|us|ns|GB/s|MB/s|GiB/s|MiB/s|tok/s|tokens/s|"
    rf"GFLOP/s|TFLOP/s)(?!\w)"
    rf"|(?<![\w.]){_NUM}(?:\s?(?:-|\u2013)\s?{_NUM})?x (?:faster|slower)\b"
)
_LIMIT_WORDS = re.compile(r"\b(default|defaults to|at most|at least|up to|timeout|every|after|within)\W*$", re.I)
"""A number with a unit right after one of these words states an interface fact ("default 500 ms",
"a timeout of 30 s"), not a measurement."""

# (kind, text, first line): kind is "prose" (comment or docstring: every rule) or "string" (other
# string literals: run ids and log citations only).
Chunk = tuple[str, str, int]


def _python_chunks(source: str) -> Iterator[Chunk]:
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstring_lines.add(node.lineno)
    string_kinds = {tokenize.STRING}
    fstring_middle = getattr(tokenize, "FSTRING_MIDDLE", None)
    if fstring_middle is not None:
        string_kinds.add(fstring_middle)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield "prose", tok.string, tok.start[0]
        elif tok.type in string_kinds:
            # A docstring (any string statement: module, class, function or attribute docstring) is prose.
            kind = "prose" if tok.type == tokenize.STRING and tok.start[0] in docstring_lines else "string"
            yield kind, tok.string, tok.start[0]


_C_LEXEME = re.compile(
    r"//[^\n]*"  # line comment
    r"|/\*.*?\*/"  # block comment
    r'|R"([^(\s]*)\(.*?\)\1"'  # C++ raw string
    r'|"(?:\\.|[^"\\\n])*"'  # string literal
    r"|'(?:\\.|[^'\\\n])*'"  # character literal (JS: string)
    r"|`(?:\\.|[^`\\])*`",  # JS template literal
    re.S,
)


def _c_like_chunks(source: str) -> Iterator[Chunk]:
    for m in _C_LEXEME.finditer(source):
        if m.group().startswith(("//", "/*")):
            yield "prose", m.group(), source.count("\n", 0, m.start()) + 1


_HTML_PART = re.compile(r"<!--.*?-->|<(script|style)\b[^>]*>(.*?)</\1\s*>", re.S | re.I)


def _html_chunks(source: str) -> Iterator[Chunk]:
    last = 0
    for m in _HTML_PART.finditer(source):
        yield "string", source[last : m.start()], source.count("\n", 0, last) + 1
        if m.group().startswith("<!--"):
            yield "prose", m.group(), source.count("\n", 0, m.start()) + 1
        else:
            offset = source.count("\n", 0, m.start(2))
            for kind, text, line in _c_like_chunks(m.group(2)):
                yield kind, text, line + offset
        last = m.end()
    yield "string", source[last:], source.count("\n", 0, last) + 1


def chunks(path: Path, source: str) -> Iterator[Chunk]:
    if path.suffix == ".py":
        return _python_chunks(source)
    if path.suffix == ".html":
        return _html_chunks(source)
    return _c_like_chunks(source)


def scan(path: Path, source: str) -> list[str]:
    """Every history finding in one file, as `line: rule: text`."""
    found = []
    for kind, text, first_line in chunks(path, source):
        rules = [("run id", RUN_ID), ("benchmark log", RESULTS)]
        if kind == "prose":
            rules.append(("machine timing", TIMING))
        for rule, pattern in rules:
            for m in pattern.finditer(text):
                if rule == "machine timing" and _LIMIT_WORDS.search(text[max(0, m.start() - 30) : m.start()]):
                    continue
                line = first_line + text.count("\n", 0, m.start())
                found.append(f"{line}: {rule}: {m.group()!r}")
    return found


SUFFIXES = {".py", ".cpp", ".h", ".js", ".html", ".css"}


def scanned_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*") if p.suffix in SUFFIXES and "__pycache__" not in p.parts)


def test_conveyor_is_history_free() -> None:
    findings = []
    for path in scanned_files():
        rel = path.relative_to(ROOT.parent)
        findings += [f"{rel}:{f}" for f in scan(path, path.read_text(encoding="utf-8"))]
    assert not findings, "history in the code (say why, timelessly; name the `conveyor bench` command):\n" + "\n".join(
        findings
    )


def test_the_scanner_catches_history() -> None:
    py = '''"""Module docstring: 2.8x faster (benchmarks/RESULTS.md, s21)."""
x = 1  # ~0.35 ms less per 64-row step
s1 = "see Session s17"
def f():
    """Reads K/V at
    5 GB/s."""
msg = f"{n} tok/s"  # a placeholder in a user-facing string: allowed
timeout = 30  # default 500 ms: a default, allowed
'''
    found = scan(Path("m.py"), py)
    assert found == [
        "1: run id: 's21'",
        "1: benchmark log: 'RESULTS.md'",
        "1: machine timing: '2.8x faster'",
        "2: machine timing: '0.35 ms'",
        "3: run id: 's17'",
        "6: machine timing: '5 GB/s'",
    ], found
    cpp = """// 1.2-1.9x faster than oneDNN (s29)
const char* s = "s3 // 4 ms";  /* benchmarks/results/2026-01-01
   40 us per call */
int s1 = 0;
"""
    found = scan(Path("k.cpp"), cpp)
    assert found == [
        "1: run id: 's29'",
        "1: machine timing: '1.2-1.9x faster'",
        "2: benchmark log: 'benchmarks/results'",
        "3: machine timing: '40 us'",
    ], found
    html = "<p>s12</p><!-- 3 ms --><script>// RESULTS.md\nlet s2 = '9 ms';</script>"
    found = scan(Path("i.html"), html)
    assert found == [
        "1: run id: 's12'",
        "1: machine timing: '3 ms'",
        "1: benchmark log: 'RESULTS.md'",
    ], found
