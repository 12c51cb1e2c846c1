"""``mutualrl demo``: the embedded default end to end.

Builds (or reuses) the policy zoo, runs the arms (by default plain GRPO, the no-peer control
``self_imitate`` and ``imitate``; ``--arms`` for others) on the same seeds and prompts, and writes
``report.md``: the peers' share (the sharing arm minus the stronger single-model arm, both chosen
on the validation split), the paper-style figure and per-skill accuracies. The two policies of an arm run in two worker
processes (the local scheduler), one core each.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from mutualrl.config.modelref import ModelRef
from mutualrl.errors import UserError

DEMO_POLICIES = ["gpt2-add", "llama-sub"]
DEMO_STEPS = 200
"""Steps per arm of ``mutualrl demo`` (the study, ``benchmarks/mutual.py``, runs 300): the shared
skills have come back by then, and three arms fit the ten minutes a first run may take."""
SUPERVISED_STEP = {"weight": 1.0, "learning_rate": 3e-4}
"""The supervised steps' settings (``sgt``, ``imitate``, ``self_imitate``): rows at weight 1 in an
AdamW step of their own at lr 3e-4 (peer rows capped at 64 a step)."""
DEMO_ARMS = ["independent", "self_imitate", "imitate"]
"""What ``mutualrl demo`` runs by default, on the same seed and prompts: plain GRPO, the control that
takes imitate's extra supervised step on the learner's own successes without any peer, and the best
sharing arm of the zoo study (``benchmarks/mutual.py``). What the peers add is imitate minus the
control, not minus plain GRPO (the extra step alone pays part of the gain)."""


def demo_config(strategy: str, seed: int = 0, *, quick: bool = False, steps: int | None = None,
                zoo_seed: int = 0) -> dict[str, Any]:
    """The embedded default run config for one arm (a plain dict, valid for ``load_config``);
    ``zoo_seed``: the zoo build seed of its policies (0: the shipped ones).

    The settings where GRPO reliably lifts the zoo policies (``benchmarks/grpo_sweep.py``): 64
    prompts x 8 samples per step, exact-match reward, zero-variance groups skipped, lr 1e-4; the
    rescue rows of ``sgt``/``imitate`` at weight 1 in an optimizer step of their own at lr 3e-4.
    """
    return {
        "policies": [{"name": n, "model": str(ModelRef("zoo", n, zoo_seed))} for n in DEMO_POLICIES],
        "task": {"preset": "zoo", "test_size": 1000, "val_size": 200 if quick else 1000, "seed": 0, "reward": "exact"},
        "grpo": {"num_generations": 8, "learning_rate": 1e-4, "max_completion_length": 6,
                 "temperature": 1.0, "loss_type": "dr_grpo", "scale_rewards": "group", "dynamic_sampling": "skip"},
        "sharing": {"strategy": strategy, "sgt": {**SUPERVISED_STEP, "max_rows": 64},
                    "imitate": {**SUPERVISED_STEP, "max_rows": 64}, "self_imitate": dict(SUPERVISED_STEP)},
        "steps": steps or (60 if quick else 300),
        "prompts_per_step": 64,
        "eval_every": 20 if quick else 50,
        "eval_size": 400 if quick else 1000,
        "checkpoint_every": 1000,
        "scheduler": "local",
        "seed": seed,
    }


def run_demo(out: Path, *, quick: bool = False, arms: list[str] | None = None, seeds: list[int] | None = None,
             steps: int | None = None, force: bool = False, progress: bool = True, verbose: bool = False) -> Path:
    """Run the demo into ``out``; return the report path. The first arm prints MWRA's plan as a table, later
    plans (re-plans, the other arms' plans) one line each; ``verbose``: the whole table every time."""
    from mutualrl.algorithms.sharing import check_strategy_name
    from mutualrl.allocation.run_placement import PlanConsole
    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer
    from mutualrl.study.report import write_report
    from mutualrl.zoo import build_zoo

    arms = arms or list(DEMO_ARMS)
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
    if steps is None and not quick:
        steps = DEMO_STEPS
    t0 = time.perf_counter()
    print("[mutualrl demo] building / loading the policy zoo ...")
    build_zoo(DEMO_POLICIES, seed=0, progress=progress)
    run_dirs = []
    console = PlanConsole(verbose)  # one for every arm: the plan's table is printed once
    for seed in seeds:
        for arm in arms:
            cfg = load_config(demo_config(arm, seed, quick=quick, steps=steps))
            run_dir = out / f"{arm}-seed{seed}"
            print(f"[mutualrl demo] arm {arm}, seed {seed} -> {run_dir}")
            MutualTrainer(cfg, run_dir, progress=progress, console=console).train()
            run_dirs.append(run_dir)
    cfg0 = demo_config(arms[0], seeds[0], quick=quick, steps=steps)
    notes = [f"What ran: arms {', '.join(arms)}; seeds {', '.join(map(str, seeds))}; {cfg0['steps']} steps of "
             f"{cfg0['prompts_per_step']} prompts x {cfg0['grpo']['num_generations']} samples per policy; "
             f"{cfg0['eval_size']} held-out problems every {cfg0['eval_every']} steps"
             + (" (--quick)." if quick else ".")]
    report = write_report(run_dirs, out, title="mutualrl demo: the embedded default", notes=notes)
    print(f"[mutualrl demo] done in {time.perf_counter() - t0:.0f} s; report: {report}")
    return report
