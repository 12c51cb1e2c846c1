"""A short measured calibration before the first plan: each policy's real step, timed.

The cost model's prior (seconds per FLOP of a core, one number for every model) is far off for
small models, whose steps are dominated by per-operation overhead (the K-sweep's first plan
predicted 6.1 s for a 0.25 s step).

:func:`calibrate_in_workers` (what the local scheduler's runs and ``mutualrl plan --calibrate``
use) times the run as a plan places it: every rank of every policy at once, each in its own worker
process with the run's environment (threads, OpenMP wait policy, CPU priority, the ranks'
all-reduce), on a private exchange, through the same measurements a running step gives MWRA. What
one process alone cannot see is then measured too: ranks and policies contending for memory
bandwidth and cache, and the cost of idle OpenMP threads sleeping between operations.

:func:`calibrate` (Ray, where a calibration in the cluster's actors is not built) builds each policy's worker in this process,
alone, with the threads it is given, and runs ``steps`` of its real steps (the run's prompts, or a
rank's share of them, groups, strategy and update; no peer rows arrive, so a sharing step trains on
the learner's own rows only); the mean wall and CPU times of the steps after the first are folded
into the cost model as a measured step is during a run. The first plan is then made from measured
costs (``mutualrl plan --calibrate``).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mutualrl.allocation.cost import CostModel
from mutualrl.allocation.local import LocalScheduler
from mutualrl.allocation.placement import exchange_url, place
from mutualrl.allocation.planner import Allocation
from mutualrl.config import RunConfig
from mutualrl.config.resolve import plan_of
from mutualrl.run.worker import PolicyWorker
from mutualrl.run.worker_api import WorkerAPI


def calibrate_in_workers(cfg: RunConfig, costs: CostModel, allocation: Allocation, *, steps: int = 3,
                         say: Callable[[str], None] | None = None) -> list[dict[str, float]]:
    """Run ``steps`` real steps of the whole run as ``allocation`` places it on this machine's worker
    processes and fold what they measured into ``costs``, exactly as a running step's metrics are
    (per policy: its ranks' merged reply and CPU time); per policy, what was measured.

    Every policy's ranks step at once, as in the run, so the measurement carries their contention.
    The workers open a private exchange in a scratch directory (never the run's: their rows would
    look like the run's own) and their own rendezvous; they are stopped before this returns. The
    first step is a warm-up when there is more than one; the others' mean is folded in. Every call
    has the run's deadline (``step_timeout_s``): a worker that dies or hangs raises
    :class:`~mutualrl.allocation.base.WorkerFailed` naming it."""
    trial = dataclasses.replace(cfg, exchange="sqlite", steps=max(1, steps), report_to=())
    sched = LocalScheduler(allocation=allocation, verbose=False)
    timed: list[list[tuple[dict[str, Any], dict[str, Any], float, float]]] = [[] for _ in cfg.policies]
    try:
        venue = sched.open(trial, None)
        placed = place(plan_of(trial), allocation, "local", exchange_url("local", trial, None, venue.scratch),
                       threads=cfg.threads, rendezvous=venue.rendezvous)
        sched.start(placed, None)
        for step in range(steps):
            rolls = sched.call(WorkerAPI.rollout, step)
            roll_cpu = [sched.cpu_seconds(i) or 0.0 for i in range(len(cfg.policies))]
            upds = sched.call(WorkerAPI.update, step)
            for i, (r, u) in enumerate(zip(rolls, upds, strict=True)):
                timed[i].append((r, u, roll_cpu[i], sched.cpu_seconds(i) or 0.0))
    finally:
        sched.close()
    out = []
    for i, pol in enumerate(cfg.policies):
        pl = allocation.placements[i]
        w = max(1, pl.ranks)
        kept = timed[i][1:] if len(timed[i]) > 1 else timed[i]
        roll, upd, cpu_r, cpu_u = _mean_step(kept)
        costs.observe(i, roll, upd, pl.cpu_share / w, rollout_cpu_s=cpu_r or None, update_cpu_s=cpu_u or None,
                      rank_times=w)
        step_s = roll["rollout_s"] + upd["update_s"]
        out.append({"policy": pol.name, "step_s": step_s, "rollout_s": roll["rollout_s"], "update_s": upd["update_s"],
                    "allreduce_s": upd.get("allreduce_s_min", 0.0), "threads": pl.threads, "ranks": w,
                    "prompts": cfg.prompts_per_step, "steps": steps, "steps_kept": len(kept)})
        if say:
            say(f"calibrated {pol.name}: step {step_s:.3g}s (rollout {roll['rollout_s']:.3g}s, update "
                f"{upd['update_s']:.3g}s) on {w} rank(s) x {pl.threads} thread(s), all policies at once")
    return out


def calibrate(cfg: RunConfig, costs: CostModel, *, steps: int = 3, threads: int | Sequence[int] = 1,
              ranks: int | Sequence[int] = 1, say: Callable[[str], None] | None = None) -> list[dict[str, float]]:
    """Time ``steps`` real steps of every policy alone on its ``threads`` torch threads (one number for
    all, or one per policy: what the plan gives each rank) and fold what they measured into ``costs``;
    per policy, what was measured.

    A policy the plan puts on ``ranks`` data-parallel workers is timed as one of its ranks runs: on
    ``1/ranks`` of the step's prompts (at least one), since a small model's step does not shrink in
    proportion to its batch (per-token overheads stay). The first step is a warm-up when there is
    more than one; the others' mean is folded in."""
    per = [threads] * len(cfg.policies) if isinstance(threads, int) else list(threads)
    shards = [ranks] * len(cfg.policies) if isinstance(ranks, int) else [max(1, int(r)) for r in ranks]
    before = torch.get_num_threads()
    out = []
    try:
        for i, pol in enumerate(cfg.policies):
            torch.set_num_threads(max(1, per[i]))
            prompts = max(1, math.ceil(cfg.prompts_per_step / shards[i]))
            if pol.fsdp and shards[i] > 1:  # its whole training state on one device may not fit: not timed
                if say:
                    say(f"calibration: {pol.name} is sharded (fsdp) and left to the prior")
                continue
            # one worker in this process, on a private exchange (never the run's: its rows would look
            # like the run's own), on a rank's share of the prompts
            single = dataclasses.replace(cfg, policies=[dataclasses.replace(p, workers=1, fsdp=False)
                                                        for p in cfg.policies],
                                         scheduler="sequential", prompts_per_step=prompts, exchange="sqlite")
            worker = PolicyWorker(plan_of(single), i, None)
            try:
                timed = [_timed_step(worker, step) for step in range(steps)]
            finally:
                worker.close()
                del worker
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            kept = timed[1:] if len(timed) > 1 else timed
            roll, upd, cpu_r, cpu_u = _mean_step(kept)
            costs.observe(i, roll, upd, float(per[i]), rollout_cpu_s=cpu_r, update_cpu_s=cpu_u, shard=shards[i])
            step_s = roll["rollout_s"] + upd["update_s"]
            out.append({"policy": pol.name, "step_s": step_s, "rollout_s": roll["rollout_s"],
                        "update_s": upd["update_s"], "threads": per[i], "ranks": shards[i], "prompts": prompts,
                        "steps": steps, "steps_kept": len(kept)})
            if say:
                say(f"calibrated {pol.name}: step {step_s:.3g}s (rollout {roll['rollout_s']:.3g}s, update "
                    f"{upd['update_s']:.3g}s) on {per[i]} thread(s), {prompts} prompt(s) a step"
                    + (f" (one of {shards[i]} ranks)" if shards[i] > 1 else ""))
    finally:
        torch.set_num_threads(before)
    return out


def _timed_step(worker: PolicyWorker, step: int) -> tuple[dict[str, Any], dict[str, Any], float, float]:
    """One real step: (rollout metrics, update metrics, rollout CPU seconds, update CPU seconds), with
    the wall seconds of each phase as measured here."""
    c0, t0 = time.process_time(), time.perf_counter()
    roll = worker.rollout(step)
    c1, t1 = time.process_time(), time.perf_counter()
    upd = worker.update(step)
    c2, t2 = time.process_time(), time.perf_counter()
    return {**roll, "rollout_s": t1 - t0}, {**upd, "update_s": t2 - t1}, c1 - c0, c2 - c1


def _mean_step(steps: Sequence[tuple[dict[str, Any], dict[str, Any], float, float]]
               ) -> tuple[dict[str, Any], dict[str, Any], float, float]:
    """The mean of timed steps' numbers (what the cost model reads), as one step."""
    def mean(key: str, part: int) -> float:
        vals = [float(s[part].get(key) or 0.0) for s in steps]
        return statistics.fmean(vals)

    roll = {k: mean(k, 0) for k in ("rollout_s", "generate_s", "gen_tokens")}
    upd = {k: mean(k, 1) for k in ("update_s", "train_s", "train_tokens", "prp_peer_samples", "allreduce_s",
                                   "allreduce_s_min")}
    return roll, upd, statistics.fmean(s[2] for s in steps), statistics.fmean(s[3] for s in steps)
