"""The sharing study on the embedded default, a study definition on the library harness (:mod:`mutualrl.study`).

    python benchmarks/mutual.py [--jobs 2] [--reuse] [--final-seeds 0,1,2,3,4] [--tune-seeds 0]
        [--task-file FILE --zoo-seed N --name NAME] [--steps N] [--phase tune|headline|all] [--own-replay]

The two shipped zoo policies (or a ``zoo build --task`` file's), their task with 1,000 validation and
1,000 test problems, 64 prompts x 8 samples a step, 300 steps. The rounds:

1. **independent**, tuned on validation: learning rate (1e-4, 2e-4 and 3e-4 with 30 warm-up steps)
   and dynamic sampling (``skip``; ``resample``, one extra round). Every later arm takes the chosen
   GRPO settings.
2. the **single-model controls** and the **sharing arms**, each family tuned on validation:
   ``self_imitate`` (imitate's supervised step on the learner's own successes, no peer) at two
   learning rates of that step; the sharing family: ``imitate`` at those two rates, with
   replay of peer successes of the last steps, with its peer rows weighted up.
   With ``--own-replay`` a second round: the chosen sharing arm with the compute-matched control's own
   replay rows at the control's token budget (below), so that the two differ by the peers' rows alone.
3. the **compute-matched control**: the chosen ``self_imitate`` with more own rows a step (own
   verified successes of the last 16 steps) until it trains as many tokens a step as the chosen
   sharing arm did on the tuning seeds, so both take the same optimizer steps on (within 10 %) the
   same number of tokens; the **efficiency arm**
   (the chosen sharing arm plus ``prp`` with 4 own samples per prompt, the group filled with 4 of the
   peer's) and the single-model arms at that half budget.
4. every chosen arm on the final seeds (seed = prompt stream and sampling).

Writes ``benchmarks/results/NAME.json`` (default ``mutual``), ``NAME_runs/`` (every run's compact
metrics) and ``NAME_report/``. The headline is the peers' share: the best sharing arm minus the
strongest single-model baseline (both by validation), on test, per seed, with a 95 % interval.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import RESULTS

from mutualrl.study import Arm, Study, deep_merge

VAL_SIZE = 1000
TEST_SIZE = 1000
SUPERVISED = {"weight": 1.0, "max_rows": 64}


def independent_candidates() -> list[Arm]:
    """The GRPO settings tuned on validation (the other arms take the chosen ones)."""
    warm = {"warmup_steps": 30}
    rs = {"dynamic_sampling": "resample", "max_resample_rounds": 1}
    grid = {"independent": {}, "independent_lr2e-4w": {"learning_rate": 2e-4, **warm},
            "independent_lr3e-4w": {"learning_rate": 3e-4, **warm}, "independent_rs": rs,
            "independent_lr3e-4w_rs": {"learning_rate": 3e-4, **warm, **rs}}
    return [Arm(n, "independent", "baseline", {"grpo": g}) for n, g in grid.items()]


def control_candidates(grpo: dict[str, Any]) -> list[Arm]:
    return [Arm(f"self_imitate_lr{name}", "self_imitate", "baseline",
                {"grpo": grpo, "sharing": {"strategy": "self_imitate",
                                           "self_imitate": {"weight": 1.0, "learning_rate": lr}}})
            for name, lr in (("3e-4", 3e-4), ("1e-4", 1e-4))]


def sharing_candidates(grpo: dict[str, Any]) -> list[Arm]:
    def imitate(name: str, **extra: Any) -> Arm:
        block = {**SUPERVISED, "learning_rate": 3e-4, **extra}
        return Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": {"strategy": "imitate", "imitate": block}})

    return [imitate("imitate_lr3e-4"), imitate("imitate_lr1e-4", learning_rate=1e-4),
            imitate("imitate_replay4", replay_steps=4), imitate("imitate_peer2", peer_weight=2.0)]


def own_replay_candidates(best: Arm, tokens: int) -> list[Arm]:
    """The chosen sharing arm with the compute-matched control's own replay rows (the learner's own
    verified successes of earlier steps) filling the control's token budget after the peers' rows:
    the two arms then train the same tokens and differ by the peers' rows alone. Peer replay over the
    first round's window (4 steps when it had none) and over 16 (the control's own window)."""
    block = dict(best.overrides["sharing"]["imitate"])
    variants = {block.get("replay_steps") or 4: f"{best.name}_own"}
    variants.setdefault(16, f"{best.name}_own_replay16")
    return [Arm(name, "sharing", "sharing", deep_merge(best.overrides, {"sharing": {"imitate": {
                **block, "replay_steps": steps, "own_extra_rows": 512, "match_tokens": tokens}}}))
            for steps, name in variants.items()]


def float_lr(arm: Arm, step: str) -> dict[str, Any]:
    return dict(arm.overrides["sharing"][step])


def task_file_policies(path: str, zoo_seed: int = 0) -> tuple[list[str], dict[str, Any]]:
    """The policies a ``zoo build --task`` file names, built for ``zoo_seed`` (cached), and its task section."""
    from mutualrl.zoo.build import build_zoo
    from mutualrl.zoo.cli import task_specs

    task, specs, section = task_specs(path)
    dirs = build_zoo(list(specs), seed=zoo_seed, progress=False, specs=specs, task=task, task_section=section)
    return [str(dirs[n]) for n in specs], section


def zoo_seed_of(args: argparse.Namespace, seed: int) -> int:
    """The zoo build seed of a run: ``--zoo-seed``, or the run's seed with ``--zoo-seed-follows-seed``."""
    return seed if args.zoo_seed_follows_seed else args.zoo_seed


