"""A compiled extension cached by what it is built from, not by where: one build per machine, shared by every
checkout and virtual environment, and safe when several processes start at once.

torch's `cpp_extension.load` re-runs ninja on every start, and ninja rebuilds whenever build.ninja changed;
that file holds absolute paths (the sources in this checkout, torch's headers in this venv), so two checkouts
sharing one cache folder rebuilt the kernels in turn. Here instead:

    <root>/<name>/<name>.so     the finished library; <name> = prefix + a hash of the sources' contents, the
                                flags, the CPU's features, torch's and Python's versions (never a path)
    <root>/<name>/build/        torch's build folder, used only while building
    <root>/<name>.lock          held (flock) while building; the OS releases it if the builder dies
    <root>/<name>.log           the output of a build started in the background (start_background_build)

A start finds <name>.so and imports it directly (no ninja, nothing compared). A first start takes the lock,
looks again (another process may have just finished), builds, then moves the library into place atomically,
so a half-written file is never loaded. <root> is $TORCH_EXTENSIONS_DIR, else torch's default
(~/.cache/torch_extensions).

A caller that must not wait (the engine's first start on a fresh machine) asks library_path() whether the build
exists, and when it does not, start_background_build() runs the build in a detached process (one: a process
that finds the lock held starts none) and returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """$TORCH_EXTENSIONS_DIR, else torch's default extension cache."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (space-separated; empty where unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def build_name(prefix: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """prefix + a hash of everything the library depends on, and of nothing that depends on the checkout's place."""
    digest = hashlib.sha1()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(" ".join([*cflags, "|", *ldflags]).encode())
    digest.update(cpu_flags().encode())
    digest.update(
        f"torch {torch.__version__} python {sys.version_info[:2]} {sysconfig.get_config_var('SOABI')}".encode()
    )
    return f"{prefix}_{digest.hexdigest()[:12]}"


def library_path(
    prefix: str, sources: Sequence[Path], headers: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]
) -> Path:
    """Where the build of exactly these inputs lies in the cache (it exists once built)."""
    name = build_name(prefix, [*sources, *headers], cflags, ldflags)
    return cache_root() / name / f"{name}.so"


_LOCK_FD_ENV = "CONVEYOR_BUILD_LOCK_FD"
"""Set for a background build: the descriptor of the build's lock, taken by the process that started it and held
from its check until the build ends (no gap in which a second start could find the lock free)."""


def start_background_build(library: Path, command: Sequence[str], env: dict[str, str] | None = None) -> Path | None:
    """Run `command` (a process that builds `library` through cached_extension) detached from this process, its
    output in <root>/<name>.log, unless a build of it is under way (its lock held: then None, nothing started).
    Returns the log's path. The lock is taken here and handed to the started process, which holds it until its
    build ends, so that starts racing here start one build."""
    name = library.stem
    root = library.parent.parent
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"{name}.log"
    with open(root / f"{name}.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        child_env = dict(os.environ if env is None else env)
        child_env[_LOCK_FD_ENV] = str(handle.fileno())
        with open(log, "w") as out:
            subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(handle.fileno(),),
                env=child_env,
            )
    # closing this process's descriptor leaves the lock to the child's (one open file description)
    return log


def _inherited_lock(lock_path: Path) -> int | None:
    """The descriptor of lock_path's lock when this process was started holding it (start_background_build)."""
    value = os.environ.pop(_LOCK_FD_ENV, None)
    if value is None:
        return None
    try:
        fd = int(value)
        held, target = os.fstat(fd), os.stat(lock_path)
    except (ValueError, OSError):
        return None
    return fd if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino) else None


@contextlib.contextmanager
def _exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """An flock on lock_path; says so when another process holds it (it is building the same library). A build
    started in the background holds it already (inherited): released when done."""
    inherited = _inherited_lock(lock_path)
    if inherited is not None:
        try:
            yield
        finally:
            os.close(inherited)
        return
    with open(lock_path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%s: another process is building them (lock %s); waiting for it", what, lock_path)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} cannot be imported as the extension module {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cached_extension(
    prefix: str,
    sources: Sequence[Path],
    headers: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    what: str,
    before_build: Callable[[], None] | None = None,
) -> ModuleType:
    """Import the extension built from `sources` (headers: hashed, not compiled), building it first when this
    machine has no build of exactly these inputs. `what` names it in log lines ("native kernels");
    before_build runs only when a build is needed (e.g. to check for a compiler). Build failures raise
    what torch's builder raised."""
    library = library_path(prefix, sources, headers, cflags, ldflags)
    name, root = library.stem, library.parent.parent
    if library.exists():
        try:
            return _import(name, library)
        except ImportError:
            pass  # looked at again under the lock below
    if before_build is not None:
        before_build()
    (root / name).mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f"{name}.lock", what):
        if library.exists():  # built by the process we waited for, or a cached build that did not load
            try:
                return _import(name, library)
            except ImportError as exc:
                logger.warning("%s: the cached build %s does not load (%s); building it again", what, library, exc)
                library.unlink()
        return _build(name, sources, cflags, ldflags, library, what)


def _build(
    name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], library: Path, what: str
) -> ModuleType:
    from torch.utils.cpp_extension import load

    build = library.parent / "build"
    shutil.rmtree(build, ignore_errors=True)  # whatever a killed build left (torch's own stale 'lock' file too)
    build.mkdir()
    logger.warning(
        "%s: compiling %s for this CPU and torch %s into %s (once per machine, not per checkout; "
        "processes that need it meanwhile wait for it)",
        what,
        name,
        torch.__version__,
        library.parent,
    )
    started = time.monotonic()
    module = load(
        name,
        [str(s) for s in sources],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        build_directory=str(build),
        verbose=False,
    )
    partial = library.with_name(f".{name}.so.{os.getpid()}")
    shutil.copyfile(build / f"{name}.so", partial)
    os.replace(partial, library)  # atomic: other processes see no library or the whole one
    logger.warning("%s: built in %.0f s; later starts load %s", what, time.monotonic() - started, library)
    return module
