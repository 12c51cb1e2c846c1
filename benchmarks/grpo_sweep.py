"""Which GRPO settings make the zoo policies learn: a sweep of the levers, one policy at a time.

    python benchmarks/grpo_sweep.py [--quick] [--variants a,b,...] [--policies gpt2-add,llama-sub]
                                    [--seeds 0] [--steps N] [--jobs 2]

Every variant is plain GRPO (strategy ``independent``) of one zoo policy on the zoo task
(2-digit addition + subtraction), from the same warm start, with the same step count; what
differs is one lever (or a named combination): prompts per step and group size, learning rate,
warm-up and schedule, Adam betas, exact versus partial-credit reward, dynamic sampling (skip or
resample zero-variance groups), KL to the reference. Each run is its own process with one torch
thread (``--jobs`` of them side by side: the learning curves do not depend on the load; wall times
of runs taken side by side are marked as such). Held-out greedy exact accuracy (``eval_size``
problems, half per type) is measured every ``eval_every`` steps.

Writes ``benchmarks/results/grpo_sweep.json`` (``--quick``: ``grpo_sweep_quick.json``): per variant
and policy, the options, the accuracy curve, gain (final − initial, points), the best, per-type
finals, mean train reward of the first/last 10 % of steps, the zero-variance group fraction,
generated and trained tokens and wall time; plus the common keys.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import git_rev, machine, write_result

BASE: dict[str, Any] = {
    "task": {"preset": "zoo", "test_size": 800, "seed": 0, "reward": "score"},
    "grpo": {"num_generations": 8, "learning_rate": 1e-4, "max_completion_length": 6, "temperature": 1.0,
             "loss_type": "dr_grpo", "scale_rewards": "group", "dynamic_sampling": "off"},
    "prompts_per_step": 16,
    "eval_size": 800,
    "checkpoint_every": 100000,
}
"""The settings every variant starts from (the old demo's): 16 prompts x 8, lr 1e-4, partial credit,
every group in the update."""

VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "exact": {"task": {"reward": "exact"}},
    "p64": {"prompts_per_step": 64},
    "p64_exact": {"prompts_per_step": 64, "task": {"reward": "exact"}},
    "p64_exact_lr3e-4": {"prompts_per_step": 64, "task": {"reward": "exact"}, "grpo": {"learning_rate": 3e-4}},
    "p64_exact_lr3e-4_warm": {"prompts_per_step": 64, "task": {"reward": "exact"},
                              "grpo": {"learning_rate": 3e-4, "warmup_ratio": 0.1}},
    "p64_exact_lr1e-3_warm": {"prompts_per_step": 64, "task": {"reward": "exact"},
                              "grpo": {"learning_rate": 1e-3, "warmup_ratio": 0.1}},
    "p64_exact_skip": {"prompts_per_step": 64, "task": {"reward": "exact"}, "grpo": {"dynamic_sampling": "skip"}},
    "p64_exact_resample": {"prompts_per_step": 64, "task": {"reward": "exact"},
                           "grpo": {"dynamic_sampling": "resample"}},
    "p64_exact_b2": {"prompts_per_step": 64, "task": {"reward": "exact"}, "grpo": {"adam_beta2": 0.99}},
    "p64_exact_kl": {"prompts_per_step": 64, "task": {"reward": "exact"}, "grpo": {"beta": 0.04}},
    "p32_g16_exact": {"prompts_per_step": 32, "task": {"reward": "exact"}, "grpo": {"num_generations": 16}},
    "p128_g4_exact": {"prompts_per_step": 128, "task": {"reward": "exact"}, "grpo": {"num_generations": 4}},
    "p64_exact_skip_cos": {"prompts_per_step": 64, "task": {"reward": "exact"},
                           "grpo": {"dynamic_sampling": "skip", "warmup_steps": 10, "lr_scheduler_type": "cosine"}},
    "p64_exact_skip_kl": {"prompts_per_step": 64, "task": {"reward": "exact"},
                          "grpo": {"dynamic_sampling": "skip", "beta": 0.04}},
    "p64_exact_skip_lr5e-5": {"prompts_per_step": 64, "task": {"reward": "exact"},
                              "grpo": {"dynamic_sampling": "skip", "learning_rate": 5e-5}},
    "p128_exact_skip": {"prompts_per_step": 128, "task": {"reward": "exact"}, "grpo": {"dynamic_sampling": "skip"}},
}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in, one level deep for mappings."""
    out = json.loads(json.dumps(base))
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k].update(v)
        else:
            out[k] = v
    return out


