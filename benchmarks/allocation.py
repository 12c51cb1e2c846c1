"""MWRA benchmark: process speed-up, balance of the planned split, Ray overhead, scaling in K.

Everything is measured as ratios within one invocation, with the compared schedulers started
side by side and their steps *alternated* (only one runs at a time), because the machine is
shared and absolute times drift:

* ``process_speedup``: 2 equal (medium) policies, step time run one after the other in this process
  (``SequentialScheduler``, torch using all cores) ÷ the same with ``LocalScheduler`` (one
  process per policy, concurrently).
* ``ray_overhead``: the same 2 policies on ``RayScheduler`` (a local Ray cluster) ÷
  ``LocalScheduler``.
* ``imbalance_naive`` / ``imbalance_planned``: a big and a small policy (single-core costs ≥ 4x
  apart); per step, max ÷ min of the two workers' busy time (``rollout_s + update_s``) with the
  equal split (one thread each) vs the MWRA plan (after its online calibration and re-plan).
* ``step_time_k``: ``LocalScheduler`` step time for K = 1, 2, 3, 4 equal (medium) policies.

A step is exactly what ``MutualTrainer`` does per step: ``call("rollout", s)`` then
``call("update", s)`` on the scheduler. Models are tiny GPT-2s built here (no downloads).

    python benchmarks/allocation.py            # full
    python benchmarks/allocation.py --quick    # fewer steps (same measurements)

Writes ``benchmarks/results/allocation.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in the worker processes: no spinning on shared cores

RESULTS = Path(__file__).resolve().parent / "results" / "allocation.json"
SEED = 0
SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_inner": 128}
MEDIUM = {"n_layer": 3, "n_embd": 128, "n_head": 4, "n_inner": 512}
BIG = {"n_layer": 6, "n_embd": 256, "n_head": 4, "n_inner": 1024}
"""The big policy costs about 5x the small one per step (measured: ``details.balance.cost_ratio``)."""


# ----------------------------------------------------------------------------- setup
def build_models(root: Path) -> dict[str, Path]:
    """Small, medium and big GPT-2s with the same byte-level BPE tokenizer, saved under ``root``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import torch

    from mutualrl.zoo import ZOO, build_model, default_task
    from mutualrl.zoo.tokenizers import train_tokenizer

    torch.manual_seed(SEED)
    task = default_task(seed=SEED, test_size=50, train_size=500)
    texts = [p.question + " Answer: " + p.answer for p in task.problems("train")]
    base = ZOO["gpt2-add"]
    tok = train_tokenizer("byte_bpe", texts, base.vocab_size)
    out = {}
    for name, dims in (("small", SMALL), ("medium", MEDIUM), ("big", BIG)):
        model = build_model(dataclasses.replace(base, **dims), tok)
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = d
    return out


def run_config(models: list[Path], exchange: str, quick: bool) -> Any:
    from mutualrl.config.resolve import resolve

    return resolve({
        "policies": [{"name": f"p{i}", "model": str(m)} for i, m in enumerate(models)],
        "task": {"preset": "zoo", "test_size": 20},
        "grpo": {"num_generations": 8, "max_completion_length": 8, "dynamic_sampling": "off"},
        "sharing": {"strategy": "xgrpo" if len(models) > 1 else "independent"},
        "prompts_per_step": 8, "seed": SEED, "exchange": exchange, "step_timeout_s": 600.0,
    }, check_paths=False)


def started(sched: Any, plan: Any) -> Any:
    """``sched`` with the workers of ``plan`` placed and started (the trainer's placement step)."""
    from mutualrl.allocation.run_placement import launch

    return launch(sched, plan, None)


def step(placed: Any, s: int) -> tuple[float, list[float]]:
    """One training step of a placed run (as the trainer takes it: MWRA observes both phases and may
    re-plan after the update): (wall seconds, per-worker busy seconds)."""
    t0 = time.perf_counter()
    roll = placed.scheduler.call("rollout", s)
    for i, r in enumerate(roll):  # right after the call: cpu_seconds() is this call's
        placed.observe(i, "rollout", r)
    upd = placed.scheduler.call("update", s)
    wall = time.perf_counter() - t0
    for i, u in enumerate(upd):
        placed.observe(i, "update", u)
    placed.after_update(s)
    return wall, [r["rollout_s"] + u["update_s"] for r, u in zip(roll, upd, strict=True)]


