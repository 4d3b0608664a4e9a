"""The package's shape, checked by walking its source: layers import downward only (server -> engine ->
runtime -> model -> core), no module imports itself back through others, and no frontend reads or
writes a private attribute of an object it was handed (an engine's in particular)."""

from __future__ import annotations

import ast
import graphlib
import pathlib
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "conveyor"

LAYERS: dict[str, float] = {
    "conveyor.errors": 0,
    "conveyor.openmp": 0,
    "conveyor.host_memory": 0,
    "conveyor.structured": 1,
    "conveyor.tools": 1,
    "conveyor.params": 2,
    "conveyor.config": 2,
    "conveyor.device": 2,
    "conveyor.core": 3,
    "conveyor.outputs": 4,
    "conveyor.model": 5,
    "conveyor.tensor_parallel": 5.5,  # sharded weights, worker processes, the plan's wire format (tensor parallelism)
    "conveyor.runtime": 6,
    "conveyor.engine": 7,
    "conveyor.data_parallel": 7.5,  # replicas and their router (data parallelism)
    "conveyor.llm": 8,
    "conveyor.bench": 8,
    "conveyor": 8.5,  # the package's public face (LLM, SamplingParams, __version__)
    "conveyor.server": 9,
    "conveyor.data_parallel.serving": 9.5,  # the replicas' HTTP front and app, built on the server's protocol
    "conveyor.cli": 10,
}
"""Rank of each top-level room; a module may import only rooms of a lower rank (or its own room)."""
FRONTENDS = ("server", "data_parallel/serving", "bench", "llm.py", "cli.py")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("conveyor", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path], type_only: bool = False) -> set[str]:
    """Modules of the package that `path` imports, at any depth (function-level imports count:
    they run too); imports only for type checkers are left out unless `type_only`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node) and not type_only:
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            names = names or [node.module]
        found.update(n for n in names if n in modules)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _room(module: str) -> str:
    """The longest prefix of `module` that LAYERS ranks (a sub-room such as conveyor.data_parallel.serving ranks
    apart from its parent room), else its top-level room."""
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_layers_import_downward_only() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        room = _room(name)
        assert room in LAYERS, f"{name}: room {room} has no layer in LAYERS; place it there"
        for target in _imports(path, modules):
            other = _room(target)
            if other != room and LAYERS[other] >= LAYERS[room]:
                upward.append(f"{name} imports {target} ({room} is layer {LAYERS[room]}, {other} is {LAYERS[other]})")
    assert not upward, "imports that do not go downward:\n" + "\n".join(upward)


def test_the_layer_order_is_server_engine_runtime_model_core() -> None:
    order = ["conveyor.server", "conveyor.engine", "conveyor.runtime", "conveyor.model", "conveyor.core"]
    assert [LAYERS[r] for r in order] == sorted((LAYERS[r] for r in order), reverse=True)
    modules = _modules()
    for name, path in modules.items():
        if _room(name) == "conveyor.model":
            bad = {t for t in _imports(path, modules) if _room(t) in ("conveyor.runtime", "conveyor.engine")}
            assert not bad, f"{name} imports {bad}: the model layer sits below runtime and engine"


def test_no_import_cycle() -> None:
    """Not even through imports made only for type checkers: a reader follows those too."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        graph[name] |= _imports(path, modules, type_only=True) - {name}
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_the_walk_sees_a_cycle_and_an_upward_import(tmp_path: pathlib.Path) -> None:
    """The checks above can fail: a planted cycle and a planted upward import are found."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from conveyor.model import b\n")
    b.write_text("from conveyor.model import a\nif TYPE_CHECKING:\n    from conveyor.engine import engine\n")
    modules = {"conveyor.model.a": a, "conveyor.model.b": b, "conveyor.engine.engine": b}
    assert _imports(a, modules) == {"conveyor.model.b"}
    assert _imports(b, modules) == {"conveyor.model.a"}  # the type-checking import is left out
    assert _imports(b, modules, type_only=True) == {"conveyor.model.a", "conveyor.engine.engine"}
    b.write_text("from conveyor.engine.engine import Engine\n")
    assert _imports(b, modules) == {"conveyor.engine.engine"}


def _private_uses(path: pathlib.Path) -> list[str]:
    """`x._name` where x is not self or cls: a frontend reaching into an object it was handed."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_frontend_touches_a_private_attribute() -> None:
    files = [p for f in FRONTENDS for p in ((ROOT / f).rglob("*.py") if (ROOT / f).is_dir() else [ROOT / f])]
    assert len(files) > 20
    found = [use for path in files for use in _private_uses(path)]
    assert not found, (
        "frontends must use the engine's public surface (EngineInfo, counters, constructor hooks):\n" + "\n".join(found)
    )


def test_the_private_attribute_check_can_fail(tmp_path: pathlib.Path) -> None:
    sample = tmp_path / "front.py"
    sample.write_text("def f(engine):\n    engine._on_timings = print\n    return self._x, engine.engine._ready\n")
    found = _private_uses(sample)
    assert len(found) == 2 and "_on_timings" in found[0] and "_ready" in found[1]


BASE_ENTRY_POINTS = """
import contextlib, io, json, sys
import conveyor.cli, conveyor.server.app
for argv in (["--help"], ["generate", "--help"], ["chat", "--help"], ["serve", "--help"], ["inspect", "--help"],
             ["bench", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        conveyor.cli.main(argv)
print(json.dumps(sorted(name.partition(".")[0] for name in sys.modules)))
"""


def test_the_base_install_needs_no_extra() -> None:
    """What `pip install conveyor` (no extras) runs, the CLI and the server, imports no module that only an extra
    (test, bench, ray, openvino) installs: the CLI loads every subcommand's module, so one such import anywhere in them
    stops `conveyor generate` on a base install."""
    import json
    import subprocess
    import sys

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name.lower() for r in project["dependencies"]}
    extras = {Requirement(r).name.lower() for reqs in project["optional-dependencies"].values() for r in reqs}
    extra_only = {name.replace("-", "_") for name in extras - base}
    assert {"ray", "matplotlib", "psutil"} <= extra_only, extra_only  # the walk reads the extras
    result = subprocess.run(
        [sys.executable, "-c", BASE_ENTRY_POINTS], capture_output=True, text=True, timeout=300, check=True
    )
    imported = set(json.loads(result.stdout.splitlines()[-1]))
    assert not imported & extra_only, sorted(imported & extra_only)