def run_config(variant: str, policy: str, seed: int, steps: int, eval_every: int, extra: dict[str, Any],
               mix: str = "zoo") -> dict:
    """The run config of one variant. ``mix``: ``zoo`` (addition and subtraction, equal weights) or
    ``own`` (the policy's own warm-start mixture, e.g. 80 % addition for gpt2-add)."""
    cfg = merged(merged(BASE, VARIANTS[variant]), extra)
    if mix == "own":
        from mutualrl.zoo import ZOO
        from mutualrl.zoo.task import task_section

        t = {k: v for k, v in cfg["task"].items() if k != "preset"}
        cfg["task"] = task_section(ZOO[policy].sft_mixture, **t)
    cfg.update({"policies": [{"name": policy, "model": f"zoo:{policy}"}], "steps": steps,
                "eval_every": eval_every, "seed": seed})
    return cfg


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """The figures of one finished run directory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("event") == "eval"]
    steps = [r for r in rows if r.get("event") != "eval"]
    k = max(1, len(steps) // 10)
    out: dict[str, Any] = {
        "curve": [[r["step"], r["test_acc"]] for r in evals],
        "acc_initial": evals[0]["test_acc"], "acc_final": evals[-1]["test_acc"],
        "acc_best": max(r["test_acc"] for r in evals),
        "gain_pts": 100 * (evals[-1]["test_acc"] - evals[0]["test_acc"]),
        "per_type_initial": {k2.split("/", 1)[1]: v for k2, v in evals[0].items() if k2.startswith("test_acc/")},
        "per_type_final": {k2.split("/", 1)[1]: v for k2, v in evals[-1].items() if k2.startswith("test_acc/")},
        "train_reward_first": statistics.fmean(r["reward_mean"] for r in steps[:k]),
        "train_reward_last": statistics.fmean(r["reward_mean"] for r in steps[-k:]),
        "train_acc_first": statistics.fmean(r["train_acc"] for r in steps[:k]),
        "train_acc_last": statistics.fmean(r["train_acc"] for r in steps[-k:]),
        "zero_var_group_frac": statistics.fmean(r.get("zero_var_group_frac", 0.0) for r in steps),
        "gen_tokens": sum(r.get("gen_tokens", 0) for r in steps),
        "train_tokens": sum(r.get("train_tokens", 0) for r in steps),
        "wall_s": json.loads((run_dir / "summary.json").read_text())["wall_s"],
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and variants (same measurement)")
    ap.add_argument("--variants", default=None, help=f"comma-separated, from: {', '.join(VARIANTS)}")
    ap.add_argument("--policies", default="gpt2-add,llama-sub")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2, help="runs side by side (one torch thread each)")
    ap.add_argument("--set", default=None, help="JSON merged into every variant's config")
    ap.add_argument("--mix", choices=("zoo", "own"), default="own",
                    help="task mixture: the zoo task (equal weights) or each policy's own warm-start mix")
    ap.add_argument("--out", default="runs/bench_grpo_sweep")
    ap.add_argument("--name", default=None, help="result name (default grpo_sweep / grpo_sweep_quick)")
    ap.add_argument("--one", nargs=2, metavar=("CONFIG_JSON", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import torch

        from mutualrl.config.resolve import load_config
        from mutualrl.run.trainer import MutualTrainer

        torch.set_num_threads(1)
        MutualTrainer(load_config(json.loads(args.one[0])), Path(args.one[1]), progress=False).train()
        return

    from mutualrl.zoo import build_zoo

    variants = (args.variants.split(",") if args.variants else
                (["base", "p64_exact", "p64_exact_skip"] if args.quick else list(VARIANTS)))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    policies = args.policies.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    steps = args.steps or (60 if args.quick else 300)
    eval_every = args.eval_every or max(1, steps // 6)
    extra = json.loads(args.set) if args.set else {}
    build_zoo(policies, seed=0, progress=False)
    out = Path(args.out) / ("quick" if args.quick else "full")
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    jobs = [(v, p, s) for s in seeds for v in variants for p in policies]
    running: list[tuple[str, str, int, Path, subprocess.Popen]] = []
    results: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def reap(block: bool) -> None:
        for item in list(running):
            v, p, s, d, proc = item
            if proc.poll() is None and not block:
                continue
            if proc.wait() != 0:
                raise SystemExit(f"variant {v} policy {p} seed {s} failed (exit {proc.returncode}); see {d}")
            running.remove(item)
            res = summarize_run(d)
            results.setdefault(v, {}).setdefault(p, {})[str(s)] = res
            print(f"{v:<26}{p:<11}seed {s}  acc {res['acc_initial']:.3f} -> {res['acc_final']:.3f} "
                  f"({res['gain_pts']:+.1f} pts, best {res['acc_best']:.3f})  reward {res['train_reward_first']:.3f}"
                  f" -> {res['train_reward_last']:.3f}  {res['wall_s']:.0f}s", flush=True)

    for v, p, s in jobs:
        d = out / f"{v}-{p}-seed{s}"
        if d.exists():
            shutil.rmtree(d)
        cfg = run_config(v, p, s, steps, eval_every, extra, args.mix)
        running.append((v, p, s, d, subprocess.Popen([sys.executable, __file__, "--one", json.dumps(cfg), str(d)],
                                                     env=env)))
        while len(running) >= args.jobs:
            time.sleep(2)
            reap(block=False)
    while running:
        time.sleep(2)
        reap(block=False)

    table = {}
    for v in variants:
        for p in policies:
            rs = list(results.get(v, {}).get(p, {}).values())
            if rs:
                table.setdefault(v, {})[p] = {"gain_pts_mean": statistics.fmean(r["gain_pts"] for r in rs),
                                              "acc_final_mean": statistics.fmean(r["acc_final"] for r in rs)}
    print(f"\n{'variant':<26}" + "".join(f"{p + ' gain':>18}" for p in policies))
    for v, row in table.items():
        print(f"{v:<26}" + "".join(f"{row.get(p, {}).get('gain_pts_mean', float('nan')):>+18.1f}" for p in policies))
    mach = machine()
    mach["load_avg"] = {"start": load_start, "end": os.getloadavg()[0]}
    write_result(args.name or ("grpo_sweep_quick" if args.quick else "grpo_sweep"), {
        "base": BASE, "variants": {v: VARIANTS[v] for v in variants}, "extra": extra, "mix": args.mix,
        "policies": policies,
        "seeds": seeds, "steps": steps, "eval_every": eval_every, "jobs": args.jobs, "runs": results,
        "table": table, "machine": mach, "quick": args.quick, "wall_s": time.perf_counter() - t0,
        "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
