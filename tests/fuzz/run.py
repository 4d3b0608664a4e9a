"""Fuzz Conveyor's model loading with seeded structure-aware mutants of GGUF files and Hugging Face folders.

    python -m tests.fuzz.run --cases 3000 --safetensors-cases 500 --seed 0 --seeds default,tiny --jobs 2

Seeds: `default` (the embedded SmolLM2 GGUF), `tiny` (tests/fuzz/seeds.py: tiny GGUF files of several families and
weight types, tiny Hugging Face folders). Each case is reproducible alone with the same --seed, --seeds and
--case gguf:INDEX (or safetensors:INDEX); its mutant stays under --workdir. Prints the count of each outcome
(tests/fuzz/harness.py) and every failing case; exits 1 when any case fails. --log writes one JSON line per case;
with --resume, a run skips the cases its log already holds (an interrupted run goes on) and sums up the whole log.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .gguf_mutator import GGUFMutator
from .harness import PASSING, Case, Result, examine, run_cases, summarize
from .safetensors_mutator import SafetensorsMutator
from .seeds import TINY_FOLDERS, TINY_GGUF, write_tiny_folder, write_tiny_gguf


@dataclass
class Seed:
    name: str
    kind: str
    """'gguf' or 'safetensors'."""
    mutator: Any
    weight: float
    baseline: str = ""


def build_seeds(
    workdir: str,
    which: set[str],
    default_share: float = 0.3,
    tiny_gguf: tuple[tuple[str, str], ...] = TINY_GGUF,
    tiny_folders: tuple[tuple[str, str], ...] = TINY_FOLDERS,
) -> list[Seed]:
    """The seed files (under workdir/seeds), their mutators and each one's share of the cases of its kind."""
    root = os.path.join(workdir, "seeds")
    seeds: list[Seed] = []
    if "tiny" in which:
        for family, weight_type in tiny_gguf:
            folder = os.path.join(root, f"{family}-{weight_type}")
            os.makedirs(folder, exist_ok=True)
            path = write_tiny_gguf(os.path.join(folder, "model.gguf"), family, weight_type)
            share = (1 - default_share if "default" in which else 1.0) / len(tiny_gguf)
            seeds.append(Seed(f"tiny:{family}-{weight_type}", "gguf", GGUFMutator(_read(path)), share))
        for arch, dtype in tiny_folders:
            folder = write_tiny_folder(os.path.join(root, f"hf-{arch}-{dtype}"), arch, dtype)
            mutator = SafetensorsMutator(
                _read(os.path.join(folder, "config.json")), _read(os.path.join(folder, "model.safetensors"))
            )
            seeds.append(Seed(f"hf:{arch}-{dtype}", "safetensors", mutator, 1 / len(tiny_folders)))
    if "default" in which:
        from conveyor.model.loader import default_model_path

        share = default_share if "tiny" in which else 1.0
        seeds.append(Seed("default:smollm2", "gguf", GGUFMutator(_read(default_model_path())), share))
    return seeds


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def seed_case(seed: Seed, index: int, rng: random.Random) -> Case:
    mutation = seed.mutator.mutate(rng)
    if seed.kind == "gguf":
        return Case(
            seed.name,
            index,
            mutation.tag,
            mutation.what,
            mutation.nonfinite,
            {"model.gguf": mutation.data},
            "model.gguf",
        )
    return Case(seed.name, index, mutation.tag, mutation.what, mutation.nonfinite, mutation.files, "")


def generate(
    seeds: list[Seed], kind: str, count: int, seed: int, offset: int = 0, skip: frozenset[tuple[str, int]] = frozenset()
) -> Iterator[Case]:
    """Case `offset + i` of `kind`, for i < count (less those in `skip`): its own random stream, so any one is
    reproducible alone."""
    pool = [s for s in seeds if s.kind == kind]
    if not pool:
        return
    for i in range(offset, offset + count):
        if (kind, i) in skip:
            continue
        rng = random.Random(f"{seed}:{kind}:{i}")
        chosen = rng.choices(pool, [s.weight for s in pool])[0]
        yield seed_case(chosen, i, rng)


def take_baselines(seeds: list[Seed], workdir: str) -> None:
    """Each seed examined here, in the parent (which also imports and warms up what the children will use): it must
    load, and its fingerprint is what an unchanged computation looks like."""
    import torch

    torch.set_num_threads(1)  # no thread pool in the parent: the children are forked from it
    for seed in seeds:
        case = seed_case(seed, -1, random.Random(0))
        folder = os.path.join(workdir, "baseline", seed.name.replace(":", "-"))
        os.makedirs(folder, exist_ok=True)
        files = dict(case.files)
        if seed.kind == "gguf":
            files["model.gguf"] = seed.mutator.data
        else:
            files = {"config.json": seed.mutator.config_bytes, "model.safetensors": seed.mutator.weights}
        for name, data in files.items():
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        report = examine(os.path.join(folder, case.entry) if case.entry else folder)
        if report.get("load") != "loaded" or report.get("inspect") != "runs":
            raise RuntimeError(f"seed {seed.name} does not load: {report}")
        seed.baseline = report["fingerprint"]


