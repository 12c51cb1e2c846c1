"""CPU shares: the cores each worker should get for balanced busy times, and the torch threads and
CPU priority (``nice``) that realise a fractional share on shared cores."""

from __future__ import annotations

import itertools
import math

NICE_STEP = 1.25
"""Linux CFS: each nice level changes a thread's weight by about 1.25x."""
MAX_NICE = 19


def balanced_shares(costs: list[float], cores: float, parallel_fraction: float) -> list[float]:
    """Core shares (summing to ``cores``) that equalise ``c_i * ((1-f) + f/s_i)``.

    Solved by bisection on the common time T: ``s_i(T) = f c_i / (T - (1-f) c_i)``.
    """
    f = min(max(parallel_fraction, 1e-6), 1.0)
    if len(costs) == 1:
        return [float(cores)]
    c = [max(x, 1e-12) for x in costs]
    if f >= 1.0:
        tot = sum(c)
        return [cores * x / tot for x in c]

    def total(t: float) -> float:
        return sum(f * x / (t - (1 - f) * x) for x in c)

    lo = max((1 - f) * x for x in c) * (1 + 1e-12)
    hi = max(lo * 2, max(c) * 2)
    while total(hi) > cores:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if total(mid) > cores:
            lo = mid
        else:
            hi = mid
    shares = [f * x / (hi - (1 - f) * x) for x in c]
    scale = cores / sum(shares)
    return [s * scale for s in shares]


def realised_shares(threads: list[int], nice: list[int], cores: float) -> list[float]:
    """Cores each worker actually gets when its threads compete under CFS weights (1.25x/nice)."""
    if sum(threads) <= cores + 1e-9:
        return [float(t) for t in threads]
    w = [NICE_STEP ** -n for n in nice]
    per_thread = [0.0] * len(threads)
    active = set(range(len(threads)))
    cap = float(cores)
    while active:
        unit = cap / sum(w[i] * threads[i] for i in active)
        full = [i for i in active if w[i] * unit >= 1.0]
        if not full:
            for i in active:
                per_thread[i] = w[i] * unit
            break
        for i in full:
            per_thread[i] = 1.0
            cap -= threads[i]
            active.discard(i)
    return [t * p for t, p in zip(threads, per_thread, strict=True)]


def shares_to_threads(shares: list[float], cores: float) -> tuple[list[int], list[int]]:
    """Integer torch threads (>= 1, at most ``ceil(cores)``) and nice levels for ``shares``.

    Candidate thread counts are the floor and ceiling of each share; nice levels make the
    per-thread CPU weights proportional to ``share / threads``. Returns the candidate whose
    realised shares (:func:`realised_shares`) come closest to the targets (smallest largest
    relative shortfall, oversubscription penalised by 5 %).
    """
    cap = max(1, math.ceil(cores - 1e-9))
    options = [sorted({min(cap, max(1, math.floor(s))), min(cap, max(1, math.ceil(s)))}) for s in shares]
    best: tuple[float, list[int], list[int]] | None = None
    for threads in itertools.product(*options):
        t = list(threads)
        weights = [s / n for s, n in zip(shares, t, strict=True)]
        top = max(weights)
        nice = [min(MAX_NICE, max(0, round(math.log(top / max(w, 1e-9)) / math.log(NICE_STEP)))) for w in weights]
        if sum(t) <= cores + 1e-9:
            nice = [0] * len(t)
        got = realised_shares(t, nice, cores)
        worst = max(s / max(g, 1e-9) for s, g in zip(shares, got, strict=True))
        if sum(t) > cores + 1e-9:
            worst *= 1.05
        if best is None or worst < best[0] - 1e-9:
            best = (worst, t, nice)
    assert best is not None
    return best[1], best[2]
