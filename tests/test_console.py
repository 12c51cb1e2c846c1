"""A quiet console: MWRA's plan is printed as a table once; a re-plan prints one line of what changed
(the whole table again only under ``verbose``); the next run of a session (``mutualrl demo``'s arms)
prints its plan in one line too."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from mutualrl.allocation.adaptive import AdaptivePlan
from mutualrl.allocation.base import Scheduler, Venue
from mutualrl.allocation.planner import Allocation, Placement, Resources
from mutualrl.allocation.run_placement import PlanConsole, launch, plan_changes
from mutualrl.config.resolve import resolve
from mutualrl.run.trainer import MutualTrainer

TABLE = "MWRA plan: "
"""The first line of :meth:`Allocation.describe` (the table's title)."""
REPLAN = re.compile(r"^MWRA re-plan after step (\d+): (.+); predicted step \S+s, imbalance \S+$")


class _NoWorkers(Scheduler):
    """A movable scheduler without worker processes: every call returns plain metric rows."""

    name = "no-workers"

    def __init__(self) -> None:
        self.exchange = "memory://console-test"
        self.realised: list[Any] = []

    def open(self, cfg, run_dir):
        self.k = len(cfg.policies)
        return Venue("local", Resources(cpus=4), None, None, movable=True)

    def start(self, plan, run_dir):
        return [{"params": 1000} for _ in range(self.k)]

    def realise(self, plan):
        self.realised.append(plan)

    def _call(self, method, *args):
        row = {"evaluate": {"test_acc": 0.5}, "rollout": {"reward_mean": 0.5}}.get(method, {})
        return [dict(row) for _ in range(self.k)]

    def _call_one(self, index, method, *args):
        return 0

    def close(self):
        pass


def _rethreaded(alloc: Allocation, index: int, threads: int) -> Allocation:
    """``alloc`` with policy ``index`` on ``threads`` threads (and as many cores)."""
    out = [dataclasses.replace(p, threads=threads, cpu_share=float(threads)) if p.index == index else p
           for p in alloc.placements]
    return Allocation(out, alloc.resources, alloc.mode, True)


def _replan_after(steps: dict[int, tuple[int, int]]):
    """A stand-in for MWRA's re-plan decision: after step ``s`` in ``steps`` move policy ``i`` to ``t``
    threads (``steps[s] = (i, t)``), as a calibrated imbalance would."""

    def maybe_replan(self: AdaptivePlan, step: int | None) -> Allocation | None:
        if step not in steps:
            return None
        self.allocation = _rethreaded(self.allocation, *steps[step])
        return self.allocation

    return maybe_replan


def _tables(text: str) -> int:
    return sum(line.startswith(TABLE) for line in text.splitlines())


@pytest.mark.parametrize("verbose", [False, True])
def test_a_run_prints_the_table_once_and_a_line_per_replan(tiny_config, monkeypatch, capsys, verbose):
    monkeypatch.setattr(AdaptivePlan, "maybe_replan", _replan_after({1: (0, 5), 3: (1, 6), 4: (0, 1)}))
    cfg = {**tiny_config, "steps": 6, "eval_every": 100, "checkpoint_every": 100, "scheduler": "local"}
    sched = _NoWorkers()
    trainer = MutualTrainer(cfg, None, scheduler=sched, progress=False, verbose=verbose)
    trainer.train()
    assert len(sched.realised) == 3  # the three re-plans happened and were realised
    a0, b0 = trainer.placement.mwra.history[0]["placements"]  # the first plan
    err = capsys.readouterr().err
    assert [m.groups() for m in map(REPLAN.match, err.splitlines()) if m] == [
        ("1", f"a: threads {a0['threads']}->5, share {a0['cpu_share']:.2f}->5.00"),
        ("3", f"b: threads {b0['threads']}->6, share {b0['cpu_share']:.2f}->6.00"),
        ("4", "a: threads 5->1, share 5.00->1.00")]
    assert _tables(err) == (4 if verbose else 1)  # the first plan's table; again at each re-plan under verbose


def test_replan_lines_say_what_changed():
    before = Allocation([Placement(0, "a", 0, 0.4, 1), Placement(1, "b", 0, 1.6, 1, nice=5)], Resources(2.0),
                        "shared")
    after = Allocation([Placement(0, "a", 0, 0.55, 2), Placement(1, "b", 0, 1.6, 1, nice=5)], Resources(2.0),
                       "shared")
    assert plan_changes(before, after) == "a: threads 1->2, share 0.40->0.55"
    assert plan_changes(before, before) == ""
    console = PlanConsole()
    assert console.first(before).startswith(TABLE)
    line = console.replan(7, before, after)
    assert "\n" not in line and REPLAN.match(line).groups() == ("7", "a: threads 1->2, share 0.40->0.55")
    loud = PlanConsole(verbose=True).replan(7, before, after).splitlines()
    assert REPLAN.match(loud[0]) and loud[1].startswith(TABLE)


def test_the_next_run_of_a_session_prints_its_plan_in_one_line(tiny_config, capsys):
    """``mutualrl demo`` runs its arms with one console: the table of the first arm's plan only."""
    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    console = PlanConsole()
    for _ in range(3):
        launch(_NoWorkers(), plan, None, console).close()
    err = capsys.readouterr().err
    assert _tables(err) == 1
    assert err.count("MWRA plan (against the last one shown): the same threads and shares;") == 2
    for _ in range(2):  # verbose: every run's table
        launch(_NoWorkers(), plan, None, PlanConsole(verbose=True)).close()
    assert _tables(capsys.readouterr().err) == 2
