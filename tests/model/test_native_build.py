"""The native-kernel cache is keyed by content, not by the checkout's path: two checkouts at different paths,
run alternately, build once; concurrent first starts build once; a killed build leaves nothing that blocks.

Each start is a process of its own, forked from a server process that has imported torch and transformers (most
of a new interpreter's start) and nothing else: each imports conveyor afresh, from the checkout or package copy its
path names first, with no extension loaded, as `python -c` would."""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import conveyor

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("c++") is None,
    reason="building an extension needs Linux and a C++ compiler (c++)",
)

BUILD_LINE = "compiling"  # the WARNING that cached_extension logs when (and only when) it builds

# A minimal Python extension (no torch headers: it compiles in about a second). Its module name comes from
# torch's -DTORCH_EXTENSION_NAME, which is the cache entry's hashed name.
TINY_SOURCE = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

LOAD_TINY = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from conveyor.model.native_build import cached_extension
module = cached_extension("tiny_test", [Path(sys.argv[1])], [], ["-O1"], [], "tiny test extension")
assert module.answer() == 42
print("answer", module.answer())
"""

AS_A_NEW_INTERPRETER = """
import os, sys
out, err, cache, cwd, argv, package_parent = start
for fd, path in ((1, out), (2, err)):
    with open(path, "w") as file:
        os.dup2(file.fileno(), fd)
os.environ["TORCH_EXTENSIONS_DIR"] = cache
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
os.chdir(cwd)
sys.argv = argv
if package_parent:
    sys.path.insert(0, package_parent)
"""
"""What `python -c <code> <argv...>` would start with, run with the extension cache `cache`, ninja on PATH, in the
folder cwd, PYTHONPATH=package_parent (where given), its stdout and stderr into the files out and err (`start`
holds these)."""


def _checkout(root: Path, name: str) -> Path:
    """A 'checkout' of the tiny extension: the same source text at its own path."""
    folder = root / name / "csrc"
    folder.mkdir(parents=True)
    source = folder / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    return source


def _starts(
    code: str, runs: list[tuple[list[str], Path | None]], cache: Path, cwd: Path
) -> list[subprocess.CompletedProcess[str]]:
    """`python -c code` once for each (arguments, package_parent) of runs, all at once, each a process of its own
    (see the module's docstring); their exit statuses and output."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers"])  # what conveyor imports that costs the most time
    with tempfile.TemporaryDirectory() as folder:
        outputs = [(Path(folder, f"{i}.out"), Path(folder, f"{i}.err")) for i in range(len(runs))]
        processes = []
        for (args, package_parent), (out, err) in zip(runs, outputs, strict=True):
            start = (str(out), str(err), str(cache), str(cwd), ["-c", *args], str(package_parent or ""))
            namespace = {"__name__": "__main__", "start": start}
            processes.append(context.Process(target=exec, args=(AS_A_NEW_INTERPRETER + code, namespace)))
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=600)
            if process.exitcode is None:
                process.kill()
                process.join()
        return [
            subprocess.CompletedProcess(
                ["-c", code, *args],
                process.exitcode,
                out.read_text() if out.exists() else "",
                err.read_text() if err.exists() else "",
            )
            for (args, _), process, (out, err) in zip(runs, processes, outputs, strict=True)
        ]


def _run(
    code: str, args: list[str], cache: Path, cwd: Path, package_parent: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """One start of `python -c code args...` (see _starts); it must succeed."""
    (result,) = _starts(code, [(args, package_parent)], cache, cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_two_checkouts_alternating_build_once(tmp_path: Path) -> None:
    cache = tmp_path / "extensions"
    first, second = _checkout(tmp_path, "clone-a"), _checkout(tmp_path, "clone-b")
    logs = [_run(LOAD_TINY, [str(source)], cache, tmp_path).stderr for source in (first, second) * 2]
    builds = [i for i, log in enumerate(logs) if BUILD_LINE in log]
    assert builds == [0], f"expected one build (the first run), got builds in runs {builds}: {logs}"
    entries = [p.name for p in cache.iterdir() if p.is_dir()]
    assert len(entries) == 1 and entries[0].startswith("tiny_test_")
    assert all("WARNING" not in log for log in logs[1:]), logs[1:]


def test_changed_source_builds_anew(tmp_path: Path) -> None:
    cache = tmp_path / "extensions"
    source = _checkout(tmp_path, "clone")
    assert BUILD_LINE in _run(LOAD_TINY, [str(source)], cache, tmp_path).stderr
    source.write_text(TINY_SOURCE + "\n// changed\n")
    assert BUILD_LINE in _run(LOAD_TINY, [str(source)], cache, tmp_path).stderr
    assert BUILD_LINE not in _run(LOAD_TINY, [str(source)], cache, tmp_path).stderr
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_concurrent_first_starts_build_once(tmp_path: Path) -> None:
    cache = tmp_path / "extensions"
    sources = [_checkout(tmp_path, f"clone-{i}") for i in range(3)]
    runs = _starts(LOAD_TINY, [([str(source)], None) for source in sources], cache, tmp_path)
    outputs = [(run.stdout, run.stderr) for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    assert all("answer 42" in out for out, _ in outputs)
    assert sum(BUILD_LINE in err for _, err in outputs) == 1, [err for _, err in outputs]


def test_leftovers_of_a_killed_build_do_not_block(tmp_path: Path) -> None:
    """A build killed midway leaves its build folder (with torch's own 'lock' file, which makes torch's loader
    wait forever) and perhaps a stale lock file: the next start rebuilds; so does a damaged cached library."""
    cache = tmp_path / "extensions"
    source = _checkout(tmp_path, "clone")
    _run(LOAD_TINY, [str(source)], cache, tmp_path)
    entry = next(p for p in cache.iterdir() if p.is_dir())
    (entry / f"{entry.name}.so").unlink()  # as if the process died before moving the library into place
    (entry / "build" / "lock").write_text("")
    (entry / "build" / f"{entry.name}.so").write_bytes(b"half a library")
    log = _run(LOAD_TINY, [str(source)], cache, tmp_path).stderr
    assert BUILD_LINE in log
    (entry / f"{entry.name}.so").write_bytes(b"not a library")  # a damaged cached build is built again
    log = _run(LOAD_TINY, [str(source)], cache, tmp_path).stderr
    assert "does not load" in log and BUILD_LINE in log


def test_real_kernels_from_two_package_copies_share_one_build(tmp_path: Path) -> None:
    """The acceptance check with the real kernels: two copies of the package at different paths, run
    alternately 4 times against this machine's cache, build at most once (none when the suite's own build is
    there, as after scripts/setup.sh)."""
    package = Path(conveyor.__file__).parent
    copies = []
    for name in ("clone-a", "clone-b"):
        shutil.copytree(package, tmp_path / name / "conveyor", ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(tmp_path / name)
    from conveyor.model.native_build import cache_root

    script = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(message)s')\n"
        "import conveyor; assert conveyor.__file__.startswith(sys.argv[1]), conveyor.__file__\n"
        "from conveyor.model.native import load_kernels, NoToolchain\n"
        "load_kernels(); print('loaded')\n"
    )
    runs = [_run(script, [str(copy)], cache_root(), tmp_path, package_parent=copy) for copy in copies * 2]
    assert all(run.stdout.strip() == "loaded" for run in runs)
    logs = [run.stderr for run in runs]
    builds = [i for i, log in enumerate(logs) if BUILD_LINE in log]
    assert builds in ([], [0]), f"builds in runs {builds}: {logs}"
