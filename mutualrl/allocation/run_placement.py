"""The one placement step of a run, and its re-plans: MWRA decides, the scheduler realises.

:func:`launch` opens the scheduler (which says what can be placed on: a :class:`~mutualrl.allocation.base.Venue`),
plans the workers (:class:`~mutualrl.allocation.adaptive.AdaptivePlan`, or the scheduler's fixed
allocation), places the plan (:func:`~mutualrl.allocation.placement.place`: every worker's device,
threads, GPU share, exchange URL and rendezvous) and starts the workers of that placed plan. During
the run the trainer folds each policy's step metrics into the calibration (:meth:`RunPlacement.observe`)
and, after each update, asks for a re-plan (:meth:`RunPlacement.after_update`): a better allocation is
placed again by the same function and handed to the scheduler to realise. The placed plan is immutable;
a re-plan is a new one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mutualrl.allocation.adaptive import AdaptivePlan
from mutualrl.allocation.base import Scheduler, Venue
from mutualrl.allocation.placement import exchange_url, place
from mutualrl.allocation.planner import Allocation, Placement, plan_for
from mutualrl.config.resolve import RunPlan


class PlanConsole:
    """What the console says about MWRA plans: the first plan it reports as the whole table, then each
    later one (a re-plan, or the first plan of the next run in one session: ``mutualrl demo``'s arms) as
    one line of what changed, so the plans do not drown the progress bar. ``verbose``: the whole table
    every time (the one-line change first, for a re-plan).

    Every plan of a run is written to ``allocation.json`` in full either way."""

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.shown: Allocation | None = None
        """The last plan reported (None before the first)."""

    def first(self, allocation: Allocation) -> str:
        """The text for a run's first plan."""
        last, self.shown = self.shown, allocation
        if self.verbose or last is None or not _comparable(last, allocation):
            return allocation.describe()
        changes = plan_changes(last, allocation) or "the same threads and shares"
        return f"MWRA plan (against the last one shown): {changes}; {_prediction(allocation)}"

    def replan(self, step: int | None, old: Allocation, new: Allocation) -> str:
        """The text for a re-plan after ``step`` from ``old`` to ``new``."""
        self.shown = new
        changes = plan_changes(old, new) or "the same threads and shares"
        line = f"MWRA re-plan after step {step}: {changes}; {_prediction(new)}"
        return f"{line}\n{new.describe()}" if self.verbose else line


def plan_changes(old: Allocation, new: Allocation) -> str:
    """What differs per policy between two plans of the same policies, as text
    (``b: threads 1->2, share 0.40->0.55``; policies separated by ``; ``), or ``""`` when nothing shown
    differs."""
    out = []
    for a, b in zip(old.placements, new.placements, strict=True):
        diffs = [f"{label} {x}->{y}" for label, x, y in zip(_LABELS, _shown(a), _shown(b), strict=True) if x != y]
        if diffs:
            out.append(f"{b.name}: {', '.join(diffs)}")
    return "; ".join(out)


_LABELS = ("ranks", "threads", "share", "nice", "gpu", "gpu share")


def _shown(p: Placement) -> tuple[str, ...]:
    """A placement's fields :func:`plan_changes` compares, as printed (``_LABELS``' order)."""
    return (str(p.ranks), str(p.threads), f"{p.cpu_share:.2f}", str(p.nice), "-" if p.gpu is None else str(p.gpu),
            f"{p.gpu_fraction:.2f}")


def _comparable(a: Allocation, b: Allocation) -> bool:
    """Plans of the same policies on the same resources (one line can say how they differ)."""
    return [p.name for p in a.placements] == [p.name for p in b.placements] and a.resources == b.resources


def _prediction(a: Allocation) -> str:
    return f"predicted step {a.predicted_step_s:.3g}s, imbalance {a.predicted_imbalance:.2f}"


class RunPlacement:
    """A run's placed plan, the MWRA state it came from and the scheduler realising it.

    Attributes:
        plan: the placed :class:`~mutualrl.config.resolve.RunPlan` in force.
        mwra: the allocation, its calibration and its history (``allocation.json``).
        venue: what the scheduler offered.
        infos: each started worker's ``info()``.
    """

    def __init__(self, scheduler: Scheduler, plan: RunPlan, venue: Venue, mwra: AdaptivePlan,
                 run_dir: Path | None, console: PlanConsole | None = None) -> None:
        self.scheduler = scheduler
        self.venue = venue
        self.mwra = mwra
        self.run_dir = run_dir
        self.console = console or PlanConsole()
        """What the console says about the plans (MWRA prints nothing when not ``verbose``)."""
        self.threads = scheduler.threads or plan.config.threads
        nodes = len(venue.resources.nodes) or 1
        self.exchange = scheduler.exchange or exchange_url(
            venue.backend, plan.config, run_dir.resolve() if run_dir is not None else None, venue.scratch, nodes=nodes)
        """The exchange URL every worker opens (the scheduler's request, else the run's)."""
        self.plan = self._place(plan, mwra.allocation)
        self.infos: list[dict[str, Any]] = []

    @property
    def allocation(self) -> Allocation:
        """The allocation in force."""
        return self.mwra.allocation

    def _place(self, plan: RunPlan, allocation: Allocation, memory_of: RunPlan | None = None) -> RunPlan:
        v = self.venue
        return place(plan, allocation, v.backend, self.exchange, threads=self.threads, rendezvous=v.rendezvous,
                     memory_of=memory_of)

    def start(self) -> list[dict[str, Any]]:
        """Start the workers of the placed plan; record their parameter counts and the plan."""
        self.infos = self.scheduler.start(self.plan, self.run_dir)
        self.mwra.set_params([int(info.get("params") or 0) or None for info in self.infos])  # type: ignore[misc]
        self._write()
        return self.infos

    def observe(self, index: int, method: str, result: Any) -> None:
        """Fold policy ``index``'s ``rollout``/``update`` result (and its measured CPU time) into MWRA."""
        if method in ("rollout", "serve", "update"):
            self.mwra.observe(index, method, result, self.scheduler.cpu_seconds(index))

    def after_update(self, step: int | None) -> RunPlan | None:
        """Re-plan when the calibration shows imbalance and the scheduler can move workers: the newly
        placed plan (already realised), else None."""
        if not self.venue.movable:
            return None
        old = self.mwra.allocation
        new = self.mwra.maybe_replan(step)
        if new is None:
            return None
        if self.mwra.verbose:
            self.mwra.say(self.console.replan(step, old, new))
        placed = self._place(self.plan.unplaced(), new, memory_of=self.plan)  # memory as first placed
        self.scheduler.realise(placed)
        self.plan = placed
        self._write()
        return placed

    def close(self) -> None:
        """Write the plan history one last time."""
        self._write()

    def _write(self) -> None:
        if self.venue.backend != "sequential":  # one process: no allocation to report
            self.mwra.write(self.run_dir)


def launch(scheduler: Scheduler, plan: RunPlan, run_dir: str | Path | None,
           console: PlanConsole | None = None) -> RunPlacement:
    """The placement step: open ``scheduler``, plan and place ``plan`` on what it offers (with the
    scheduler's requests: ``threads``, ``fixed_allocation``, ``exchange``, ``replan_threshold``,
    ``verbose``), then start the workers. A failure closes the scheduler and re-raises. ``console``:
    how plans are reported (default: a new :class:`PlanConsole`, the table once, re-plans in a line)."""
    console = console or PlanConsole()
    rd = Path(run_dir) if run_dir is not None else None
    cfg = plan.config
    try:
        venue = scheduler.open(cfg, rd)
        allocation = scheduler.fixed_allocation
        one_process = venue.backend == "sequential"
        if allocation is None and one_process:  # nothing to balance: equal shares, no pricing
            allocation = plan_for(cfg, venue.resources)
        mwra = AdaptivePlan(cfg, venue.resources, threads=scheduler.threads or cfg.threads, allocation=allocation,
                            replan_threshold=scheduler.replan_threshold, verbose=scheduler.verbose and not one_process,
                            params=[None] * len(cfg.policies) if one_process else None,
                            settings=[plan.spec(i).sharing for i in range(len(cfg.policies))])
        if scheduler.calibrate_steps and (one_process or mwra.fixed):
            print("--calibrate: nothing to plan (" + ("one process" if one_process else "threads or allocation "
                  "fixed by the user") + "); not calibrated", file=sys.stderr, flush=True)
        elif not one_process:  # the first plan from measured steps, when asked (Ray's bundles never move after)
            mwra.calibrate_first(scheduler.calibrate_steps, in_workers=venue.backend == "local")
        mwra.fixed = mwra.fixed or not venue.movable
        if mwra.verbose:  # quiet in one process (not verbose there)
            mwra.say(console.first(mwra.allocation))
        placed = RunPlacement(scheduler, plan.unplaced(), venue, mwra, rd, console)
        placed.start()
    except BaseException:
        scheduler.close()
        raise
    return placed
