"""A policy on several data-parallel ranks (``policies[i].workers``): the update of 2 gloo ranks equals
the single worker's on the same global batch, a run with a 2-rank policy trains, checkpoints and
resumes exactly, and a lost rank stops the run naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mutualrl.allocation.ranks import merge_metrics
from mutualrl.config.resolve import load_config
from mutualrl.errors import ConfigError
from mutualrl.run.distributed import Rendezvous, serve_store

HERE = Path(__file__).resolve().parent


GLOO_CASES = {  # test id: (strategy, loss, micro-batch tokens of the ranks)
    "independent-grpo-": ("independent", "grpo", ""), "independent-dr_grpo-": ("independent", "dr_grpo", ""),
    "imitate-dapo-": ("imitate", "dapo", ""), "imitate-grpo-12": ("imitate", "grpo", "12")}
FSDP_CASES = {  # test id: (strategy, tests/_dp_rank.py's options)
    "independent-options0": ("independent", {}),
    "imitate-options1": ("imitate", {"DP_LORA": "1", "DP_CHECKPOINTING": "1", "DP_BETA": "0.05", "DP_RESUME": "1"}),
    "imitate-options2": ("imitate", {"DP_BETA": "0.05", "DP_IDLE_RANK1": "1"}),
    "imitate-options3": ("imitate", {"DP_BETA": "0.05", "DP_MICRO": "12"})}
UPDATE_TESTS = {"test_two_gloo_ranks_take_the_single_worker_update": "gloo",
                "test_fsdp_ranks_take_the_single_worker_update": "fsdp"}


def _case_list(selected: set[str]) -> list[dict]:
    """The updates of the selected tests (``gloo-ID``/``fsdp-ID``), as tests/_dp_rank.py's ``--cases``."""
    cases = [{"name": f"gloo-{i}", "strategy": st, "env": {"DP_LOSS": loss, "DP_MICRO": micro}}
             for i, (st, loss, micro) in GLOO_CASES.items()]
    cases += [{"name": f"fsdp-{i}", "strategy": st, "env": {"DP_LOSS": "grpo", **opts, "DP_FSDP": "1"}}
              for i, (st, opts) in FSDP_CASES.items()]
    return [c for c in cases if c["name"] in selected]


