"""How long torch's OpenMP threads spin between parallel regions, chosen before torch starts them.

Why: torch's CPU ops (and the native kernels, through at::parallel_for) run on GNU libgomp's thread
team. By default a thread that finishes its share of a parallel region spins (300,000
pause loops: milliseconds) before it sleeps. A decode step runs hundreds of parallel regions; when
another busy process shares the cores, the spinning thread burns the time slice that the thread it
waits for needs, and each region can cost a scheduler tick, so a request can take many times longer
on a shared machine; the fewer spins, the smaller that collapse (OMP_WAIT_POLICY=PASSIVE, no spinning,
the smallest). On an idle machine a thread that sleeps too soon must be woken for the next region,
which makes every step slower: too few spins cost throughput. 10000 is the setting that costs nothing
idle and still cuts most of the shared-machine collapse. Tuned with `conveyor bench latency` beside a
busy process and `conveyor bench throughput` on an idle machine, each with GOMP_SPINCOUNT set.

libgomp reads GOMP_SPINCOUNT / OMP_WAIT_POLICY once, when it is loaded, which is at `import torch`.
So `import conveyor` sets the spin count first (conveyor/__init__.py), unless:
  - the environment already names one (OMP_WAIT_POLICY or GOMP_SPINCOUNT): it is left as given;
  - torch was imported before conveyor: too late; the engine logs a warning saying what to do.
The variable is removed from os.environ again once torch has loaded, so that processes Conveyor
starts (benchmark peers, servers) get the environment they were given.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

SPIN_COUNT = "10000"
"""GOMP_SPINCOUNT Conveyor sets: idle threads spin this many pause loops, then sleep (libgomp's default: 300,000)."""
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_state = {"applied": False, "too_late": False}


def set_wait_policy() -> None:
    """Before torch is imported: load it under GOMP_SPINCOUNT=SPIN_COUNT (see the module's docstring)."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return
    if "torch" in sys.modules:
        _state["too_late"] = True
        return
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    try:
        import torch  # noqa: F401  (libgomp reads it now)
    finally:
        del os.environ["GOMP_SPINCOUNT"]
    _state["applied"] = True


def warn_if_spinning() -> None:
    """Log once per process when torch was imported before conveyor with no spin count or wait policy set."""
    if _state["too_late"]:
        _state["too_late"] = False
        logger.warning(
            "torch was imported before conveyor, so its OpenMP threads spin-wait between ops; on a "
            "machine shared with other busy processes that can make Conveyor many times slower. Import "
            "conveyor before torch, or start Python with GOMP_SPINCOUNT=10000 (or OMP_WAIT_POLICY=PASSIVE) in the "
            "environment"
        )