def alternate(scheds: dict[str, Any], steps: int, warmup: int) -> dict[str, dict[str, list]]:
    """Run the schedulers' steps in turn (a, b, c, a, b, c, ...); the first ``warmup`` are not kept."""
    out: dict[str, dict[str, list]] = {k: {"wall": [], "busy": []} for k in scheds}
    for s in range(warmup + steps):
        for name, sch in scheds.items():
            wall, busy = step(sch, s)
            if s >= warmup:
                out[name]["wall"].append(wall)
                out[name]["busy"].append(busy)
    return out


def cpu_calibration_us() -> float:
    """Best time of a fixed small Python loop: how much CPU this process gets right now."""
    best = float("inf")
    for _ in range(200):
        t0 = time.perf_counter()
        sum(range(1000))
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def load_now() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------------- measurements
def measure_pair(models: dict[str, Path], scratch: Path, steps: int, warmup: int, with_ray: bool) -> dict[str, Any]:
    """Sequential vs LocalScheduler vs RayScheduler on 2 equal policies, alternated."""
    from mutualrl.allocation import SequentialScheduler
    from mutualrl.allocation.local import LocalScheduler

    pair = [models["medium"], models["medium"]]
    scheds: dict[str, Any] = {}
    cores = len(os.sched_getaffinity(0))
    try:
        seq = SequentialScheduler(threads=cores)
        scheds["sequential"] = started(seq, run_config(pair, f"sqlite:///{scratch / 'seq.db'}", False))
        loc = LocalScheduler(verbose=False)
        scheds["local"] = started(loc, run_config(pair, f"sqlite:///{scratch / 'local.db'}", False))
        if with_ray:
            import ray

            from mutualrl.allocation.ray_scheduler import RayScheduler

            ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False)
            ray_s = RayScheduler(verbose=False)
            scheds["ray"] = started(ray_s, run_config(pair, f"sqlite:///{scratch / 'ray.db'}", False))
        res = alternate(scheds, steps, warmup)
    finally:
        for placed in scheds.values():
            placed.scheduler.close()
        if with_ray:
            import ray

            ray.shutdown()
    med = {k: statistics.median(v["wall"]) for k, v in res.items()}
    out = {"step_s": med, "process_speedup": med["sequential"] / med["local"],
           "threads": {"local": scheds["local"].allocation.threads()}}
    if with_ray:
        out["ray_overhead"] = med["ray"] / med["local"]
    return out


def measure_balance(models: dict[str, Path], scratch: Path, steps: int, warmup: int) -> dict[str, Any]:
    """Equal split vs MWRA plan for a big and a small policy, alternated."""
    from mutualrl.allocation.local import LocalScheduler
    from mutualrl.allocation.planner import Resources, plan_equal

    pair = [models["big"], models["small"]]
    res_ = Resources.detect()
    scheds: dict[str, Any] = {}
    try:
        cfg_n = run_config(pair, f"sqlite:///{scratch / 'naive.db'}", False)
        naive = LocalScheduler(allocation=plan_equal(cfg_n.config, res_), verbose=False)
        scheds["naive"] = started(naive, cfg_n)
        planned = LocalScheduler(verbose=True)
        scheds["planned"] = started(planned, run_config(pair, f"sqlite:///{scratch / 'planned.db'}", False))
        res = alternate(scheds, steps, warmup)
    finally:
        for placed in scheds.values():
            placed.scheduler.close()

    def imbalance(busy: list[list[float]]) -> float:
        return statistics.median(max(b) / min(b) for b in busy)

    # single-core cost ratio, from the equal split (one thread each)
    cost_ratio = statistics.median(b[0] / b[1] for b in res["naive"]["busy"])
    planned_at = scheds["planned"]
    alloc = planned_at.allocation
    return {"imbalance_naive": imbalance(res["naive"]["busy"]), "imbalance_planned": imbalance(res["planned"]["busy"]),
            "cost_ratio": cost_ratio,
            "step_s": {k: statistics.median(v["wall"]) for k, v in res.items()},
            "busy_s": {k: [statistics.median(b[i] for b in v["busy"]) for i in range(2)] for k, v in res.items()},
            "planned_threads": alloc.threads() if alloc else None,
            "planned_nice": [p.nice for p in alloc.placements] if alloc else None,
            "replans": len(planned_at.mwra.history) - 1}