@pytest.fixture(scope="module")
def rank_updates(tiny_models, tmp_path_factory, request):
    """The single worker's reference and 2 gloo ranks of every selected update test below, three
    processes at once (they share nothing but the files they write), each running the cases one after
    the other: the processes start once for the module, not once a test. ``rank_updates(name)`` is the
    reference's result and the ranks' for the case ``name``."""
    wanted = {f"{UPDATE_TESTS[it.originalname]}-{it.callspec.id}" for it in request.session.items
              if getattr(it, "originalname", None) in UPDATE_TESTS}
    cases = _case_list(wanted)
    out = tmp_path_factory.mktemp("dp_ranks")
    store = serve_store("127.0.0.1", 60)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DP_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    model = str(tiny_models["tiny-gpt2"])

    def launch(rank: int, world: int, where: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(HERE / "_dp_rank.py"), "--cases", model, str(rank), str(world),
                                 where, str(out), json.dumps(cases)], env=env)

    # the reference takes every case on one worker (DP_FSDP and DP_MICRO act on ranks only)
    procs = [launch(0, 1, "-")] + [launch(r, 2, f"127.0.0.1:{store.port}") for r in range(2)]
    try:
        codes = [p.wait(timeout=120 + 60 * len(cases)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    def result(name: str) -> tuple[dict, list[dict]]:
        files = [out / name / f for f in ("1-0.pt", "2-0.pt", "2-1.pt")]
        errors = "".join(e.read_text() for e in (f.with_suffix(".err") for f in files) if e.is_file())
        failed = sorted({e.parent.name for e in out.glob("*/*.err")})  # a process stops at its first failure
        assert all(f.is_file() for f in files), f"{name}: no result (exit codes {codes}, failed: {failed})\n{errors}"
        assert codes == [0, 0, 0] or failed, f"exit codes {codes}, yet no case failed"
        one, *two = (torch.load(f) for f in files)
        return one, two

    yield result
    del store


@pytest.mark.parametrize(("strategy", "loss", "micro"), list(GLOO_CASES.values()), ids=list(GLOO_CASES))
def test_two_gloo_ranks_take_the_single_worker_update(rank_updates, request, strategy, loss, micro):
    """Each rank trains on its share of the prompts (3 and 2: uneven, and imitate's rows all on rank 0,
    so rank 1 joins that phase with a zero gradient) with the counts summed and the gradients
    all-reduced. After two updates of two PPO iterations each (and imitate's own supervised phase):
    the ranks' losses add up to the single worker's (each is its rows' share: local denominators
    would break this), the gradient norm after the all-reduce is the single worker's (averaging
    instead of summing would halve it), and both ranks hold the single worker's weights. With
    ``micro``, the ranks accumulate over micro-batches of at most 12 forward tokens (every group cut
    into pieces, a different count on each rank) while the reference runs each phase at once."""
    one, two = rank_updates(f"gloo-{request.node.callspec.id}")
    if micro:  # the ranks really cut their rows, each its own number of pieces; the reference did not
        assert one["stats"]["micro_batches"] == 1
        assert all(r["stats"]["micro_batches"] > 1 for r in two)
        assert two[0]["stats"]["micro_batches"] != two[1]["stats"]["micro_batches"]
    losses = [k for k in one["stats"] if k.endswith("loss")]
    assert ("imitate_loss" in losses) == (strategy == "imitate")
    for k in losses:
        assert sum(r["stats"][k] for r in two) == pytest.approx(one["stats"][k], rel=1e-5, abs=1e-7), k
    for k in (k for k in one["stats"] if k.endswith(("grad_norm", "optimizer_steps"))):
        for r in two:
            assert r["stats"][k] == pytest.approx(one["stats"][k], rel=1e-5), k
    for r in two:
        assert float((r["params"] - one["params"]).abs().max()) <= 1e-5
    assert torch.equal(two[0]["params"], two[1]["params"])  # the ranks never drift apart


@pytest.mark.parametrize(("strategy", "options"), list(FSDP_CASES.values()), ids=list(FSDP_CASES))
def test_fsdp_ranks_take_the_single_worker_update(rank_updates, request, strategy, options):
    """FSDP2 over 2 gloo ranks (weights, gradients and AdamW moments sharded; gradients reduce-scattered
    as a sum): the same update as one worker on the whole batch, rank 1 joining imitate's phase with a
    dummy row; with LoRA, gradient checkpointing and a KL term, and through a checkpoint written by the
    gathered state dicts and read back into fresh shards between the two updates; and in full
    fine-tuning with a sharded KL reference while rank 1 holds no row at all (dummy rows in every
    phase and in the reference forward); and with micro-batches of at most 12 forward tokens on the
    ranks (rank 0 has more than rank 1, which runs dummy micro-batches to keep FSDP's collectives in
    step) against the reference's one forward per phase."""
    one, two = rank_updates(f"fsdp-{request.node.callspec.id}")
    if options.get("DP_MICRO"):  # several micro-batches, as many on each rank (the lighter one runs dummies)
        assert one["stats"]["micro_batches"] == 1
        assert two[0]["stats"]["micro_batches"] == two[1]["stats"]["micro_batches"] > 1
    for k in (k for k in one["stats"] if k.endswith("loss")):
        assert sum(r["stats"].get(k, 0.0) for r in two) == pytest.approx(one["stats"][k], rel=1e-5, abs=1e-7), k
    for k in (k for k in one["stats"] if k.endswith(("grad_norm", "optimizer_steps"))):
        for r in two:
            assert r["stats"][k] == pytest.approx(one["stats"][k], rel=1e-5), k
    for r in two:
        assert float((r["params"] - one["params"]).abs().max()) <= 1e-5
    assert torch.equal(two[0]["params"], two[1]["params"])


def test_fsdp_needs_ranks(tiny_config):
    cfg = dict(tiny_config, scheduler="local")
    cfg["policies"] = [dict(cfg["policies"][0], fsdp=True), cfg["policies"][1]]
    with pytest.raises(ConfigError, match=r"policies\[0\]\.fsdp.*workers to 2"):
        load_config(cfg)
    cfg["policies"][0]["workers"] = 2
    assert load_config(cfg).policies[0].fsdp


def test_rendezvous_parses_and_refuses():
    rv = Rendezvous.parse("tcp://10.0.0.2:29500/policy-a")
    assert (rv.host, rv.port, rv.prefix) == ("10.0.0.2", 29500, "policy-a")
    assert str(rv) == "tcp://10.0.0.2:29500/policy-a"
    for bad in ("10.0.0.2:29500/a", "tcp://host/a", "tcp://host:29500/", "tcp://:1/a"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT/PREFIX"):
            Rendezvous.parse(bad)


def test_rank_metrics_merge_by_meaning():
    parts = [{"loss": 0.5, "train_tokens": 10, "update_s": 1.0, "clip_frac": 0.2, "grad_norm": 3.0,
              "optimizer_steps": 2, "logprob_mismatch_max": 0.1, "resample_rounds": 1, "worker_processes": 1},
             {"loss": 0.25, "train_tokens": 7, "update_s": 2.0, "clip_frac": 0.4, "grad_norm": 3.0,
              "optimizer_steps": 2, "logprob_mismatch_max": 0.3, "resample_rounds": 1, "worker_processes": 1}]
    m = merge_metrics(parts)
    assert m == {"loss": 0.75, "train_tokens": 17, "update_s": 2.0, "clip_frac": pytest.approx(0.3), "grad_norm": 3.0,
                 "optimizer_steps": 2, "logprob_mismatch_max": 0.3, "resample_rounds": 1, "worker_processes": 2}


def test_workers_need_processes_and_an_even_share(tiny_config):
    cfg = dict(tiny_config)
    cfg["policies"] = [dict(cfg["policies"][0], workers=2), cfg["policies"][1]]
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers.*scheduler: local"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers.*a prompt at least"):
        load_config(dict(cfg, scheduler="local", prompts_per_step=1))
    with pytest.raises(ConfigError, match=r"policies\[0\]\.workers"):
        load_config(dict(cfg, scheduler="local", policies=[dict(cfg["policies"][0], workers=0), cfg["policies"][1]]))
    plan_cfg = load_config(dict(cfg, scheduler="local"))
    assert plan_cfg.policies[0].workers == 2


def _metrics(run_dir: Path) -> list[dict]:
    """The run's logged rows without machine measurements (times, memory) and resume events."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(("_s", "_mb", "_per_s")) and k not in ("time", "timestamp")}
            for r in rows if r.get("event") in (None, "eval")]


def _two_rank_config(tiny_config: dict, scheduler: str) -> dict:
    cfg = dict(tiny_config, scheduler=scheduler, steps=4, checkpoint_every=2, eval_every=2, eval_size=8, threads=1,
               sharing={"strategy": "imitate"}, step_timeout_s=120.0)
    cfg["policies"] = [dict(cfg["policies"][0], workers=2), cfg["policies"][1]]
    return cfg


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted 4-step run with ``a`` on 2 ranks, per scheduler (made once, compared by two tests)."""
    from mutualrl.run.trainer import MutualTrainer

    tiny = {"policies": [{"name": "a", "model": str(tiny_models["tiny-gpt2"])},
                         {"name": "b", "model": str(tiny_models["tiny-llama"])}],
            "task": {"preset": "zoo", "test_size": 40}, "grpo": {"num_generations": 4, "max_completion_length": 6},
            "prompts_per_step": 4}
    out = {}

    def run(scheduler: str) -> Path:
        if scheduler not in out:
            d = tmp_path_factory.mktemp(f"dp_{scheduler}") / "full"
            MutualTrainer(_two_rank_config(tiny, scheduler), d, progress=False).train()
            out[scheduler] = d
        return out[scheduler]

    run.tiny = tiny  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def test_the_async_loop_with_a_two_rank_policy_logs_the_sync_loops_metrics(uninterrupted, tmp_path):
    """``sync: async`` with ``a`` on 2 ranks: a sharing update waits for every peer's rollouts of its
    step, so bounded staleness changes when steps run, not what they compute: the same metrics as
    the synchronous run (machine measurements and the ``ahead`` lead aside)."""
    from mutualrl.run.trainer import MutualTrainer

    cfg = dict(_two_rank_config(uninterrupted.tiny, "local"), sync="async")
    cfg["sharing"] = dict(cfg["sharing"], max_staleness=1)
    MutualTrainer(cfg, tmp_path / "async", progress=False).train()
    drop = lambda rows: [{k: v for k, v in r.items() if k != "ahead"} for r in rows]
    a, b = drop(_metrics(uninterrupted("local"))), drop(_metrics(tmp_path / "async"))
    assert [r["step"] for r in b if r.get("event") is None] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert a == b
    # every step says how many processes hold the policy (what a study prices its memory by) and the
    # resident part of MWRA's predicted peak
    steps = [r for r in b if r.get("event") is None]
    assert {r["policy"]: r["worker_processes"] for r in steps} == {"a": 2, "b": 1}
    raw = [json.loads(x) for x in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    raw = [r for r in raw if r.get("event") is None]
    assert len(raw) == 8 and all(0 < r["mem_predicted_resident_mb"] < r["mem_predicted_peak_mb"] for r in raw)


def _exchange_rows(run_dir: Path) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(run_dir / "exchange.db") as db:
        return sorted(db.execute("SELECT kind, prompt_id, source_policy, version FROM experience").fetchall())


def test_a_hung_rank_is_named_within_the_step_timeout(tiny_config, tmp_path, monkeypatch):
    """Rank 1 of ``a`` stops answering inside its update: after ``step_timeout_s`` the run stops naming
    rank 1 (the one behind in the collectives), not rank 0 that waits for it."""
    from mutualrl.allocation import WorkerFailed
    from mutualrl.run.trainer import MutualTrainer

    monkeypatch.setenv("MUTUALRL_FAULT_POINT", "update:1")
    monkeypatch.setenv("MUTUALRL_FAULT_WORKER", "a rank 1")
    monkeypatch.setenv("MUTUALRL_FAULT_ACTION", "hang")
    cfg = dict(_two_rank_config(tiny_config, "local"), steps=2, eval_every=100, step_timeout_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailed) as exc:
        MutualTrainer(cfg, tmp_path / "run", progress=False).train()
    assert exc.value.worker == "a rank 1", str(exc.value)
    assert "step_timeout_s" in str(exc.value) or "fell behind" in str(exc.value)
    assert time.monotonic() - t0 < 8.0 + 60.0  # the timeout, plus starting the workers


def test_a_rank_actor_killed_under_ray_is_named_and_the_resume_under_ray_is_exact(uninterrupted, shared_ray, tmp_path,
                                                                                   monkeypatch):
    """Policy ``a`` on 2 Ray actors beside ``b`` on one, sharing (imitate). Rank 1 of ``a`` dies inside
    its update of step 2 while rank 0 waits in the collective: the run stops naming rank 1 and the
    last good checkpoint. A resume that would change ``a``'s workers is refused (it would not continue
    the ranks' sampling); resumed under Ray, the run logs the metrics of the uninterrupted run under
    the local scheduler (machine measurements aside) and its exchange holds that run's rows, each once:
    the same ranks, the same steps, whichever scheduler runs them."""
    ray = pytest.importorskip("ray")
    from mutualrl.allocation import WorkerFailed
    from mutualrl.run.trainer import MutualTrainer

    if ray.is_initialized():
        ray.shutdown()  # the actors of the run to kill start with the fault in their environment: a Ray of its own
    monkeypatch.setenv("MUTUALRL_FAULT_POINT", "update:3")
    monkeypatch.setenv("MUTUALRL_FAULT_WORKER", "a rank 1")
    cfg = dict(_two_rank_config(uninterrupted.tiny, "ray"), step_timeout_s=60.0)
    cut = tmp_path / "cut"
    with pytest.raises(WorkerFailed) as exc:
        MutualTrainer(cfg, cut, progress=False).train()
    assert exc.value.worker == "a rank 1", str(exc.value)
    assert exc.value.checkpoint is not None and exc.value.checkpoint.endswith("step_000002")
    monkeypatch.delenv("MUTUALRL_FAULT_POINT")
    monkeypatch.delenv("MUTUALRL_FAULT_WORKER")
    if ray.is_initialized():
        ray.shutdown()
    shared_ray()  # the resume on the shared Ray, started without the fault
    one = dict(cfg, policies=[dict(cfg["policies"][0], workers=1), cfg["policies"][1]])
    with pytest.raises(ConfigError, match=r"policies\.0\.workers.*cannot change when resuming"):
        MutualTrainer(one, cut, resume=True, progress=False).train()
    MutualTrainer(cfg, cut, resume=True, progress=False).train()
    full = uninterrupted("local")
    a, b = _metrics(full), _metrics(cut)
    assert [r["step"] for r in a if r.get("event") is None] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert any(r.get("event") == "eval" for r in a)
    assert a == b
    assert _exchange_rows(cut) == _exchange_rows(full)  # none lost, none twice
    info = json.loads((full / "policies.json").read_text())
    assert [i.get("ranks", 1) for i in info] == [2, 1] and len(set(info[0]["rank_pids"])) == 2


def test_a_rank_killed_under_the_local_scheduler_is_named_and_the_resume_is_exact(uninterrupted, tmp_path,
                                                                                 monkeypatch):
    """Policy ``a`` on 2 worker processes (replicas, gloo all-reduce) beside ``b``, under the local
    scheduler: rank 1 dies inside its update of step 2 while rank 0 waits in the collective; the run
    stops naming rank 1 and the last good checkpoint, and the resume logs the uninterrupted run's
    metrics with its exchange rows, each once (the FSDP and Ray variants are the tests around it)."""
    from mutualrl.allocation import WorkerFailed
    from mutualrl.run.trainer import MutualTrainer

    cfg = _two_rank_config(uninterrupted.tiny, "local")
    cut = tmp_path / "cut"
    monkeypatch.setenv("MUTUALRL_FAULT_POINT", "update:3")
    monkeypatch.setenv("MUTUALRL_FAULT_WORKER", "a rank 1")
    with pytest.raises(WorkerFailed) as exc:
        MutualTrainer(cfg, cut, progress=False).train()
    assert exc.value.worker == "a rank 1" and "killed by signal 9" in str(exc.value), str(exc.value)
    assert exc.value.checkpoint is not None and exc.value.checkpoint.endswith("step_000002")
    monkeypatch.delenv("MUTUALRL_FAULT_POINT")
    MutualTrainer(cfg, cut, resume=True, progress=False).train()
    full = uninterrupted("local")
    assert _metrics(full) == _metrics(cut)
    assert _exchange_rows(cut) == _exchange_rows(full)  # none lost, none twice


def test_an_fsdp_rank_killed_in_its_update_is_named_and_the_resume_is_exact(uninterrupted, shared_ray, tmp_path,
                                                                            monkeypatch):
    """Policy ``a`` sharded over 2 ranks (FSDP2) beside ``b``, sharing (imitate): the uninterrupted run
    under the Ray scheduler (the ranks as actors, gloo between them, the rendezvous at the driver); under
    the local scheduler, rank 1 of ``a`` dies inside its update of step 2 while rank 0 waits for it in a
    collective: the run stops naming rank 1 (not the rank left waiting) and the last good checkpoint;
    resumed from its gathered checkpoint into fresh shards, it logs the Ray run's metrics and its
    exchange holds that run's rows, each once."""
    shared_ray()
    from mutualrl.allocation import WorkerFailed
    from mutualrl.run.trainer import MutualTrainer

    cfg = _two_rank_config(uninterrupted.tiny, "local")
    cfg["policies"][0]["fsdp"] = True
    # a dense reward (shorter is better), no filtering: every step trains the sharded policy
    cfg["task"] = dict(cfg["task"], reward_functions=["test_trainer:reward_brevity"])
    cfg["grpo"] = dict(cfg["grpo"], dynamic_sampling="off")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    full, cut = tmp_path / "ray", tmp_path / "cut"
    MutualTrainer(dict(cfg, scheduler="ray"), full, progress=False).train()
    monkeypatch.setenv("MUTUALRL_FAULT_POINT", "update:3")
    monkeypatch.setenv("MUTUALRL_FAULT_WORKER", "a rank 1")
    with pytest.raises(WorkerFailed) as exc:
        MutualTrainer(cfg, cut, progress=False).train()
    assert exc.value.worker == "a rank 1", str(exc.value)
    assert "killed by signal 9" in str(exc.value)
    assert exc.value.checkpoint is not None and exc.value.checkpoint.endswith("step_000002")
    monkeypatch.delenv("MUTUALRL_FAULT_POINT")
    MutualTrainer(cfg, cut, resume=True, progress=False).train()
    a, b = _metrics(full), _metrics(cut)
    assert [r["step"] for r in a if r.get("event") is None] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert a == b
    steps = [r for r in a if r.get("event") is None and r["policy"] == "a"]
    assert all(r["optimizer_steps"] >= 1 for r in steps)  # the sharded policy trained every step
    assert _exchange_rows(cut) == _exchange_rows(full)  # none lost, none twice


def test_mwra_splits_gpus_to_balance_the_step():
    """A 7B and a 1.5B policy of workers: auto on 8 GPUs get 6 + 2 (not 4 + 4); a fixed count is kept;
    a policy never gets more ranks than it has prompts, nor one that would not shorten its step."""
    from mutualrl.allocation.data_parallel import allreduce_seconds, split_devices

    free = lambda i, n: 0.0
    assert split_devices([7.0, 1.5], 8, [None, None], free) == [6, 2]
    assert split_devices([7.0, 1.5], 8, [None, 4], free) == [4, 4]
    assert split_devices([7.0, 1.5], 8, [None, None], free, most=3) == [3, 3]
    slow = lambda i, n: 0.5 * (n - 1)
    assert split_devices([2.0, 2.0], 8, [None, None], slow) == [2, 2]
    assert allreduce_seconds(10**9, 1, 100.0) == 0.0
    assert allreduce_seconds(10**9, 2, 100.0) == pytest.approx(2 * 0.5 * 4e9 / 1e11)


def test_the_8gpu_example_plans_6_plus_2(capsys):
    """examples/gsm8k_8gpu.yaml (Mistral-7B x Qwen2.5-1.5B, workers: auto) on an 8-GPU node."""
    from mutualrl.cli import main

    assert main(["plan", str(HERE.parent / "examples" / "gsm8k_8gpu.yaml"), "--resources", "cpus=64,gpus=8x80",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    got = {p["name"]: (p["ranks"], p["gpu"]) for p in plan["placements"]}
    assert got == {"mistral7b": (6, 0), "qwen1b5": (2, 6)}
    assert all(p["predicted_allreduce_s"] > 0 for p in plan["placements"])
    # the LoRA policy's ranks sum the adapter's gradients (~42 M values for Mistral-7B at r = 16), not 7 B
    ar = {p["name"]: p["predicted_allreduce_s"] for p in plan["placements"]}
    assert ar["mistral7b"] < ar["qwen1b5"] / 10
    from mutualrl.allocation.data_parallel import lora_params
    assert 0.85 * 41.9e6 < lora_params(7_248_023_552, 16, "all-linear") < 1.15 * 41.9e6


def test_a_plan_whose_ranks_cannot_hold_the_model_is_refused(tmp_path, capsys):
    """Every rank holds the whole model: the 7B policy trained in full (no LoRA) needs ~105 GiB a rank,
    more than an 80 GB GPU; the plan is refused naming the policy and the way out."""
    import yaml

    from mutualrl.cli import main

    cfg = yaml.safe_load((HERE.parent / "examples" / "gsm8k_8gpu.yaml").read_text())
    cfg["policies"][0].pop("peft")
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path), "--resources", "cpus=64,gpus=8x80"]) == 2
    err = capsys.readouterr().err
    assert "policies[0]" in err and "LoRA" in err and "GiB" in err and "fsdp: true" in err
    cfg["policies"][0]["fsdp"] = True  # sharded over its 6 ranks: 4 + 16/6 bytes a parameter, ~43 GiB a rank
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path), "--resources", "cpus=64,gpus=8x80"]) == 0


