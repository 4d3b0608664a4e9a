"""How torch's OpenMP threads wait between parallel regions, chosen before torch starts them.

Why: torch's CPU ops (and the native kernels, through at::parallel_for) run on GNU libgomp's thread
team. By default a thread that finishes its share of a parallel region spins (up to 300,000
iterations, ~0.1-1 ms) before it sleeps. A decode step runs hundreds of parallel regions; when
another busy process shares the cores, the spinning thread burns the time slice that the thread it
waits for needs, and each region can cost a scheduler tick. Measured on the 2-core machine (one
request of the default model, 128 prompt + 64 output tokens, other engineers' jobs running): 16-54 s
with the default, 2-4 s with OMP_WAIT_POLICY=PASSIVE (benchmarks/RESULTS.md, "Shared machines").

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when it is loaded, which is at `import torch`.
So `import conveyor` sets the policy first (conveyor/__init__.py), unless:
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

WAIT_POLICY = "PASSIVE"
"""OMP_WAIT_POLICY Conveyor sets: idle threads sleep at once instead of spinning."""
_USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_state = {"applied": False, "too_late": False}


def set_wait_policy() -> None:
    """Before torch is imported: load it under OMP_WAIT_POLICY=WAIT_POLICY (see the module's docstring)."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return
    if "torch" in sys.modules:
        _state["too_late"] = True
        return
    os.environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    try:
        import torch  # noqa: F401  (libgomp reads the policy now)
    finally:
        del os.environ["OMP_WAIT_POLICY"]
    _state["applied"] = True


def warn_if_spinning() -> None:
    """Log once per process when torch was imported before conveyor with no wait policy set."""
    if _state["too_late"]:
        _state["too_late"] = False
        logger.warning("torch was imported before conveyor, so its OpenMP threads spin-wait between ops; on a "
                       "machine shared with other busy processes that can make Conveyor 10-20x slower. Import "
                       "conveyor before torch, or start Python with OMP_WAIT_POLICY=PASSIVE in the environment")