def measure_k(models: dict[str, Path], scratch: Path, steps: int, warmup: int, ks: list[int]) -> dict[str, float]:
    """LocalScheduler step time for K equal medium policies."""
    from mutualrl.allocation.local import LocalScheduler

    out = {}
    for k in ks:
        sch = LocalScheduler(verbose=False)
        try:
            res = alternate({"local": started(sch, run_config([models["medium"]] * k,
                                                              f"sqlite:///{scratch / f'k{k}.db'}", False))}, steps, warmup)
        finally:
            sch.close()
        out[str(k)] = statistics.median(res["local"]["wall"])
    return out


# ----------------------------------------------------------------------------- main
def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).resolve().parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (under ~3 minutes on 2 idle cores)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray measurement")
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    import torch

    steps, warmup = (3, 1) if args.quick else (8, 2)
    t0 = time.perf_counter()
    load_start, cal_start = load_now(), cpu_calibration_us()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-alloc-") as tmp:
        scratch = Path(tmp)
        models = build_models(scratch / "models")
        pair = measure_pair(models, scratch, steps, warmup, not args.no_ray)
        balance = measure_balance(models, scratch, steps, warmup + 2)  # 2 more: calibration + re-plan
        ks = measure_k(models, scratch, max(2, steps // 2), 1, [1, 3, 4])
    ks["2"] = pair["step_s"]["local"]
    result: dict[str, Any] = {
        "process_speedup": pair["process_speedup"],
        "imbalance_naive": balance["imbalance_naive"],
        "imbalance_planned": balance["imbalance_planned"],
        "ray_overhead": pair.get("ray_overhead"),
        "step_time_k": {k: ks[k] for k in sorted(ks)},
        "details": {"pair": pair, "balance": balance},
        "targets": {"process_speedup": ">= 1.6", "imbalance_planned": "<= 1.25 and < imbalance_naive",
                    "ray_overhead": "<= 1.15"},
        "machine": {"cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_avg_1m": [load_start, load_now()],
                    "cpu_calibration_us": [cal_start, cpu_calibration_us()]},
        "quick": args.quick, "steps": steps, "seed": SEED, "models": {"small": SMALL, "medium": MEDIUM, "big": BIG},
        "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    }
    try:
        import ray

        result["machine"]["ray"] = ray.__version__
    except ImportError:
        pass
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1))
    print_table(result)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def print_table(r: dict[str, Any]) -> None:
    def fmt(x: Any) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    rows = [("process_speedup (sequential / local)", fmt(r["process_speedup"]), ">= 1.6"),
            ("imbalance_naive (equal split)", fmt(r["imbalance_naive"]), ""),
            ("imbalance_planned (MWRA plan)", fmt(r["imbalance_planned"]), "<= 1.25, < naive"),
            ("ray_overhead (ray / local)", fmt(r["ray_overhead"]), "<= 1.15")]
    rows += [(f"step_s K={k} (local)", fmt(v), "") for k, v in r["step_time_k"].items()]
    w = max(len(a) for a, _, _ in rows)
    print(f"{'measure'.ljust(w)}  {'value':>8}  target")
    for a, b, c in rows:
        print(f"{a.ljust(w)}  {b:>8}  {c}")
    m = r["machine"]
    print(f"machine: {m['usable_cpus']} cpus, load avg {m['load_avg_1m'][0]:.1f} -> {m['load_avg_1m'][1]:.1f}, "
          f"cpu calibration {m['cpu_calibration_us'][0]:.0f}/{m['cpu_calibration_us'][1]:.0f} us, "
          f"wall {r['wall_s']:.0f}s, quick={r['quick']}")


if __name__ == "__main__":
    sys.exit(main())
