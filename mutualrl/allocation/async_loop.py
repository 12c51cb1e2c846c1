"""The ``sync: async`` step loop: bounded staleness instead of a barrier per phase.

Each worker runs its own sequence rollout(s) → update(s) → rollout(s+1) … and may start step
``s`` while the slowest worker has completed ``lo`` steps only if ``s - lo <= k``
(``k = sharing.max_staleness``). Peers' rows older than ``k`` versions are ignored by the workers
themselves (their query uses ``min_version = step - max_staleness`` and ``version <= step``).
Evaluation and checkpoint steps are barriers: nobody starts such a step before everyone has
reached it, so checkpoints stay exact. Metrics are logged per step once every policy finished it.
"""

from __future__ import annotations

import time
from typing import Any


def run_async(trainer: Any, bar: Any) -> None:
    """Run ``trainer``'s remaining steps in async mode (``trainer`` is a MutualTrainer)."""
    cfg = trainer.cfg
    sch = trainer.scheduler
    names = [p.name for p in cfg.policies]
    k_pol = len(names)
    stale = cfg.sharing.max_staleness
    steps = cfg.steps
    done = [trainer.start_step] * k_pol
    phase: list[str | None] = [None] * k_pol
    started = [0.0] * k_pol
    roll_res: dict[int, tuple[dict[str, Any], float]] = {}
    finished: dict[int, dict[int, dict[str, Any]]] = {}
    settled = trainer.start_step

    def barrier(s: int) -> bool:
        return s % cfg.eval_every == 0 or s % cfg.checkpoint_every == 0

    if settled < steps and settled % cfg.eval_every == 0:
        bar.set_eval(trainer.evaluate(settled))
    while True:
        lo = min(done)
        for i in range(k_pol):
            s = done[i]
            if phase[i] is not None or s >= steps or s - lo > stale or (s > lo and barrier(s)):
                continue
            started[i] = time.perf_counter()
            phase[i] = "rollout"
            sch.submit(i, "rollout", s)
        if not any(phase):
            break
        i, res = sch.collect(cfg.step_timeout_s)
        s = done[i]
        now = time.perf_counter()
        if phase[i] == "rollout":
            roll_res[i] = (res, now - started[i])
            phase[i] = "update"
            sch.submit(i, "update", s)
            continue
        roll, roll_s = roll_res.pop(i)
        finished.setdefault(s, {})[i] = {"step": s, "policy": names[i], **roll, **res, "step_rollout_s": roll_s,
                                         "step_update_s": now - started[i] - roll_s, "step_s": now - started[i],
                                         "ahead": s - min(done)}
        phase[i] = None
        done[i] += 1
        while settled < min(done):
            rows = [finished[settled][j] for j in range(k_pol)]
            del finished[settled]
            trainer._log(rows)
            bar.advance(rows)
            settled += 1
            if trainer.run_dir is not None and (settled % cfg.checkpoint_every == 0 or settled == steps):
                trainer.save_checkpoint(settled)
            if settled < steps and settled % cfg.eval_every == 0:
                bar.set_eval(trainer.evaluate(settled))
    if trainer.start_step < steps or not any(r.get("event") == "eval" and r["step"] == steps
                                             for r in trainer.history):
        bar.set_eval(trainer.evaluate(steps))
