"""RayScheduler on a two-node Ray cluster on this machine: policies land on different nodes."""

from __future__ import annotations

import json
import sqlite3

import pytest

ray = pytest.importorskip("ray")

from mutualrl.allocation.ray_scheduler import RayScheduler
from mutualrl.resolve import load_config
from mutualrl.trainer import MutualTrainer


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

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
