"""``mutualrl demo``: the embedded default end to end.

Builds (or reuses) the policy zoo, runs every arm (independent, prp, xgrpo, sgt) on the same
seeds and prompts, and writes ``report.md`` with the paper-style figure.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError

DEMO_POLICIES = ["gpt2-add", "llama-sub"]


def demo_config(strategy: str, seed: int = 0, *, quick: bool = False, steps: int | None = None) -> dict[str, Any]:
    """The embedded default run config for one arm (a plain dict, valid for ``load_config``)."""
    return {
        "policies": [{"name": n, "model": f"zoo:{n}"} for n in DEMO_POLICIES],
        "task": {"preset": "zoo", "test_size": 1000, "seed": 0},
        "grpo": {"num_generations": 8, "learning_rate": 1e-4, "max_completion_length": 6,
                 "temperature": 1.0, "loss_type": "dr_grpo", "scale_rewards": "group"},
        "sharing": {"strategy": strategy, "sgt_lambda": 1.0, "sgt_max_per_step": 16},
        "steps": steps or (30 if quick else 100),
        "prompts_per_step": 16,
        "eval_every": 10 if quick else 25,
        "eval_size": 200 if quick else 400,
        "checkpoint_every": 1000,
        "seed": seed,
    }


def run_demo(out: Path, *, quick: bool = False, arms: list[str] | None = None, seeds: list[int] | None = None,
             steps: int | None = None, force: bool = False, progress: bool = True) -> Path:
    """Run the demo into ``out``; return the report path."""
    from mutualrl.algorithms.sharing import check_strategy_name
    from mutualrl.config import load_config
    from mutualrl.report import write_report
    from mutualrl.trainer import MutualTrainer
    from mutualrl.zoo import build_zoo

    arms = arms or ["independent", "prp", "xgrpo", "sgt"]
    seeds = seeds if seeds is not None else [0]
    for a in arms:
        err = check_strategy_name(a)
        if err:
            raise UserError(f"--arms: {err}")
    if steps is not None and steps < 1:
        raise UserError(f"--steps must be a positive integer, got {steps}")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise UserError(f"output directory {str(out)!r} exists and is not empty; use --force to overwrite "
                            "or -o to choose another")
        shutil.rmtree(out)
    t0 = time.perf_counter()
    print("[mutualrl demo] building / loading the policy zoo ...")
    build_zoo(DEMO_POLICIES, seed=0, progress=progress)
    run_dirs = []
    for seed in seeds:
        for arm in arms:
            cfg = load_config(demo_config(arm, seed, quick=quick, steps=steps))
            run_dir = out / f"{arm}-seed{seed}"
            print(f"[mutualrl demo] arm {arm}, seed {seed} -> {run_dir}")
            MutualTrainer(cfg, run_dir, progress=progress).train()
            run_dirs.append(run_dir)
    report = write_report(run_dirs, out, title="mutualrl demo: the embedded default")
    print(f"[mutualrl demo] done in {time.perf_counter() - t0:.0f} s; report: {report}")
    return report
