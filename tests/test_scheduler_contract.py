"""One contract for every scheduler that runs workers out of process: a worker killed mid-run stops
the run with a WorkerFailed naming it and the last good checkpoint, after exactly the steps that
finished, with peers' rows having crossed the process boundary."""

from __future__ import annotations

import json
import os
import signal

import pytest

from mutualrl.allocation import WorkerFailed
from mutualrl.config.resolve import load_config
from mutualrl.run.trainer import MutualTrainer


def _local(request):
    from mutualrl.allocation.local import LocalScheduler

    class KillAtStep2(LocalScheduler):
        def _call(self, method, *args):
            if method == "rollout" and args[0] == 2:
                os.kill(self.pids()[1], signal.SIGKILL)
            return super()._call(method, *args)

    return KillAtStep2(verbose=False), lambda sched: sched.procs == []  # every worker process closed


def _ray(request):
    ray = request.getfixturevalue("shared_ray")()  # the session's Ray (conftest.py)
    from mutualrl.allocation.ray_scheduler import RayScheduler

    class KillAtStep2(RayScheduler):
        def _call(self, method, *args):
            if method == "rollout" and args[0] == 2:
                ray.kill(self.actors[1])
            return super()._call(method, *args)

    def extra(sched) -> bool:
        # one node: the run's sqlite file is the exchange; a Ray it did not start stays up
        return sched.exchange_url.startswith("sqlite:///") and ray.is_initialized()

    return KillAtStep2(verbose=False), extra


@pytest.mark.parametrize("make", [_local, _ray], ids=["local", "ray"])
def test_a_killed_worker_stops_the_run_cleanly(make, tiny_config, tmp_path, request):
    cfg = load_config({**tiny_config, "steps": 3, "eval_every": 100, "eval_size": 8, "checkpoint_every": 2,
                       "sharing": {"strategy": "xgrpo"}, "step_timeout_s": 120.0}, check_paths=False)
    sched, extra = make(request)
    trainer = MutualTrainer(cfg, tmp_path / "run", scheduler=sched, progress=False)
    with pytest.raises(WorkerFailed) as exc:
        trainer.train()
    err = exc.value
    assert err.worker == "b"
    assert err.checkpoint is not None and err.checkpoint.endswith("step_000002")
    assert f"--resume {tmp_path / 'run'}" in str(err)
    steps = [r for r in trainer.history if "step_s" in r]
    assert [(r["step"], r["policy"]) for r in steps] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert all(r["xgrpo_pooled_prompts"] > 0 for r in steps)  # peers' rows crossed the process boundary
    infos = json.loads((tmp_path / "run" / "policies.json").read_text())
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    assert extra(sched)
