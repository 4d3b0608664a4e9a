"""The fuzzer's runner: each mutant is written to disk, then examined in a forked child (the parent has imported
and warmed up everything, so a child costs a fork) under an address-space limit and a timeout: `conveyor inspect`'s
verdict, then a load as LLM(...) makes it (load_model, then max_model_len from the model's context), then a
fingerprint of what loaded (the spec, every weight's bytes, the tokenizer), compared with the seed's.

Outcome classes (a case passes in the first five):
  refused            a ModelLoadError naming the file; inspect refused too (or, for a NaN / infinite weight, which
                     inspect cannot see without reading weights, said it runs)
  refused-context    loaded, but max_model_len from the model's context was refused (memory)
  loaded-same        loaded, and computes exactly what the seed does
  loaded-value       a `value` mutant loaded computing something else (a valid file of another model)
  loaded-data        a `data` mutant loaded computing something else (tensor bytes changed)
  silent             a `structure` or `nonfinite` mutant loaded computing something else
  traceback          an exception other than ModelLoadError, from inspect or the load
  memory             the address-space limit was hit
  crash              the child died of a signal
  hang               the child spent more CPU time than its timeout, or was blocked for 4 times it
  unnamed            a refusal whose message does not name the file
  inspect-disagrees  inspect said it runs and the load refused (or the other way round)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import select
import signal
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PASSING = ("refused", "refused-context", "loaded-same", "loaded-value", "loaded-data")


@dataclass
class Case:
    seed: str
    index: int
    tag: str
    what: str
    nonfinite: bool
    files: dict[str, bytes]
    """File name -> contents, written into the case's folder (one .gguf file, or a Hugging Face folder); emptied
    once written."""
    entry: str
    """What to load: the .gguf file's name, or "" for the folder itself."""


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.outcome in PASSING


def fingerprint(loaded: Any) -> str:
    """A hash of everything a load decides the computation by: the spec (less the context length, a limit), each
    weight's type, shape and bytes, the tokenizer and the sampling defaults."""
    import torch

    from conveyor.model.gguf_quant import QuantizedWeight
    from conveyor.model.model_checks import PROBE_TEXT

    h = hashlib.blake2b(digest_size=16)
    h.update(repr(dataclasses.replace(loaded.spec, max_position_embeddings=0)).encode())
    for name in sorted(loaded.weights):
        weight = loaded.weights[name]
        h.update(name.encode())
        if isinstance(weight, QuantizedWeight):
            h.update(f"{weight.kind}{weight.in_features}".encode())
            weight = weight.blocks
        if isinstance(weight, torch.Tensor):
            h.update(f"{weight.dtype}{tuple(weight.shape)}".encode())
            h.update(weight.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(weight).encode())
    tokenizer = loaded.tokenizer
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        h.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
        h.update(
            repr((tokenizer.chat_template, tokenizer.all_special_ids, tokenizer(PROBE_TEXT)["input_ids"])).encode()
        )
    h.update(repr(sorted(loaded.sampling_defaults.items())).encode())
    return h.hexdigest()


def examine(path: str) -> dict[str, Any]:
    """inspect, then load, then fingerprint: what a user's `conveyor inspect` and LLM(...) would meet."""
    from conveyor.errors import ModelLoadError
    from conveyor.model.inspect import inspect_model
    from conveyor.model.loader import load_model, resolve_max_model_len

    report: dict[str, Any] = {}
    try:
        summary = inspect_model(path)
        report["inspect"] = "runs" if summary.runs else "refuses"
        report["inspect_reason"] = summary.reason
    except ModelLoadError as exc:
        report["inspect"], report["inspect_reason"] = "refuses", str(exc)
    except BaseException as exc:
        report["inspect"], report["inspect_reason"] = _failure(exc)
    try:
        loaded = load_model(path, "float32")
    except ModelLoadError as exc:
        report["load"], report["message"] = "refused", str(exc)
        return report
    except BaseException as exc:
        report["load"], report["message"] = _failure(exc)
        return report
    try:
        resolve_max_model_len(loaded.spec, None)
        report["load"] = "loaded"
    except ModelLoadError as exc:
        report["load"], report["message"] = "refused-context", str(exc)
    except BaseException as exc:
        report["load"], report["message"] = _failure(exc)
        return report
    try:
        report["fingerprint"] = fingerprint(loaded)
    except BaseException as exc:  # a loaded tokenizer or weight that breaks on use
        report["load"], report["message"] = _failure(exc)
    return report


def _failure(exc: BaseException) -> tuple[str, str]:
    kind = "memory" if isinstance(exc, MemoryError) else "traceback"
    return kind, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-3000:]


