"""The allocation a scheduler keeps for a run: initial plan, online calibration, re-planning."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mutualrl.allocation.calibrate import calibrate, calibrate_in_workers
from mutualrl.allocation.cost import CostModel, estimate_parameters
from mutualrl.allocation.planner import Allocation, Placement, Resources, plan, should_replan
from mutualrl.config import RunConfig


class AdaptivePlan:
    """Plans a run's workers, folds their step metrics into the cost model and re-plans.

    Args:
        cfg: the run config.
        resources: what may be handed out.
        threads: a fixed thread count per worker (user's choice: never re-planned).
        allocation: a fixed allocation to use instead of planning (never re-planned).
        replan_threshold: re-plan when the calibrated max/min busy time exceeds this.
        calibrate_steps: measured steps before the first re-plan check.
        verbose: print plans to stderr.
        params: each policy's parameter count when known (default: estimated from the configs, which
            sizes every model on the meta device).
        settings: each policy's sharing steps' settings as the run plan resolved them
            (:attr:`~mutualrl.config.resolve.WorkerSpec.sharing`; default: resolved from ``cfg``).
    """

    def __init__(self, cfg: RunConfig, resources: Resources, *, threads: int | None = None,
                 allocation: Allocation | None = None, replan_threshold: float = 1.25,
                 calibrate_steps: int = 2, verbose: bool = True, params: list[int | None] | None = None,
                 settings: Sequence[Mapping[str, Any]] = ()) -> None:
        self.cfg = cfg
        self.resources = resources
        self.costs = CostModel(cfg, list(params) if params is not None else estimate_parameters(cfg),
                               settings=list(settings))
        self.replan_threshold = replan_threshold
        self.calibrate_steps = calibrate_steps
        self.verbose = verbose
        self.fixed = allocation is not None or threads is not None
        if allocation is not None:
            self.allocation = allocation
        else:
            self.allocation = plan(cfg, resources, self.costs)
            if threads is not None:
                self.allocation = _with_threads(self.allocation, threads)
        self.history: list[dict[str, Any]] = [{"step": None, "reason": "initial", **self.allocation.to_dict()}]
        self._rollouts: dict[int, Any] = {}
        self._served: dict[int, Any] = {}
        self._last_replan_step = -10**9

    def calibrate_first(self, steps: int, *, in_workers: bool = True) -> None:
        """Before the run's workers start: time ``steps`` real steps and plan again from the
        measurements, so that the first plan is not the FLOP prior's. ``in_workers``: the whole run as
        the prior plan places it, in worker processes of this machine
        (:func:`~mutualrl.allocation.calibrate.calibrate_in_workers`); otherwise each policy alone in
        this process as one of its ranks would run (:func:`~mutualrl.allocation.calibrate.calibrate`:
        Ray). A fixed allocation or user-fixed threads are kept as they are."""
        if self.fixed or steps < 1:
            return
        if self.resources.gpus:  # the GPU planners still price from the FLOP prior's per-device speed
            self.say("--calibrate: skipped on GPUs (the GPU split is planned from the FLOP prior; it re-plans "
                     "threads only once steps are measured)")
            return
        first = self.allocation
        if in_workers:
            calibrate_in_workers(self.cfg, self.costs, first, steps=steps, say=self.say)
        else:
            calibrate(self.cfg, self.costs, steps=steps, threads=[p.threads for p in first.placements],
                      ranks=[p.ranks for p in first.placements], say=self.say)
        self.allocation = plan(self.cfg, self.resources, self.costs)
        self._last_replan_step = 0  # no re-plan on the workers' cold first steps: measure them first
        self.history.append({"step": None, "reason": f"calibrated on {steps} real step(s) before the start",
                             "time": time.time(), **self.allocation.to_dict()})

    def set_params(self, params: list[int]) -> None:
        """Exact parameter counts from the started workers."""
        self.costs.params = list(params)

    def observe(self, index: int, method: str, result: Any, cpu_s: float | None = None) -> None:
        """Fold one worker's ``rollout``/``update`` metrics (and the call's CPU time) into the calibration."""
        if not isinstance(result, dict):
            return
        if method == "rollout":
            self._rollouts[index] = (result, cpu_s)
        elif method == "serve":  # the scoring phase is priced with the update (a forward on the same worker)
            self._served[index] = (result, cpu_s)
        elif method == "update":
            roll, roll_cpu = self._rollouts.pop(index, (None, None))
            served, serve_cpu = self._served.pop(index, (None, None))
            if served:
                result = {**result, "scored_tokens": served.get("scored_tokens", 0.0),
                          **{k: result[k] + served.get("serve_s", 0.0) for k in ("update_s", "train_s") if k in result}}
                cpu_s = cpu_s + serve_cpu if cpu_s is not None and serve_cpu is not None else cpu_s
            pl = self.allocation.placements[index]
            w = max(1, pl.ranks)  # merged ranks: counts and CPU summed, wall times the slowest rank's
            self.costs.observe(index, roll, result, pl.cpu_share / w, rollout_cpu_s=roll_cpu, update_cpu_s=cpu_s,
                               rank_times=w)

    def maybe_replan(self, step: int | None) -> Allocation | None:
        """A better allocation when calibration shows imbalance above the threshold, else ``None``
        (recorded in the history, not printed)."""
        if self.fixed or self.costs.measurements < self.calibrate_steps:
            return None
        if step is not None and step - self._last_replan_step < self.calibrate_steps:
            return None
        new = should_replan(self.allocation, self.costs, self.resources, self.replan_threshold)
        if new is None or [_movable(p) for p in new.placements] == [_movable(p) for p in self.allocation.placements]:
            return None
        if [_fixed(p) for p in new.placements] != [_fixed(p) for p in self.allocation.placements]:
            return None  # running workers keep their ranks, node and GPU: only threads and priority move
        self._last_replan_step = step if step is not None else 0
        self.allocation = new
        self.history.append({"step": step, "reason": "calibrated imbalance", "time": time.time(), **new.to_dict()})
        return new  # the caller reports it (run_placement.PlanConsole: one line, the table under --verbose)

    def say(self, text: str) -> None:
        if self.verbose:
            print(text, file=sys.stderr, flush=True)

    def write(self, run_dir: Path | None) -> None:
        """Write ``allocation.json`` (every plan of the run and the cost model) into ``run_dir``."""
        if run_dir is None:
            return
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "allocation.json").write_text(
                json.dumps({"plans": self.history, "costs": self.costs.to_dict()}, indent=1))
        except OSError:  # informational only
            pass


def _movable(p: Placement) -> tuple[int, int]:
    """What a re-plan may change on running workers: threads and CPU priority."""
    return p.threads, p.nice


def _fixed(p: Placement) -> tuple[int, str | None, int | None, float]:
    """What running workers keep: their ranks, node, GPU and GPU share."""
    return p.ranks, p.node, p.gpu, round(p.gpu_fraction, 6)


def _with_threads(alloc: Allocation, threads: int) -> Allocation:
    out = [Placement(**{**p.__dict__, "threads": threads, "nice": 0}) for p in alloc.placements]
    return Allocation(out, alloc.resources, "fixed", alloc.calibrated)