def test_auto_ranks_come_from_the_placement(tiny_config):
    """The placement step gives a workers: auto policy the ranks its allocation planned (each its own
    GPU from the policy's first); the ranks meet at the scheduler's rendezvous under the policy's name."""
    from mutualrl.allocation.placement import place
    from mutualrl.allocation.planner import Allocation, Placement, Resources
    from mutualrl.config.resolve import plan_of

    cfg = dict(tiny_config, scheduler="local")
    cfg["policies"] = [dict(cfg["policies"][0], workers="auto"), cfg["policies"][1]]
    plan = plan_of(load_config(cfg))
    assert [(w.index, w.world) for w in plan.workers] == [(0, 1), (1, 1)]
    alloc = Allocation([Placement(0, "a", 1, 4.0, 2, gpu=2, gpu_fraction=1.0, ranks=3),
                        Placement(1, "b", 1, 4.0, 2, gpu=5, gpu_fraction=1.0)], Resources(8, []), "gpu")
    placed = place(plan, alloc, "local", "sqlite:///x.db", rendezvous="tcp://127.0.0.1:1234")
    assert [(w.index, w.rank, w.world, w.visible_gpu) for w in placed.workers] == [
        (0, 0, 3, 2), (0, 1, 3, 3), (0, 2, 3, 4), (1, 0, 1, 5)]
    assert {w.rendezvous for w in placed.workers} == {"tcp://127.0.0.1:1234/a", None}
    from mutualrl.config.resolve import RunPlan

    again = RunPlan.from_dict(json.loads(json.dumps(placed.to_dict())))
    assert again.workers == placed.workers


