"""A short measured calibration before the first plan: each policy's real step, timed.

The cost model's prior (seconds per FLOP of a core, one number for every model) is far off for
small models, whose steps are dominated by per-operation overhead (the K-sweep's first plan
predicted 6.1 s for a 0.25 s step). :func:`calibrate` builds each policy's worker in this process,
alone, with the threads it is given, and runs ``steps`` of its real steps (the run's prompts,
groups, strategy and update; no peer rows arrive, so a sharing step trains on the learner's own
rows only); the last one's wall and CPU times are folded into the cost model as a measured step
is during a run. The first plan is then made from measured costs (``mutualrl plan --calibrate``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from mutualrl.allocation.cost import CostModel
from mutualrl.config import RunConfig
from mutualrl.resolve import plan_of
from mutualrl.worker import PolicyWorker


def calibrate(cfg: RunConfig, costs: CostModel, *, steps: int = 2, threads: int | Sequence[int] = 1,
              say: Callable[[str], None] | None = None) -> list[dict[str, float]]:
    """Time ``steps`` real steps of every policy alone on its ``threads`` torch threads (one number for
    all, or one per policy: what the plan gives it; one worker each, ranks aside) and fold the last
    step's measurements into ``costs``; per policy, what was measured."""
    single = dataclasses.replace(cfg, policies=[dataclasses.replace(p, workers=1) for p in cfg.policies],
                                 scheduler="sequential")
    plan = plan_of(single)
    per = [threads] * len(cfg.policies) if isinstance(threads, int) else list(threads)
    before = torch.get_num_threads()
    out = []
    try:
        for i, pol in enumerate(cfg.policies):
            torch.set_num_threads(max(1, per[i]))
            worker = PolicyWorker(plan, i, None)
            try:
                for step in range(steps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    roll = worker.rollout(step)
                    c1, t1 = time.process_time(), time.perf_counter()
                    upd = worker.update(step)
                    c2, t2 = time.process_time(), time.perf_counter()
                roll = {**roll, "rollout_s": t1 - t0}
                upd = {**upd, "update_s": t2 - t1}
                costs.observe(i, roll, upd, float(per[i]), rollout_cpu_s=c1 - c0, update_cpu_s=c2 - c1)
                out.append({"policy": pol.name, "step_s": t2 - t0, "rollout_s": t1 - t0, "update_s": t2 - t1,
                            "threads": per[i], "steps": steps})
                if say:
                    say(f"calibrated {pol.name}: step {t2 - t0:.3g}s (rollout {t1 - t0:.3g}s, update {t2 - t1:.3g}s) "
                        f"on {per[i]} thread(s)")
            finally:
                worker.close()
    finally:
        torch.set_num_threads(before)
    return out
