"""Keep freed memory in the process heap, so that each step's large tensors reuse resident pages.

glibc's malloc serves a large request (above ~128 KiB, a threshold it raises as it goes) with a
fresh ``mmap`` and returns it to the system on ``free``; the top of the heap is trimmed back too.
A training step allocates the same large tensors every time (SmolLM2: activations, the 49k x 576
LM-head gradient and logits, each 100+ MB), so every step faults all of those pages in again and
zero-fills them: in a profile of one SmolLM2 update on this project's 2-core machine, filling
the head gradient's fresh pages alone took 0.2 s. :func:`retain_freed_memory` tells glibc
(``mallopt``) to serve every request from its heap and never trim it: freed blocks stay resident
and the next step reuses them. Measured (fp32, 2 threads, 16 x 32-token rows): a SmolLM2 update
3.5 -> 2.75 s repeated on one batch, a 32-token sampling call 3.4 -> 3.16 s (alternating the two,
the difference was inside the host's noise). The cost is memory: blocks freed in one phase are
kept for the next rather than returned, so the peak grows (SmolLM2 in ``benchmarks/vs_trl.py``:
4.7 instead of 3.7 GB resident), and what is freed after the peak stays with the process until it
exits. ``retain_freed_memory: false`` where memory is tighter than time. Intel's PyTorch CPU
tuning guide gets the same effect from swapping in jemalloc or tcmalloc; this needs no library.

The run option ``retain_freed_memory`` (default true) switches it on in every worker process;
it does nothing off Linux or on a C library other than glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4

_applied = False


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt but ignores these)
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory() -> bool:
    """Serve every allocation of this process from the heap and never trim it (glibc ``mallopt``:
    ``M_MMAP_MAX`` 0, ``M_TRIM_THRESHOLD`` unlimited). Returns whether it is in effect; idempotent.

    Requests the heap cannot grow for (rare: another mapping in the way) still fall back to
    ``mmap`` inside glibc, so no allocation fails because of it.
    """
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # -1 as the trim threshold is SIZE_MAX inside glibc (the value is stored as a size_t)
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
    return _applied


def retained() -> bool:
    """Whether :func:`retain_freed_memory` is in effect in this process."""
    return _applied
