"""The one placement step (mutualrl.allocation.run_placement): the trainer's launch plans and places,
schedulers realise placed plans and decide nothing, a re-plan is a new placed plan realised in place."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

import mutualrl.allocation as allocation_pkg
from mutualrl.allocation.base import Scheduler, SequentialScheduler, Venue
from mutualrl.allocation.planner import Allocation, Placement, Resources
from mutualrl.allocation.run_placement import launch
from mutualrl.config.resolve import resolve


class _Recording(Scheduler):
    """A scheduler without workers that records what it is asked to realise."""

    name = "recording"

    def __init__(self, movable: bool, allocation: Allocation | None = None) -> None:
        self.movable = movable
        self.fixed_allocation = allocation
        self.exchange = "memory://placement-test"  # the caller's request, as RayScheduler(exchange=...)
        self.verbose = False
        self.started: list[Any] = []
        self.realised: list[Any] = []
        self.closed = 0

    def open(self, cfg, run_dir):
        return Venue("local", Resources(cpus=4), None, None, movable=self.movable)

    def start(self, plan, run_dir):
        assert plan.placed
        self.started.append(plan)
        return [{"params": 1000 * (i + 1)} for i in range(len(plan.config.policies))]

    def realise(self, plan):
        self.realised.append(plan)

    def cpu_seconds(self, index):
        return 0.5

    def _call(self, method, *args):
        return []

    def _call_one(self, index, method, *args):
        return None

    def close(self):
        self.closed += 1


def _alloc(cfg, threads: list[int], nice: list[int] | None = None) -> Allocation:
    nice = nice or [0] * len(threads)
    return Allocation([Placement(i, p.name, 0, float(t), t, nice=n) for i, (p, t, n) in
                       enumerate(zip(cfg.policies, threads, nice, strict=True))], Resources(cpus=4), "exclusive")


def test_launch_places_every_worker_before_the_scheduler_sees_it(tiny_config):
    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    sched = _Recording(movable=True, allocation=_alloc(plan.config, [3, 1]))
    placed = launch(sched, plan, None)
    (seen,) = sched.started
    assert seen is placed.plan and seen.placed and not plan.placed  # the input plan is not touched
    assert [(w.threads, w.exchange, w.device) for w in seen.workers] == [(3, "memory://placement-test", "cpu"),
                                                                        (1, "memory://placement-test", "cpu")]
    assert placed.mwra.costs.params == [1000, 2000]  # exact counts from the started workers
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.workers[0].threads = 2  # type: ignore[misc]


def test_a_replan_is_a_new_placed_plan_realised_by_the_scheduler(tiny_config, monkeypatch):
    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    sched = _Recording(movable=True)
    placed = launch(sched, plan, None)
    first = placed.plan
    monkeypatch.setattr(placed.mwra, "maybe_replan", lambda step: _alloc(plan.config, [1, 3], [5, 0]))
    new = placed.after_update(4)
    assert new is not None and sched.realised == [new] and placed.plan is new and new is not first
    assert [(w.threads, w.nice) for w in new.workers] == [(1, 5), (3, 0)]
    assert [w.exchange for w in new.workers] == [w.exchange for w in first.workers]


def test_no_replan_reaches_a_scheduler_that_cannot_move_workers(tiny_config, monkeypatch):
    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    sched = _Recording(movable=False)
    placed = launch(sched, plan, None)
    assert placed.mwra.fixed  # calibrates and reports only
    monkeypatch.setattr(placed.mwra, "maybe_replan", lambda step: _alloc(plan.config, [1, 3]))
    assert placed.after_update(4) is None and sched.realised == []


def test_a_failed_start_closes_the_scheduler(tiny_config):
    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)

    class Broken(_Recording):
        def start(self, plan, run_dir):
            raise RuntimeError("no workers today")

    sched = Broken(movable=True)
    with pytest.raises(RuntimeError, match="no workers today"):
        launch(sched, plan, None)
    assert sched.closed == 1


def test_schedulers_refuse_a_plan_nobody_placed(tiny_config):
    plan = resolve(tiny_config, check_paths=False)
    with pytest.raises(ValueError, match="placed plans only"):
        SequentialScheduler().start(plan, None)


def test_schedulers_decide_nothing():
    """The planner, the placement function and MWRA's adaptive plan are used by the placement step
    only: no scheduler module names them."""
    root = Path(allocation_pkg.__file__).parent
    for name in ("base.py", "local.py", "ray_scheduler.py"):
        text = (root / name).read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("#", '"', "`")))
        for banned in (r"\bplace\(", r"\bplan_for\b", r"\bAdaptivePlan\b", r"\bplan\(cfg", r"should_replan",
                       r"\bexchange_url\("):
            assert not re.search(banned, code), f"{name} decides placement ({banned})"


def test_workers_sharing_one_process_get_no_gpu_memory_share(tiny_config):
    """A memory fraction is per process: in the sequential backend the last worker's would cap them all."""
    from mutualrl.allocation.placement import place

    plan = resolve({**tiny_config, "device": "auto"}, check_paths=False)
    gpu = [Placement(i, p.name, 0, 1.0, 1, gpu=0, gpu_fraction=f) for i, (p, f) in
           enumerate(zip(plan.config.policies, (0.7, 0.3), strict=True))]
    alloc = Allocation(gpu, Resources(cpus=2), "gpu")
    seq = place(plan, alloc, "sequential", "memory://x")
    assert [(w.device, w.gpu_fraction) for w in seq.workers] == [("cuda:0", None), ("cuda:0", None)]
    loc = place(plan, alloc, "local", "memory://x")  # 0.9 of the GPU between them (headroom for contexts)
    assert [(w.visible_gpu, w.gpu_fraction) for w in loc.workers] == [(0, 0.63), (0, 0.27)]


def test_a_replan_never_moves_ranks_nodes_or_gpus(tiny_config, monkeypatch):
    """Running workers can change threads and priority only: a better plan that needs other ranks or
    another GPU is not adopted (and a scheduler refuses a placed plan that would move a worker)."""
    from mutualrl.allocation import adaptive

    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    sched = _Recording(movable=True, allocation=None)
    placed = launch(sched, plan, None)
    mwra = placed.mwra
    before = mwra.allocation
    moved = Allocation([dataclasses.replace(p, threads=p.threads + 1, ranks=2) for p in before.placements],
                       before.resources, before.mode)
    monkeypatch.setattr(adaptive, "should_replan", lambda *a, **k: moved)
    monkeypatch.setattr(type(mwra.costs), "measurements", property(lambda self: 99))
    assert mwra.maybe_replan(10) is None and mwra.allocation is before
    rethreaded = Allocation([dataclasses.replace(p, threads=p.threads + 1) for p in before.placements],
                            before.resources, before.mode)
    monkeypatch.setattr(adaptive, "should_replan", lambda *a, **k: rethreaded)
    assert mwra.maybe_replan(12) is rethreaded


def test_the_local_scheduler_refuses_a_replan_that_moves_a_worker(tiny_config):
    from mutualrl.allocation.local import LocalScheduler
    from mutualrl.allocation.placement import place

    plan = resolve({**tiny_config, "exchange": "memory://"}, check_paths=False)
    a = _alloc(plan.config, [1, 1])
    sched = LocalScheduler(verbose=False)
    sched.plan = place(plan, a, "local", "memory://x")
    elsewhere = place(plan, a, "local", "memory://y")
    with pytest.raises(ValueError, match="threads and nice levels only"):
        sched.realise(elsewhere)
