"""Host memory for CPU steps: freed blocks kept for the next step (glibc's malloc told to reuse large blocks instead
of returning them), and the KV cache on huge pages.

Why: glibc serves every block above its mmap threshold (dynamic, at most 32 MiB) with a fresh mapping and unmaps
it on free, and hands the top of its heap back to the OS past a trim threshold. A forward on the CPU allocates its
activations anew at every layer, so each prompt-carrying step touched new pages, and the kernel zeroed each one on
its first write. The 1B-class model's step of 2048 prompt tokens allocates ~100 MB per layer (the gate/up product
alone is 2048 x 16384 bfloat16, 67 MB), ~1.6 GB of fresh pages per step, and an elementwise op over fresh pages
pays for zeroing them on top of its own work. Models whose activations stay under glibc's 32 MiB limit are not
affected. `conveyor bench throughput`, alternating with CONVEYOR_KEEP_FREED_MEMORY=0, measures the difference.

What: once the model's weights and the KV cache are allocated (so that they keep mappings of their own and a
load's transient copies go back to the OS), `keep_freed_host_memory` sets M_MMAP_MAX = 0 (every block from the
heap, reused once freed) and M_TRIM_THRESHOLD = KEEP_FREE_BYTES (up to that much free memory stays at the heap's
top). The price: the process keeps its high-water mark of activations resident (a few hundred MB for a 1B model's
2048-token steps) instead of returning it after each step. Threads other than the main one allocate from arenas of
64 MiB heaps; blocks larger than that still get a mapping of their own there.

Left alone when the C library is not glibc, when the environment already tunes glibc's malloc (MALLOC_MMAP_MAX_,
MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, or GLIBC_TUNABLES naming glibc.malloc), when
LD_PRELOAD puts another allocator in front (jemalloc, tcmalloc, mimalloc), or when CONVEYOR_KEEP_FREED_MEMORY=0
(glibc's defaults as they are). Setting any MALLOC_* value is not the same as glibc's defaults: it also fixes the
mmap threshold at 128 KiB, which glibc otherwise raises as large blocks are freed, so that even mid-sized
activations get fresh mappings again (MALLOC_MMAP_MAX_=65536 makes every step slower).

Huge pages: decode attention reads a few KiB of every sequence's blocks scattered over the whole cache, one page
walk per 4 KiB page. `advise_huge_pages` asks Linux for transparent huge pages (madvise MADV_HUGEPAGE, which takes
effect where /sys/kernel/mm/transparent_hugepage/enabled says "always" or "madvise") before the cache is first
written: one walk per 2 MiB page instead, and fewer TLB misses in decode attention.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

OPT_OUT = "CONVEYOR_KEEP_FREED_MEMORY"
"""Environment variable: '0' leaves glibc's malloc as it is."""
KEEP_FREE_BYTES = 1 << 30
"""M_TRIM_THRESHOLD: free memory at the heap's top up to this stays with the process."""

_MADV_HUGEPAGE = 14  # madvise advice, from Linux's mman-common.h
_HUGE_PAGE = 2 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_MAX = -4
_MALLOC_ENVIRONMENT = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state = {"decided": False, "applied": False}


def why_left_alone() -> str | None:
    """Why this process keeps its allocator's settings (None: keep_freed_host_memory will set them)."""
    if os.environ.get(OPT_OUT) == "0":
        return f"{OPT_OUT}=0"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    named = [name for name in _MALLOC_ENVIRONMENT if name in os.environ]
    if named or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return f"the environment tunes glibc's malloc ({', '.join(named) or 'GLIBC_TUNABLES'})"
    preload = os.environ.get("LD_PRELOAD", "")
    other = [name for name in _OTHER_ALLOCATORS if name in preload]
    if other:
        return f"LD_PRELOAD puts {other[0]} in front of glibc's malloc"
    return None


def keep_freed_host_memory() -> bool:
    """Once per process, after the weights and KV cache exist: glibc's malloc reuses freed blocks (module docstring).
    True where the settings are in force."""
    if _state["decided"]:
        return _state["applied"]
    _state["decided"] = True
    reason = why_left_alone()
    if reason is not None:
        logger.info("host memory: glibc malloc left as configured: %s", reason)
        return False
    libc = ctypes.CDLL(None)
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES)):
        logger.warning(
            "host memory: glibc's mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD; each step's "
            "activations may page-fault anew"
        )
        return False
    _state["applied"] = True
    logger.info(
        "host memory: freed blocks are kept for reuse (M_MMAP_MAX=0, M_TRIM_THRESHOLD=%d MiB)", KEEP_FREE_BYTES >> 20
    )
    return True


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Asks Linux to back the whole 2 MiB pages inside host memory [address, address + nbytes) with huge pages
    (module docstring); call it before the memory is first written. True where the advice was taken (whether huge
    pages are then used is the kernel's setting); False off Linux, for less than a huge page, or where madvise
    refuses."""
    if platform.system() != "Linux":
        return False
    first = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end <= first:
        return False
    return _madvise(first, end - first, _MADV_HUGEPAGE, "MADV_HUGEPAGE")


_MADV_PAGEOUT = 21  # madvise advice (Linux 5.4+), from Linux's mman-common.h
_PAGE = 4096


def page_out(address: int, nbytes: int) -> bool:
    """Asks Linux to reclaim the pages of host memory [address, address + nbytes) now (madvise MADV_PAGEOUT,
    widened to whole pages): a file's mapped pages that were only read (a checkpoint's weights checked at load) leave
    the resident set and are read from the file again if touched; nothing is lost, so the advice is safe on any
    mapping. True where the advice was taken; False off Linux or where madvise refuses (older kernels)."""
    if platform.system() != "Linux" or nbytes <= 0:
        return False
    first = address // _PAGE * _PAGE
    end = -(-(address + nbytes) // _PAGE) * _PAGE
    return _madvise(first, end - first, _MADV_PAGEOUT, "MADV_PAGEOUT")


def _madvise(address: int, nbytes: int, advice: int, name: str) -> bool:
    """madvise(address, nbytes, advice) through libc (address page-aligned); False, logged, where it is refused."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(address, nbytes, advice) != 0:
        logger.debug("host memory: madvise(%s) refused (errno %d)", name, ctypes.get_errno())
        return False
    return True