def build_study(args: argparse.Namespace) -> Study:
    from mutualrl.demo import demo_config

    def base(seed: int) -> dict[str, Any]:
        zs = zoo_seed_of(args, seed)
        cfg = demo_config("independent", seed, steps=args.steps, zoo_seed=zs)
        cfg["task"] = {**cfg["task"], "val_size": VAL_SIZE, "test_size": TEST_SIZE}
        if args.task_file:
            dirs, section = task_file_policies(args.task_file, zs)
            cfg["policies"] = [{"name": Path(d).name, "model": d} for d in dirs]
            cfg["task"] = {**section, "test_size": TEST_SIZE, "val_size": VAL_SIZE, "seed": 0, "reward": "exact"}
        cfg["sharing"] = {"strategy": "independent"}
        cfg["checkpoint_every"] = 50  # a killed study resumes a run instead of redoing it
        cfg["threads"] = 1  # fixed, so a run's numbers do not depend on what else the machine does
        return cfg

    return Study(args.name, base, Path(args.out), results=RESULTS, jobs=args.jobs, reuse=args.reuse,
                 final_seeds=[int(s) for s in args.final_seeds.split(",")])


def run(args: argparse.Namespace) -> None:
    study = build_study(args)
    tune, final = [int(s) for s in args.tune_seeds.split(",")], [int(s) for s in args.final_seeds.split(",")]
    ind = study.tune("independent", independent_candidates(), tune)
    grpo = ind.overrides["grpo"]
    controls, sharing = control_candidates(grpo), sharing_candidates(grpo)
    study.run((a, s) for a in controls + sharing for s in tune)  # both families at once (jobs in parallel)
    ctrl = study.tune("self_imitate", controls, tune)
    best = study.tune("sharing", sharing, tune)
    tokens = round(study.per_step(best, tune, "train_tokens"))
    budget_from, first_round = best.name, best
    if args.own_replay:
        best = study.tune("sharing_own", [best, *own_replay_candidates(best, tokens)], tune)
        study.notes.append(f"Second round of sharing candidates: the first round's choice with the compute-matched "
                           f"control's own replay rows up to the control's budget ({tokens} tokens a step), so the "
                           "arm and the control differ by the peers' rows alone; chosen on validation of the tuning "
                           "seeds against the first round's choice.")
    matched_block = {**float_lr(ctrl, "self_imitate"), "extra_rows": 512, "match_tokens": tokens, "replay_steps": 16}
    matched = Arm("self_imitate_matched", "self_imitate_matched", "baseline",
                  {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": matched_block}})
    half = {"grpo": {"num_generations": 4}}
    # the first round's choice: a second-round arm's token budget is the full budget's, not the half's
    eff = Arm("efficiency", "efficiency", "efficiency",
              deep_merge(first_round.overrides, {**half, "sharing": {
                  "strategy": f"{first_round.overrides['sharing']['strategy']}+prp", "prp": {"max_per_prompt": 4}}}))
    halves = [Arm(f"{a.name}_half", f"{a.family}_half", "half_baseline", deep_merge(a.overrides, half))
              for a in (ind, ctrl)]
    study.notes.append(f"compute-matched control: {ctrl.name} with own verified successes of the last 16 steps "
                       f"added until a step trains {tokens} tokens, what the chosen sharing arm {budget_from} trained a "
                       "step on the tuning seeds (the mean over the policies: one budget for both)")
    headline = (ind, ctrl, matched, best)
    if args.phase == "tune":
        study.run((a, s) for a in (matched, eff, *halves) for s in tune)
    elif args.phase == "headline":
        study.run((a, s) for s in final for a in headline)
    else:
        # the headline arms on every seed first, so an interrupted study has its peers' share
        study.run([(a, s) for s in final for a in headline] + [(a, s) for s in final for a in (eff, *halves)])
    study.arms = {a.name: a for a in (headline if args.phase == "headline" else (*headline, eff, *halves))}
    study.write({"task_file": args.task_file, "own_replay": args.own_replay,
                 "zoo_seed": "run seed" if args.zoo_seed_follows_seed else args.zoo_seed, "steps": args.steps,
                 "val_size": VAL_SIZE, "test_size": TEST_SIZE, "tune_seeds": tune})


def parser(name: str = "mutual", out: str = "runs/study_mutual") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default=name)
    ap.add_argument("--out", default=out)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tune-seeds", default="0")
    ap.add_argument("--final-seeds", default="0,1,2,3,4")
    ap.add_argument("--phase", choices=("tune", "headline", "all"), default="all",
                    help="tune: the tuning rounds only (and the derived arms on the tuning seeds); headline: every "
                    "chosen arm but the efficiency ones on the final seeds; all: the efficiency arms too")
    ap.add_argument("--own-replay", action="store_true",
                    help="a second round of sharing candidates: the first round's choice with the compute-matched "
                    "control's own replay rows at its token budget (differs from the control by the peers' rows)")
    ap.add_argument("--task-file", default=None)
    ap.add_argument("--zoo-seed", type=int, default=0, help="the zoo build seed of every run (0: the shipped zoo)")
    ap.add_argument("--zoo-seed-follows-seed", action="store_true",
                    help="each run's zoo build seed is its own seed (the policies are built per seed, cached)")
    return ap


if __name__ == "__main__":
    run(parser().parse_args())
