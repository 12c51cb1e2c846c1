"""LocalScheduler with real worker processes: a 2-policy run, failures, async mode."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from mutualrl.allocation import WorkerFailed
from mutualrl.allocation.local import LocalScheduler
from mutualrl.allocation.run_placement import launch
from mutualrl.config.resolve import load_config, resolve
from mutualrl.run.trainer import MutualTrainer
from mutualrl.run.worker_api import remote_name


def _config(tiny_config: dict, **over) -> object:
    data = {**tiny_config, "steps": 2, "eval_every": 100, "eval_size": 8, "checkpoint_every": 100,
            "sharing": {"strategy": "xgrpo+sgt"}, "step_timeout_s": 120.0, **over}
    return load_config(data, check_paths=False)


def test_a_run_in_processes_can_calibrate_before_its_first_plan_and_writes_its_plans(tiny_config, tmp_path):
    """A two-policy run in two worker processes (the kill contract is tests/test_scheduler_contract.py)
    with ``calibrate=N`` (``mutualrl train --calibrate``): real steps of each policy are timed before the
    workers start and the first plan the workers get is made from them, not from the FLOP prior; the
    plans are written and the scheduler closes its workers."""
    cfg = _config(tiny_config, scheduler="local", steps=1)
    sched = LocalScheduler(verbose=False)
    MutualTrainer(cfg, tmp_path / "run", scheduler=sched, progress=False, calibrate=2).train()
    plans = json.loads((tmp_path / "run" / "allocation.json").read_text())["plans"]
    assert [p["reason"] for p in plans[:2]] == ["initial", "calibrated on 2 real step(s) before the start"]
    assert plans[0]["calibrated"] is False and plans[1]["calibrated"] is True
    assert all(p["threads"] >= 1 for plan in plans for p in plan["placements"])
    assert sched.procs == []  # closed


def test_killed_and_hung_workers_raise_worker_failed(tiny_config):
    sched = LocalScheduler(verbose=False)
    try:
        launch(sched, resolve(_config(tiny_config, step_timeout_s=3.0)), None)
        a, b = sched.pids()
        os.kill(a, signal.SIGSTOP)  # hangs: alive but never answers
        t0 = time.monotonic()
        sched.submit(0, "rollout", 0)  # the async API: same deadline
        with pytest.raises(WorkerFailed) as exc:
            sched.collect(60.0)
        assert exc.value.worker == "a" and "within 3s" in str(exc.value)
        assert 2.5 < time.monotonic() - t0 < 8
        os.kill(b, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed) as exc:
            sched.call_one(1, "rollout", 0)
        assert exc.value.worker == "b" and "signal 9" in str(exc.value)
        assert time.monotonic() - t0 < 3.5
    finally:
        sched.close()


def test_async_mode_bounded_staleness(tiny_config):
    """async: every step of every policy runs once; nobody gets more than k steps ahead.

    The loop only uses the scheduler's submit/collect, so it runs here in-process (the
    LocalScheduler's submit/collect are exercised above)."""
    from mutualrl.allocation import SequentialScheduler

    cfg = _config(tiny_config, steps=4, sync="async", eval_every=2,
                  sharing={"strategy": "xgrpo", "max_staleness": 1})
    trainer = MutualTrainer(cfg, None, scheduler=SequentialScheduler(), progress=False)
    trainer.train()
    rows = [r for r in trainer.history if "step_s" in r]
    assert sorted((r["step"], r["policy"]) for r in rows) == [(s, p) for s in range(4) for p in "ab"]
    assert all(0 <= r["ahead"] <= 1 for r in rows)
    evals = sorted({r["step"] for r in trainer.history if r.get("event") == "eval"})
    assert evals == [0, 2, 4]


class _FavourFirst:
    """A scheduler stand-in whose worker 0 always finishes first (worker 1 is 'slow')."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, str, int]] = []
        self.completed = [0, 0]
        self.max_lead = 0

    def submit(self, index, method, step):
        method = remote_name(method)
        self.pending.append((index, method, step))
        if method == "rollout":  # how far ahead of the slowest completed worker this start is
            self.max_lead = max(self.max_lead, step - min(self.completed))

    def collect(self, timeout):
        item = min(self.pending, key=lambda t: (t[0], t[2]))
        self.pending.remove(item)
        if item[1] == "update":
            self.completed[item[0]] += 1
        return item[0], {f"{item[1]}_s": 0.0}


@pytest.mark.parametrize("k", [0, 2])
def test_async_fast_worker_runs_at_most_k_steps_ahead(tiny_config, k):
    cfg = _config(tiny_config, steps=6, sync="async", eval_every=100, sharing={"max_staleness": k})
    trainer = MutualTrainer(cfg, None, scheduler=_FavourFirst(), progress=False)
    trainer._trackers = []
    logged = []
    trainer._log = logged.append  # the loop's output, without evaluation or files
    trainer.evaluate = lambda step: []

    class Bar:
        def advance(self, rows): pass

        def set_eval(self, rows): pass

    trainer._loop_async(Bar())
    assert trainer.scheduler.max_lead == k  # worker 0 got exactly k steps ahead, never more
    assert [[r["policy"] for r in rows] for rows in logged] == [["a", "b"]] * 6


def test_a_calibration_in_workers_times_the_run_as_placed(tiny_config, monkeypatch):
    """``calibrate_in_workers``: the run's own worker processes, every rank of every policy at once on a
    private exchange, timed through the same path as a running step: every policy is measured, the
    ranks' all-reduce is calibrated apart, and the planner's step for that placement is the measured one;
    the workers are gone afterwards."""
    from mutualrl.allocation.calibrate import calibrate_in_workers
    from mutualrl.allocation.cost import CostModel, estimate_parameters
    from mutualrl.allocation.planner import Resources, evaluate_allocation, plan

    cfg = _config(tiny_config, scheduler="local", sharing={"strategy": "imitate"},
                  policies=[{**tiny_config["policies"][0], "workers": 2}, tiny_config["policies"][1]],
                  # a dense reward (shorter is better), no filtering: every step trains, so the ranks all-reduce
                  task=dict(tiny_config["task"], reward_functions=["test_trainer:reward_brevity"]),
                  grpo=dict(tiny_config["grpo"], dynamic_sampling="off"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                    os.environ.get("PYTHONPATH")])))
    costs = CostModel(cfg, estimate_parameters(cfg), alpha=1.0)
    first = plan(cfg, Resources(2.0), costs)
    assert [p.ranks for p in first.placements] == [2, 1]
    got = calibrate_in_workers(cfg, costs, first, steps=2)
    assert costs.calibrated and [g["steps_kept"] for g in got] == [1, 1]
    assert got[0]["ranks"] == 2 and got[0]["allreduce_s"] > 0 and costs.to_dict()["policies"][0]["allreduce_measured"] == 1
    predicted = evaluate_allocation(first, costs)
    for p, g in zip(predicted.placements, got, strict=True):
        assert p.predicted_step_s == pytest.approx(g["step_s"], rel=1e-6)
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if children.is_file():  # Linux: no worker process of the calibration is left
        assert [int(c) for c in children.read_text().split() if Path(f"/proc/{c}/cmdline").is_file()
                and b"worker_main" in Path(f"/proc/{c}/cmdline").read_bytes()] == []
