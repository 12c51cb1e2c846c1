"""A policy on 1 rank x 2 threads against 2 ranks x 1 thread on this machine, and what MWRA predicted.

    python benchmarks/data_parallel.py [--steps 6] [--quick]

For each model (the zoo pair's ``gpt2-add`` and ``llama-sub`` policies, and SmolLM2-135M and
Gemma-3-270M from the ``real-small`` preset) one policy trains alone under the local scheduler for ``--steps`` steps
(the first is left out as warm-up): once as one worker with 2 torch threads, once as 2
data-parallel ranks (``workers: 2``) with 1 thread each. Reported per model and layout: the mean
step time (rollout, update), the gradient all-reduce's seconds and share of the step (measured in
the ranks: ``allreduce_s``), and the planner's prediction for the same layout before any step of
the run: from the FLOP prior, and after ``mutualrl plan --calibrate``'s short calibration (3 real
steps, the first a warm-up, of the run as the prior plan places it: every rank in its own worker
process, on a private exchange), each with its error against the measured step.

Then each pair (``--pairs``: the zoo pair; SmolLM2-135M x Gemma-3-270M) trains together as a user
starts it, ``mutualrl train --calibrate`` with threads left to MWRA (sharing: imitate): the
calibrated first plan's predicted step against the steps measured under that plan (re-plans off).
Writes ``benchmarks/results/data_parallel.json`` (load average recorded: run it alone).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import git_rev, machine, write_result

MODELS = {
    "zoo:gpt2-add": {"prompts": 64, "generations": 8, "max_new": 6},
    "zoo:llama-sub": {"prompts": 64, "generations": 8, "max_new": 6},
    "real:smollm2": {"prompts": 4, "generations": 4, "max_new": 12,
                     "template": "Question: {question}\nAnswer:"},
    "real:gemma3": {"prompts": 4, "generations": 4, "max_new": 12, "template": "{question} Answer: "},
}


def config(model: str, workers: int, threads: int, steps: int) -> dict[str, Any]:
    m = MODELS[model]
    task = {"preset": "zoo", "test_size": 20, "seed": 0, "reward": "exact"}
    return {"policies": [{"name": "p", "model": model, "workers": workers,
                          **({"prompt_template": m["template"]} if "template" in m else {})}],
            "task": task,
            "grpo": {"num_generations": m["generations"], "max_completion_length": m["max_new"],
                     "learning_rate": 1e-5 if model.startswith("real") else 1e-4, "dynamic_sampling": "off"},
            "sharing": {"strategy": "independent"}, "steps": steps, "prompts_per_step": m["prompts"],
            "eval_every": 10_000, "eval_size": 1, "checkpoint_every": 10_000, "scheduler": "local",
            "threads": threads, "seed": 0}


def predicted(cfg: dict[str, Any]) -> tuple[float, float]:
    """The planner's step time for the config on 2 cores before any step of the run: from the FLOP
    prior, and after the short calibration (``mutualrl plan --calibrate``: 3 real steps, the first a
    warm-up, of the run as the prior plan places it, every rank in its own worker process on its
    threads, on a private exchange; the all-reduce calibrated apart and added back per layout)."""
    from mutualrl.allocation.calibrate import calibrate_in_workers
    from mutualrl.allocation.cost import CostModel, estimate_parameters
    from mutualrl.allocation.planner import Resources, plan
    from mutualrl.config.resolve import load_config

    c = load_config(cfg)
    costs = CostModel(c, estimate_parameters(c))
    first = plan(c, Resources(2.0), costs)
    calibrate_in_workers(c, costs, first, steps=3)
    return first.predicted_step_s, plan(c, Resources(2.0), costs).predicted_step_s


def measure(model: str, workers: int, threads: int, steps: int) -> dict[str, Any]:
    from mutualrl.run.trainer import MutualTrainer

    cfg = config(model, workers, threads, steps)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        tr = MutualTrainer(cfg, Path(d) / "run", progress=False)
        tr.train()
        wall = time.perf_counter() - t0
    rows = [r for r in tr.history if r.get("event") is None and r["step"] >= 1]  # step 0: warm-up
    step = statistics.fmean(r["step_s"] for r in rows)
    ar = statistics.fmean(r.get("allreduce_s", 0.0) for r in rows)
    prior, calibrated = predicted(cfg)
    return {"model": model, "workers": workers, "threads_per_worker": threads, "steps_timed": len(rows),
            "step_s": step, "rollout_s": statistics.fmean(r["step_rollout_s"] for r in rows),
            "update_s": statistics.fmean(r["step_update_s"] for r in rows), "allreduce_s": ar,
            "allreduce_share": ar / step if step else 0.0, "wall_s": wall,
            "planner_prior_s": prior, "planner_prior_error": prior / step - 1.0,
            "planner_first_prediction_s": calibrated, "planner_error": calibrated / step - 1.0}


PAIRS = {"zoo": ("zoo:gpt2-add", "zoo:llama-sub"), "real": ("real:smollm2", "real:gemma3")}


def pair_config(pair: str, steps: int) -> dict[str, Any]:
    """The two policies of ``pair`` trained together (sharing: imitate), threads and ranks left to MWRA."""
    a, b = (config(m, 1, 1, steps) for m in PAIRS[pair])
    pols = [dict(a["policies"][0], name="p0", model=PAIRS[pair][0]), dict(b["policies"][0], name="p1",
                                                                          model=PAIRS[pair][1])]
    cfg = dict(a, policies=pols, sharing={"strategy": "imitate"})
    cfg.pop("threads")
    return cfg


def measure_pair(pair: str, steps: int) -> dict[str, Any]:
    """A two-policy run as a user starts it (``mutualrl train --calibrate``): MWRA's first plan from the
    calibration in worker processes, against the steps measured under that plan (re-plans off, so that
    the measured steps are the first plan's)."""
    from mutualrl.allocation.local import LocalScheduler
    from mutualrl.run.trainer import MutualTrainer

    cfg = pair_config(pair, steps)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        tr = MutualTrainer(cfg, Path(d) / "run", progress=False, calibrate=3,
                           scheduler=LocalScheduler(verbose=False, replan_threshold=float("inf")))
        tr.train()
        wall = time.perf_counter() - t0
        plans = json.loads((Path(d) / "run" / "allocation.json").read_text())["plans"]
    first = next(p for p in plans if p["reason"].startswith("calibrated"))
    assert len(plans) == 2, "a re-plan happened: the measured steps are not the first plan's"
    rows = [r for r in tr.history if r.get("event") is None and r["step"] >= 1]
    step = statistics.fmean(r["step_s"] for r in rows if r["policy"] == "p0")  # the barrier's: both policies
    out = {"model": f"pair:{pair}", "models": list(PAIRS[pair]), "steps_timed": len(rows) // 2, "step_s": step,
           "wall_s": wall, "planner_prior_s": plans[0]["predicted_step_s"],
           "planner_prior_error": plans[0]["predicted_step_s"] / step - 1.0,
           "planner_first_prediction_s": first["predicted_step_s"],
           "planner_error": first["predicted_step_s"] / step - 1.0, "first_plan": first["placements"]}
    for i in (0, 1):
        busy = [r["rollout_s"] + r["update_s"] for r in rows if r["policy"] == f"p{i}"]
        out[f"p{i}_busy_s"] = statistics.fmean(busy)
        out[f"p{i}_predicted_s"] = first["placements"][i]["predicted_rollout_s"] + first["placements"][i][
            "predicted_update_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="3 steps, the zoo models only")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--pairs", default=",".join(PAIRS), help="pairs trained together under the calibrated "
                    "first plan (zoo, real; empty: none)")
    args = ap.parse_args()
    models = [m for m in args.models.split(",") if m]
    pairs = [p for p in args.pairs.split(",") if p]
    if set(pairs) - set(PAIRS) or set(models) - set(MODELS):
        ap.error(f"--models from {', '.join(MODELS)}; --pairs from {', '.join(PAIRS)}")
    if args.quick:
        args.steps, models, pairs = 3, [m for m in models if m.startswith("zoo:")], [p for p in pairs if p == "zoo"]
    if any(m.startswith("real:") for m in models) or "real" in pairs:
        from mutualrl.realmodels import prepare_preset

        prepare_preset("real-small", progress=False)
    load0 = os.getloadavg()[0]
    rows = []
    for model in models:
        for workers, threads in ((1, 2), (2, 1)):
            r = measure(model, workers, threads, args.steps)
            rows.append(r)
            print(f"{model:16s} {workers} x {threads} thread(s): step {r['step_s']:.3f}s (rollout {r['rollout_s']:.3f}, "
                  f"update {r['update_s']:.3f}, all-reduce {r['allreduce_s']:.4f} = {100 * r['allreduce_share']:.1f} %); "
                  f"planner: prior {r['planner_prior_s']:.3g}s ({100 * r['planner_prior_error']:+.0f} %), "
                  f"calibrated first plan {r['planner_first_prediction_s']:.3g}s ({100 * r['planner_error']:+.0f} %)",
                  flush=True)
    for pair in pairs:
        r = measure_pair(pair, args.steps)
        rows.append(r)
        print(f"pair {pair:11s} first plan {r['first_plan'][0]['threads']}+{r['first_plan'][1]['threads']} threads: "
              f"step {r['step_s']:.3f}s; planner: prior {r['planner_prior_s']:.3g}s "
              f"({100 * r['planner_prior_error']:+.0f} %), calibrated first plan {r['planner_first_prediction_s']:.3g}s "
              f"({100 * r['planner_error']:+.0f} %)", flush=True)
    by = {(r["model"], r.get("workers")): r for r in rows}
    speedup = {m: by[(m, 1)]["step_s"] / by[(m, 2)]["step_s"] for m in models}
    within = {r["model"] + (f" {r['workers']}x{r['threads_per_worker']}" if "workers" in r else ""):
              abs(r["planner_error"]) <= 0.25 for r in rows}
    write_result("data_parallel_quick" if args.quick else "data_parallel",
                 {"rows": rows, "speedup_2_ranks_over_1": speedup, "first_plan_within_25pct": within,
                  "steps": args.steps, "machine": machine(),
                  "load_avg": {"start": load0, "end": os.getloadavg()[0]}, "git_rev": git_rev(),
                  "note": "one policy alone (pair rows: two policies together, imitate, threads planned by MWRA, "
                  "re-plans off); 2 cores; step 0 left out; planner prediction before any step of the run"})
    print(json.dumps(speedup, indent=1))


if __name__ == "__main__":
    main()
