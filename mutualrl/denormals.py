"""Flush denormal floats to zero on the CPU, where they stall every product they enter.

A float below ~1.2e-38 (a denormal) takes a slow microcode path on x86 CPUs, 100x and more per
operation. Training small models makes them: in the zoo's GPT-2 GRPO update, the gradients that
come out of attention carry enough of them that the backward products of the QKV projection ran
at ~19 GFLOP/s instead of ~280 (a 79-MFLOP product 4.2 ms instead of 0.28). With the CPU told to
flush denormal results and inputs to zero (FTZ/DAZ, :func:`torch.set_flush_denormal`) the zoo's
update took 0.037 instead of 0.067 s (2 threads), SmolLM2's 2.64 instead of 2.75 s. A flushed
value differs from the exact one by less than 1.2e-38, far below anything training resolves;
TensorFlow runs its CPU kernels this way by default.

The run option ``flush_denormals`` (default true) switches it on while a worker samples, trains
or evaluates (:func:`denormals_flushed`) and back to what it was afterwards: the setting is the
CPU thread's, so it would otherwise reach every float operation of the calling process -- with
the ``sequential`` scheduler, the user's own (Python's float arithmetic included). Zoo warm starts
keep exact denormals (:func:`denormals_kept`), so their weights do not depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _settle_numpy_limits() -> None:
    """Compute numpy's float limits while denormals still exist: numpy works them out on first use
    and warns ("smallest subnormal ... is zero") when it does so with flushing on."""
    try:
        import numpy as np
    except ImportError:
        return
    for t in (np.float16, np.float32, np.float64, np.longdouble):
        np.finfo(t)


def flush_denormals(on: bool = True) -> bool:
    """Flush denormals to zero on this process's CPU threads (``on=False``: keep them). Returns
    whether the CPU supports it (x86 with SSE3; elsewhere nothing changes)."""
    if on:
        _settle_numpy_limits()
    return bool(torch.set_flush_denormal(on))


def flushing() -> bool:
    """Whether denormals are flushed now (a denormal survives a product or not)."""
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


@contextlib.contextmanager
def _denormals(flush: bool) -> Iterator[bool]:
    """Within the block, denormals are flushed (``flush``) or exact; the thread's setting before it
    is restored afterwards. Yields whether they are flushed."""
    was = flushing()
    if was != flush:
        flush_denormals(flush)
    try:
        yield flushing()
    finally:
        if was != flush:
            torch.set_flush_denormal(was)


def denormals_flushed() -> contextlib.AbstractContextManager[bool]:
    """Within the block, denormals are flushed to zero (where the CPU can); the setting before it is
    restored afterwards. Yields whether they are flushed."""
    return _denormals(True)


def denormals_kept() -> contextlib.AbstractContextManager[bool]:
    """Within the block, denormals are exact; the setting before it is restored afterwards."""
    return _denormals(False)
