"""RayScheduler on a two-node Ray cluster on this machine: policies land on different nodes."""

from __future__ import annotations

import json
import sqlite3

import pytest

ray = pytest.importorskip("ray")

from mutualrl.allocation.ray_scheduler import RayScheduler
from mutualrl.config.resolve import load_config
from mutualrl.run.tracking import is_measurement
from mutualrl.run.trainer import MutualTrainer


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the session's shared Ray (conftest.py): this module runs a cluster of its own
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"mrl_head": 1},
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"mrl_second": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_policies_on_different_nodes_share_through_ray_exchange(two_nodes, tiny_config, tmp_path):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    cfg = load_config({**tiny_config, "steps": 2, "eval_every": 100, "eval_size": 8, "checkpoint_every": 100,
                       "scheduler": "ray", "sharing": {"strategy": "xgrpo+sgt"}, "step_timeout_s": 120.0},
                      check_paths=False)
    sched = RayScheduler(verbose=False)
    trainer = MutualTrainer(cfg, tmp_path / "run", scheduler=sched, progress=False)
    trainer.train()
    infos = json.loads((tmp_path / "run" / "policies.json").read_text())
    nodes = [i["node_id"] for i in infos]
    assert nodes[0] != nodes[1]
    assert sched.exchange_url.startswith("ray://")  # multi-node: the exchange is a Ray actor ...
    steps = [r for r in trainer.history if "step_s" in r]
    assert any(r.get("xgrpo_pooled_prompts", 0) > 0 for r in steps)
    with sqlite3.connect(tmp_path / "run" / "exchange.db") as db:  # ... backed by the run's sqlite file
        tables = [t for (t,) in db.execute("select name from sqlite_master where type='table'")]
        assert tables


class _LoseNodeAt:
    """A RayScheduler that removes the cluster's second node (its raylet and every process on it)
    when the run reaches ``step``'s rollout."""

    def __init__(self, cluster, step: int) -> None:
        self.cluster, self.step = cluster, step

    def make(self) -> RayScheduler:
        outer = self

        class Losing(RayScheduler):
            def _call(self, method, *args):
                if method == "rollout" and args and args[0] == outer.step:
                    second = [n for n in outer.cluster.list_all_nodes() if n is not outer.cluster.head_node]
                    outer.lost = second[0].node_id
                    outer.on_lost_node = [self.names[i] for i, n in enumerate(self.node_ids) if n == outer.lost]
                    outer.cluster.remove_node(second[0])
                return super()._call(method, *args)

        return Losing(verbose=False)


def _exchange_rows(run_dir):
    with sqlite3.connect(run_dir / "exchange.db") as db:
        return sorted(db.execute("select record_id, prompt_id, version, source_policy from experience"))


def test_a_lost_node_stops_the_run_and_resume_on_a_restored_cluster_is_exact(two_nodes, tiny_config, tmp_path):
    """The second node dies in the middle of a run: the run stops within step_timeout_s with a
    WorkerFailed naming the policy and its node; nothing the exchange acknowledged is lost or stored
    twice; --resume on a cluster with the node back continues to the metrics of an uninterrupted run."""
    from mutualrl.allocation import WorkerFailed

    cfg = load_config({**tiny_config, "steps": 4, "eval_every": 2, "eval_size": 8, "checkpoint_every": 2,
                       "scheduler": "ray", "sharing": {"strategy": "imitate"}, "step_timeout_s": 60.0},
                      check_paths=False)
    whole = MutualTrainer(cfg, tmp_path / "whole", scheduler=RayScheduler(verbose=False), progress=False)
    whole.train()

    run = tmp_path / "lost"
    lose = _LoseNodeAt(two_nodes, step=3)
    losing = lose.make()
    import time as _time

    t0 = _time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        MutualTrainer(cfg, run, scheduler=losing, progress=False).train()
    assert _time.monotonic() - t0 < 4 * cfg.step_timeout_s
    msg = str(info.value)
    assert lose.on_lost_node == [info.value.worker]  # the policy that lived on the lost node is named ...
    assert f"on node {lose.lost}" in msg and "dead" in msg and "--resume" in msg  # ... with its node
    assert info.value.checkpoint is not None and info.value.checkpoint.endswith("step_000002")
    # the exchange kept what it acknowledged: no record twice, every record of steps 0-2 there
    rows = _exchange_rows(run)
    assert len(rows) == len({r[0] for r in rows})

    two_nodes.add_node(num_cpus=1, resources={"mrl_second": 1})  # the node comes back
    two_nodes.wait_for_nodes()
    resumed = MutualTrainer(cfg, run, resume=True, scheduler=RayScheduler(verbose=False), progress=False)
    resumed.train()

    def view(history):  # keyed rows: the policies of a step may finish in either order
        return {(r["step"], r["policy"], r.get("event", "train")): {k: v for k, v in r.items() if not is_measurement(k)}
                for r in history}

    assert view(resumed.history) == view(whole.history)
    assert _exchange_rows(run) == _exchange_rows(tmp_path / "whole")