def judge(case: Case, report: dict[str, Any], path: str, baseline: str) -> tuple[str, str]:
    """(outcome, detail) of one examined case (module docstring)."""
    load, inspect = report["load"], report["inspect"]
    if load in ("traceback", "memory") or inspect in ("traceback", "memory"):
        where = "load" if load in ("traceback", "memory") else "inspect"
        return (load if where == "load" else inspect), report.get(
            "message" if where == "load" else "inspect_reason", ""
        )
    if load == "refused":
        message = report["message"]
        if path not in message:
            return "unnamed", message
        if inspect == "runs" and "NaN or infinite" not in message:
            return "inspect-disagrees", f"inspect runs it; the load: {message}"
        return "refused", message
    if inspect != "runs":
        return "inspect-disagrees", f"loaded, but inspect: {report.get('inspect_reason')}"
    if load == "refused-context":
        return "refused-context", report["message"]
    if report["fingerprint"] == baseline:
        return "loaded-same", ""
    if case.nonfinite or case.tag == "structure":
        return "silent", "loaded and computes something else"
    return f"loaded-{case.tag}", ""


def address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_cases(
    cases: Iterator[Case],
    baselines: dict[str, str],
    workdir: str,
    jobs: int = 2,
    timeout: Callable[[Case], float] = lambda case: 60.0,
    extra_memory: Callable[[Case], int] = lambda case: 3 * 2**30,
    on_result: Callable[[Result], None] = lambda result: None,
) -> list[Result]:
    """Runs every case in a forked child, `jobs` at a time; returns the results in completion order.

    A hang is a child that spent more CPU time than its timeout (it also has that as RLIMIT_CPU), or that made no
    report for WALL_FACTOR times its timeout of wall time (blocked). Wall time this process spends stopped (a
    job-control stop of the whole run) does not count: a turn of the loop that takes over STALL_S (it takes half a
    second, or the time to write a mutant) moves every deadline by its length."""
    results: list[Result] = []
    running: dict[int, list[Any]] = {}  # fd -> [case, pid, start, output, path, slot]
    free = list(range(jobs))
    pending = iter(cases)
    exhausted = False
    last = time.monotonic()
    while running or not exhausted:
        while free and not exhausted:
            case = next(pending, None)
            if case is None:
                exhausted = True
                break
            slot = free.pop()
            path = _write_case(case, os.path.join(workdir, f"slot{slot}"))
            case.files = {}  # on disk now: a result keeps what the case was, not its (up to 100 MB of) bytes
            fd, pid = _fork(path, extra_memory(case), timeout(case))
            running[fd] = [case, pid, time.monotonic(), bytearray(), path, slot]
        if not running:
            break
        ready, _, _ = select.select(list(running), [], [], 0.5)
        now = time.monotonic()
        if now - last > STALL_S:  # this process was stopped (or starved) since the last turn, its children with it
            for entry in running.values():
                entry[2] += now - last
        last = now
        for fd in list(running):
            case, pid, start, output, path, slot = running[fd]
            done = False
            if fd in ready:
                chunk = os.read(fd, 1 << 16)
                output += chunk
                done = not chunk
            spinning = _cpu_seconds(pid) > timeout(case)
            if not done and not spinning and now - start <= WALL_FACTOR * timeout(case):
                continue
            if not done:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            os.close(fd)
            del running[fd]
            free.append(slot)
            seconds = now - start
            if not done:
                result = Result(
                    case, "hang", f"no report after {seconds:.0f} s ({'CPU' if spinning else 'blocked'})", seconds
                )
            elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
                result = Result(case, "hang", f"over its CPU time limit of {timeout(case):.0f} s", seconds)
            elif os.WIFSIGNALED(status) and not output:
                result = Result(case, "crash", f"signal {os.WTERMSIG(status)}", seconds)
            elif not output:
                result = Result(case, "crash", f"exit status {os.WEXITSTATUS(status)} and no report", seconds)
            else:
                report = json.loads(output)
                outcome, detail = judge(case, report, path, baselines[case.seed])
                result = Result(case, outcome, detail, seconds, report)
            results.append(result)
            on_result(result)
    return results


WALL_FACTOR = 4
"""A child blocked (using no CPU) gets this many times its timeout of wall time before it is called hung."""
STALL_S = 10.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running child (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _write_case(case: Case, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    for name, data in case.files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return os.path.join(folder, case.entry) if case.entry else folder


def _fork(path: str, extra_memory: int, timeout: float) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    limit = address_space_bytes() + extra_memory
    pid = os.fork()
    if pid == 0:  # the child: examine, report, exit without running the parent's cleanup
        try:
            os.close(read_fd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CPU, (int(timeout) + 10, int(timeout) + 11))
            report = json.dumps(examine(path)).encode()
            while report:
                report = report[os.write(write_fd, report) :]
        finally:
            os._exit(0)
    os.close(write_fd)
    return read_fd, pid


def summarize(results: list[Result]) -> str:
    counts = Counter((r.case.seed.split(":")[0], r.outcome) for r in results)
    lines = [f"{len(results)} cases, {sum(not r.passed for r in results)} failing"]
    for (kind, outcome), n in sorted(counts.items()):
        lines.append(f"  {kind:12} {outcome:18} {n}")
    for r in results:
        if not r.passed:
            lines.append(
                f"FAIL {r.outcome}: {r.case.seed} #{r.case.index} [{r.case.tag}] {r.case.what}: {r.detail[-600:]}"
            )
    return "\n".join(lines)
