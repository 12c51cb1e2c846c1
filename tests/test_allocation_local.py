"""LocalScheduler with real worker processes: a 2-policy run, failures, async mode."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from mutualrl.allocation import WorkerFailed
from mutualrl.allocation.local import LocalScheduler
from mutualrl.config import load_config
from mutualrl.trainer import MutualTrainer


def _config(tiny_config: dict, **over) -> object:
    data = {**tiny_config, "steps": 2, "eval_every": 100, "eval_size": 8, "checkpoint_every": 100,
            "sharing": {"strategy": "xgrpo+sgt"}, "step_timeout_s": 120.0, **over}
    return load_config(data, check_paths=False)


def test_two_policy_run_in_processes_then_a_worker_dies(tiny_config, tmp_path):
    """Two steps run in two worker processes; killing one at step 2 stops the run with a clear
    message naming the worker and the last good checkpoint (no hang)."""
    cfg = _config(tiny_config, scheduler="local", steps=3, checkpoint_every=2)

    class KillAtStep2(LocalScheduler):
        def call(self, method, *args):
            if method == "rollout" and args[0] == 2:
                os.kill(self.pids()[0], signal.SIGKILL)
            return super().call(method, *args)

    sched = KillAtStep2(verbose=False)
    trainer = MutualTrainer(cfg, tmp_path / "run", scheduler=sched, progress=False)
    with pytest.raises(RuntimeError) as exc:
        trainer.train()
    msg = str(exc.value)
    assert "'a'" in msg and "signal 9" in msg and "step_000002" in msg and "--resume" in msg
    infos = json.loads((tmp_path / "run" / "policies.json").read_text())
    pids = {i["pid"] for i in infos}
    assert len(pids) == 2 and os.getpid() not in pids  # one OS process per policy
    steps = [r for r in trainer.history if "step_s" in r]
    assert [(r["step"], r["policy"]) for r in steps] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    # peers' rows crossed the process boundary through the shared sqlite exchange
    assert any(r.get("xgrpo_pooled_prompts", 0) > 0 for r in steps)
    plan = json.loads((tmp_path / "run" / "allocation.json").read_text())
    assert plan["plans"][0]["placements"][0]["threads"] >= 1
    assert sched.procs == []  # closed


def test_killed_and_hung_workers_raise_worker_failed(tiny_config):
    sched = LocalScheduler(verbose=False)
    try:
        sched.start(_config(tiny_config, step_timeout_s=3.0), None)
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
    from mutualrl.allocation.async_loop import run_async

    cfg = _config(tiny_config, steps=6, sync="async", eval_every=100, sharing={"max_staleness": k})

    class Trainer:
        scheduler, start_step, run_dir, history = _FavourFirst(), 0, None, []

        def __init__(self):
            self.cfg = cfg
            self.logged = []

        def _log(self, rows):
            self.logged.append(rows)

        def evaluate(self, step):
            return []

    class Bar:
        def advance(self, rows): pass

        def set_eval(self, rows): pass

    t = Trainer()
    run_async(t, Bar())
    assert t.scheduler.max_lead == k  # worker 0 got exactly k steps ahead, never more
    assert [[r["policy"] for r in rows] for rows in t.logged] == [["a", "b"]] * 6