def fuzz(
    cases: int,
    safetensors_cases: int,
    seed: int,
    which: set[str],
    workdir: str,
    jobs: int = 2,
    log: str | None = None,
    only: tuple[str, int] | None = None,
    tiny_gguf: tuple[tuple[str, str], ...] = TINY_GGUF,
    tiny_timeout: float = 90.0,
    skip: frozenset[tuple[str, int]] = frozenset(),
) -> list[Result]:
    """Builds the seeds, takes their baselines and runs the cases; the calling process keeps its tokenizer cache
    setting and torch thread count (its children run with one thread: they are forked from it)."""
    import torch

    saved = os.environ.get("CONVEYOR_CACHE"), torch.get_num_threads()
    os.environ["CONVEYOR_CACHE"] = os.path.join(workdir, "cache")
    log_file = open(log, "a") if log else None  # noqa: SIM115 - closed below, written per result
    try:
        seeds = build_seeds(workdir, which, tiny_gguf=tiny_gguf)
        take_baselines(seeds, workdir)
        baselines = {s.name: s.baseline for s in seeds}

        def all_cases() -> Iterator[Case]:
            if only is not None:
                yield from generate(seeds, only[0], 1, seed, only[1])
                return
            yield from generate(seeds, "gguf", cases, seed, skip=skip)
            yield from generate(seeds, "safetensors", safetensors_cases, seed, skip=skip)

        def on_result(result: Result) -> None:
            if log_file is not None:
                record = {
                    "kind": _kind(result.case.seed),
                    "seed": result.case.seed,
                    "index": result.case.index,
                    "tag": result.case.tag,
                    "what": result.case.what,
                    "outcome": result.outcome,
                    "seconds": round(result.seconds, 2),
                    "detail": result.detail[-2000:],
                }
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()

        def timeout(case: Case) -> float:
            return 300.0 if case.seed.startswith("default") else tiny_timeout

        def memory(case: Case) -> int:
            return (4 if case.seed.startswith("default") else 2) * 2**30

        return run_cases(all_cases(), baselines, workdir, jobs, timeout, memory, on_result)
    finally:
        if log_file is not None:
            log_file.close()
        if saved[0] is None:
            os.environ.pop("CONVEYOR_CACHE", None)
        else:
            os.environ["CONVEYOR_CACHE"] = saved[0]
        torch.set_num_threads(saved[1])


def _kind(seed_name: str) -> str:
    return "safetensors" if seed_name.startswith("hf:") else "gguf"


def read_log(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize_log(records: list[dict[str, Any]]) -> str:
    """The counts of each outcome by seed family, and every failing case, over a whole log (resumed runs too)."""
    counts = Counter((r["seed"].split(":")[0], r["outcome"]) for r in records)
    failing = [r for r in records if r["outcome"] not in PASSING]
    lines = [f"{len(records)} cases, {len(failing)} failing"]
    lines += [f"  {family:12} {outcome:18} {n}" for (family, outcome), n in sorted(counts.items())]
    lines += [
        f"FAIL {r['outcome']}: {r['seed']} #{r['index']} [{r['tag']}] {r['what']}: {r['detail'][-600:]}"
        for r in failing
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300, help="GGUF mutants")
    parser.add_argument("--safetensors-cases", type=int, default=0, help="Hugging Face folder mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="tiny", help="comma-separated: default, tiny")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--workdir", default=None, help="where mutants and the tokenizer cache go (default: a temp dir)"
    )
    parser.add_argument("--log", default=None, help="append one JSON line per case to this file")
    parser.add_argument("--case", default=None, help="run only this case: gguf:INDEX or safetensors:INDEX")
    parser.add_argument(
        "--resume", action="store_true", help="skip the cases --log already holds; summarize the whole log"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="conveyor-fuzz-")
    start = time.monotonic()
    only = (args.case.split(":")[0], int(args.case.split(":")[1])) if args.case else None
    done = read_log(args.log) if args.resume and args.log else []
    skip = frozenset((r.get("kind", _kind(r["seed"])), r["index"]) for r in done)
    results = fuzz(
        args.cases,
        args.safetensors_cases,
        args.seed,
        set(args.seeds.split(",")),
        workdir,
        args.jobs,
        args.log,
        only,
        skip=skip,
    )
    print(summarize_log(read_log(args.log)) if args.resume and args.log else summarize(results))
    print(f"{time.monotonic() - start:.0f} s; mutants and cache under {workdir}")
    failing = [r for r in read_log(args.log) if r["outcome"] not in PASSING] if args.resume and args.log else []
    return 0 if all(r.passed for r in results) and not failing else 1


if __name__ == "__main__":
    sys.exit(main())