def test_an_auto_policy_on_cpu_cores_gets_the_ranks_that_shorten_its_step(tiny_config, monkeypatch):
    """On CPU cores a workers: auto policy gets the rank count whose predicted step is shortest: a rank
    per thread for a tiny policy on 4 cores (its all-reduce costs next to nothing), one
    worker when the all-reduce would cost more than the ranks save, one worker under the sequential
    scheduler (no processes), and 2 ranks at least with fsdp."""
    from mutualrl.allocation.cost import CostModel, estimate_parameters
    from mutualrl.allocation.planner import Resources, plan

    def ranks(cfg: dict) -> list[int]:
        c = load_config(cfg)
        return [p.ranks for p in plan(c, Resources(4.0), CostModel(c, estimate_parameters(c))).placements]

    cfg = dict(tiny_config, scheduler="local", prompts_per_step=4)
    cfg["policies"] = [dict(cfg["policies"][0], workers="auto"), cfg["policies"][1]]
    c = load_config(cfg)
    tiny = plan(c, Resources(4.0), CostModel(c, estimate_parameters(c))).placements[0]
    assert tiny.ranks >= 2 and tiny.threads == 1 and ranks(cfg)[1] == 1
    assert ranks(dict(cfg, scheduler="sequential")) == [1, 1]
    fsdp = dict(cfg, policies=[dict(cfg["policies"][0], fsdp=True), cfg["policies"][1]])
    assert ranks(fsdp)[0] >= 2
    monkeypatch.setattr(CostModel, "allreduce_s", lambda self, i, w: 1e3 * (w - 1))
    assert ranks(cfg) == [1, 1]
    assert ranks(fsdp) == [2, 1]  # the fewest that shard
