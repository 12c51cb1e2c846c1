"""A policy on several data-parallel ranks (``policies[i].workers``): the update of 2 gloo ranks equals
the single worker's on the same global batch, a run with a 2-rank policy trains, checkpoints and
resumes exactly, and a lost rank stops the run naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mutualrl.allocation.ranks import merge_metrics
from mutualrl.distributed import Rendezvous, serve_store
from mutualrl.errors import ConfigError
from mutualrl.resolve import load_config

HERE = Path(__file__).resolve().parent


def _ranks(model: Path, strategy: str, world: int, out: Path, loss: str) -> list[dict]:
    store = serve_store("127.0.0.1", 60) if world > 1 else None
    rv = f"tcp://127.0.0.1:{store.port}/p" if store is not None else "-"
    env = dict(os.environ, OMP_NUM_THREADS="1", DP_LOSS=loss, PYTHONPATH=str(HERE.parent))
    procs = [subprocess.Popen([sys.executable, str(HERE / "_dp_rank.py"), str(model), strategy, str(r), str(world), rv,
                               str(out / f"{world}-{r}.pt")], env=env) for r in range(world)]
    assert [p.wait(timeout=120) for p in procs] == [0] * world
    return [torch.load(out / f"{world}-{r}.pt") for r in range(world)]


@pytest.mark.parametrize(("strategy", "loss"), [("independent", "dr_grpo"), ("independent", "grpo"),
                                                ("imitate", "dapo")])
def test_two_gloo_ranks_take_the_single_worker_update(tiny_models, tmp_path, strategy, loss):
    """Each rank trains on half the prompts (its own rows and the strategy's added rows) with the
    counts summed and the gradients all-reduced; after two updates of two PPO iterations each (and
    imitate's own supervised phase) both ranks hold the weights one worker gets on the whole batch."""
    one = _ranks(tiny_models["tiny-gpt2"], strategy, 1, tmp_path, loss)[0]
    two = _ranks(tiny_models["tiny-gpt2"], strategy, 2, tmp_path, loss)
    start = _ranks(tiny_models["tiny-gpt2"], strategy, 1, tmp_path, loss)[0]  # determinism of the reference
    assert torch.equal(start["params"], one["params"])
    for r in two:
        assert r["optimizer_steps"] == one["optimizer_steps"]
        assert float((r["params"] - one["params"]).abs().max()) <= 1e-5
    assert torch.equal(two[0]["params"], two[1]["params"])  # the ranks never drift apart


def test_rendezvous_parses_and_refuses():
    rv = Rendezvous.parse("tcp://10.0.0.2:29500/policy-a")
    assert (rv.host, rv.port, rv.prefix) == ("10.0.0.2", 29500, "policy-a")
    assert str(rv) == "tcp://10.0.0.2:29500/policy-a"
    for bad in ("10.0.0.2:29500/a", "tcp://host/a", "tcp://host:29500/", "tcp://:1/a"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT/PREFIX"):
            Rendezvous.parse(bad)


def test_rank_metrics_merge_by_meaning():
    parts = [{"loss": 0.5, "train_tokens": 10, "update_s": 1.0, "clip_frac": 0.2, "grad_norm": 3.0,
              "optimizer_steps": 2, "logprob_mismatch_max": 0.1, "resample_rounds": 1},
             {"loss": 0.25, "train_tokens": 7, "update_s": 2.0, "clip_frac": 0.4, "grad_norm": 3.0,
              "optimizer_steps": 2, "logprob_mismatch_max": 0.3, "resample_rounds": 1}]
    m = merge_metrics(parts)
    assert m == {"loss": 0.75, "train_tokens": 17, "update_s": 2.0, "clip_frac": pytest.approx(0.3), "grad_norm": 3.0,
                 "optimizer_steps": 2, "logprob_mismatch_max": 0.3, "resample_rounds": 1}


def test_workers_need_processes_and_an_even_share(tiny_config):
    cfg = dict(tiny_config)
    cfg["policies"] = [dict(cfg["policies"][0], workers=2), cfg["policies"][1]]
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers.*scheduler: local"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers.*divide evenly"):
        load_config(dict(cfg, scheduler="local", prompts_per_step=3))
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers"):
        load_config(dict(cfg, scheduler="local", policies=[dict(cfg["policies"][0], workers=0), cfg["policies"][1]]))
    plan_cfg = load_config(dict(cfg, scheduler="local"))
    assert plan_cfg.policies[0].workers == 2


def _metrics(run_dir: Path) -> list[dict]:
    """The run's logged rows without machine measurements (times, memory) and resume events."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "_mb", "_per_s")) and k not in ("time", "timestamp")}
            for r in rows if r.get("event") in (None, "eval")]


@pytest.mark.parametrize("scheduler", ["local", "ray"])
def test_a_two_rank_policy_trains_checkpoints_and_resumes_exactly(tiny_config, tmp_path, scheduler):
    """Policy ``a`` on 2 ranks beside ``b`` on one, sharing (imitate): a run cut after step 2 and
    resumed logs the metrics of the uninterrupted run (machine measurements aside)."""
    if scheduler == "ray":
        pytest.importorskip("ray")
    from _stop import _Stop, _StopAfterStep2

    from mutualrl.trainer import MutualTrainer

    cfg = dict(tiny_config, scheduler=scheduler, steps=4, checkpoint_every=2, eval_every=2, threads=1,
               sharing={"strategy": "imitate"})
    cfg["policies"] = [dict(cfg["policies"][0], workers=2), cfg["policies"][1]]
    full = tmp_path / "full"
    MutualTrainer(cfg, full, progress=False).train()
    cut = tmp_path / "cut"
    with pytest.raises(_Stop):
        _StopAfterStep2(cfg, cut, progress=False).train()
    MutualTrainer(cfg, cut, resume=True, progress=False).train()
    a, b = _metrics(full), _metrics(cut)
    assert [r["step"] for r in a if r.get("event") is None] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert any(r.get("event") == "eval" for r in a)
    assert a == b
    info = json.loads((full / "policies.json").read_text())
    assert [i.get("ranks", 1) for i in info] == [2, 1] and len(set(info[0]["rank_pids"])) == 2


def _exchange_rows(run_dir: Path) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(run_dir / "exchange.db") as db:
        return sorted(db.execute("SELECT kind, prompt_id, source_policy, version FROM experience").fetchall())


def test_a_killed_rank_stops_the_run_naming_it_and_resume_is_exact(tiny_config, tmp_path):
    """Rank 1 of policy ``a`` is killed as step 2 starts: the run stops naming the policy and the rank
    and its last good checkpoint; resumed, it logs what an uninterrupted run logs and its exchange holds
    every row of that run once (none lost, none twice)."""
    import signal

    from mutualrl.allocation import WorkerFailed
    from mutualrl.allocation.local import LocalScheduler
    from mutualrl.trainer import MutualTrainer

    class KillRankAtStep2(LocalScheduler):
        def _call(self, method, *args):
            if method == "rollout" and args[0] == 2:
                os.kill(self.rank_pids(0)[1], signal.SIGKILL)
            return super()._call(method, *args)

    cfg = dict(tiny_config, scheduler="local", steps=4, checkpoint_every=2, eval_every=100, eval_size=8, threads=1,
               sharing={"strategy": "imitate"}, step_timeout_s=120.0)
    cfg["policies"] = [dict(cfg["policies"][0], workers=2), cfg["policies"][1]]
    full = tmp_path / "full"
    MutualTrainer(cfg, full, progress=False).train()
    cut = tmp_path / "cut"
    with pytest.raises(WorkerFailed) as exc:
        MutualTrainer(cfg, cut, scheduler=KillRankAtStep2(verbose=False), progress=False).train()
    assert exc.value.worker == "a rank 1"
    assert exc.value.checkpoint is not None and exc.value.checkpoint.endswith("step_000002")
    assert "killed by signal 9" in str(exc.value)
    MutualTrainer(cfg, cut, resume=True, progress=False).train()
    assert _metrics(cut) == _metrics(full)
    rows = _exchange_rows(cut)
    assert rows == _exchange_rows(full)  # the same rows, each as often as in the uninterrupted run
