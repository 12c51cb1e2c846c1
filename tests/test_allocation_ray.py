"""RayScheduler on a local Ray cluster started by the test (no mocks)."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from mutualrl.allocation.ray_scheduler import RayScheduler
from mutualrl.config import load_config
from mutualrl.trainer import MutualTrainer


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_policy_run_on_ray_then_an_actor_dies(ray_session, tiny_config, tmp_path):
    cfg = load_config({**tiny_config, "steps": 3, "eval_every": 100, "eval_size": 8, "checkpoint_every": 2,
                       "scheduler": "ray", "sharing": {"strategy": "xgrpo"}, "step_timeout_s": 120.0},
                      check_paths=False)

    class KillAtStep2(RayScheduler):
        def call(self, method, *args):
            if method == "rollout" and args[0] == 2:
                ray.kill(self.actors[1])
            return super().call(method, *args)

    sched = KillAtStep2(verbose=False)
    trainer = MutualTrainer(cfg, tmp_path / "run", scheduler=sched, progress=False)
    with pytest.raises(RuntimeError) as exc:
        trainer.train()
    msg = str(exc.value)
    assert "'b'" in msg and "step_000002" in msg
    steps = [r for r in trainer.history if "step_s" in r]
    assert [(r["step"], r["policy"]) for r in steps] == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert any(r.get("xgrpo_pooled_prompts", 0) > 0 for r in steps)
    infos = json.loads((tmp_path / "run" / "policies.json").read_text())
    assert len({i["pid"] for i in infos}) == 2
    assert sched.exchange_url.startswith("sqlite:///")  # one node: the run's sqlite file
    assert ray.is_initialized()  # the scheduler did not stop a Ray it did not start
