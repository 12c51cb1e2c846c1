"""``distill`` on validation, beside the current best sharing arm and the strongest single-model
control: a study definition on the library harness (:mod:`mutualrl.study`), the tuning round of
``benchmarks/mutual.py`` with the dense-signal candidates added.

    python benchmarks/mutual_distill.py [--jobs 2] [--tune-seeds 0] [--steps 300]

Same design as ``benchmarks/mutual.py`` (the shipped zoo, 64 prompts x 8 samples, 300 steps,
1,000 validation problems): the chosen GRPO settings, the ``self_imitate`` controls and the
``imitate`` family are taken from ``results/mutual_protocol1_runs/`` (the first protocol's study) where a committed record of the same
config exists (``reuse_from``, tuning seeds only), and the new candidates train:

- ``distill``: the learner's own rows plus a better peer's chunk-level scores (defaults: weight 0.5,
  clip 1 nat), and ``distill_w2`` (weight 2);
- ``imitate_replay4+distill`` (and ``_w2``): the current best (``imitate`` with 4 steps of replay)
  with the scores. Four dense-signal candidates, as many as the ``imitate`` family has.

Validation only: no test problem is read here (the final studies of the evidence issue take these
arms as candidates and read test on fresh seeds). Writes ``results/mutual_distill.json`` with each
arm's validation accuracy per policy and per task type, trained tokens and FLOPs (sampling, scoring,
update: recorded by the runs of this revision; older records have none).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import RESULTS
from mutual import (
    VAL_SIZE,
    distill_arms,
    grpo_arm,
    imitate_arm,
    self_imitate_arm,
)

from mutualrl.study import Arm, Study


def build_study(args: argparse.Namespace) -> Study:
    from mutualrl.demo import demo_config

    def base(seed: int) -> dict[str, Any]:
        cfg = demo_config("independent", seed, steps=args.steps, zoo_seed=0)
        cfg["task"] = {**cfg["task"], "val_size": VAL_SIZE, "test_size": 1000}
        cfg["sharing"] = {"strategy": "independent"}
        cfg["checkpoint_every"] = 50
        cfg["threads"] = 1
        return cfg

    tune = [int(s) for s in args.tune_seeds.split(",")]
    return Study(args.name, base, Path(args.out), results=RESULTS, jobs=args.jobs, reuse=True,
                 reuse_from=["mutual_protocol1"], reuse_from_seeds=tune, final_seeds=tune)


def validation_table(study: Study, arms: list[Arm], seeds: list[int]) -> dict[str, Any]:
    """Per arm and policy: final validation accuracy (overall and per task type), trained tokens a
    step, and FLOPs a run by phase (sampling, scoring, update) where the records hold them."""
    out: dict[str, Any] = {}
    for arm in arms:
        per: dict[str, Any] = {}
        for r in study.records(arm, seeds):
            for p in r["policies"]:
                last = [e for e in r["evals"] if e["policy"] == p and e.get("event") == "eval"][-1]
                steps = [s for s in r["steps"] if s["policy"] == p]
                flops = {k: sum(s.get(k, 0.0) for s in steps) for k in ("flops_sampling", "flops_scoring", "flops_update")}
                per.setdefault(p, []).append({
                    "seed": r["seed"], **{k: v for k, v in last.items() if k.startswith("val_acc")},
                    "train_tokens_per_step": sum(s.get("train_tokens", 0) for s in steps) / max(1, len(steps)),
                    **({"flops": flops} if any(flops.values()) else {}),
                    **({"distill_rows_per_step": sum(s.get("distill_rows", 0) for s in steps) / max(1, len(steps))}
                       if any("distill_rows" in s for s in steps) else {})})
        out[arm.name] = per
    return out


def run(args: argparse.Namespace) -> None:
    study = build_study(args)
    tune = [int(s) for s in args.tune_seeds.split(",")]
    ind = study.tune("independent", [grpo_arm(1e-4, False), grpo_arm(2e-4, False), grpo_arm(3e-4, False),
                                     grpo_arm(1e-4, True), grpo_arm(3e-4, True)], tune)
    grpo = ind.overrides["grpo"]
    controls = [self_imitate_arm(grpo, 3e-4), self_imitate_arm(grpo, 1e-4)]
    sharing = [imitate_arm(grpo, "plain", 3e-4), imitate_arm(grpo, "plain", 1e-4), imitate_arm(grpo, "replay4", 3e-4),
               imitate_arm(grpo, "peer2", 3e-4)] + distill_arms(grpo)
    study.run((a, s) for a in controls + sharing for s in tune)
    ctrl = study.tune("self_imitate", controls, tune)
    best = study.tune("sharing", sharing, tune)
    study.notes.append("validation only (tuning seeds); distill candidates beside the imitate family; the chosen "
                       f"sharing arm is {best.name}, the strongest control {ctrl.name}")
    study.arms = {a.name: a for a in (ind, ctrl, *sharing)}
    study.write({"steps": args.steps, "val_size": VAL_SIZE, "tune_seeds": tune, "validation_only": True,
                 "validation": validation_table(study, [ind, *controls, *sharing], tune),
                 "read_me": "the tuning seeds' validation is the evidence here; any test figure aggregated over "
                            "them is the tuning seed's and is not a result"}, report=False)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="mutual_distill")
    ap.add_argument("--out", default="runs/study_mutual_distill")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tune-seeds", default="0")
    return ap


if __name__ == "__main__":
    run(parser().parse_args())
