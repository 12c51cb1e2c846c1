"""The sharing study on the embedded default under the pre-registered plan of ``benchmarks/README.md``
("The sharing studies: pre-registered plan"), a study definition on the library harness (:mod:`mutualrl.study`).

    python benchmarks/mutual.py [--jobs 2] [--phase tune|all] [--final-seeds 1,...,8] [--tune-seeds 0]
        [--heldout-seed 20261207] [--task-file FILE --name NAME --reuse-from A,B] [--steps N]

The two zoo policies (or a ``zoo build --task`` file's), their task with 1,000 validation and 1,000
test problems, 64 prompts x 8 samples a step, 300 steps.

- **Tuning seed** (0: the shipped zoo build, the seed-0 splits; never a final seed). Every choice is
  made on its validation split; its runs read only the seed-0 test split that earlier studies read.
  Committed records of the same config are reused (``--reuse-from``: the first protocol's study and
  ``mutual_distill``). Families, each tuned on validation, every learning-rate grid extended past
  an edge choice (:func:`tune_grid`):

  1. **GRPO** (every other arm takes its choice): learning rates 1e-4 (no warm-up), 2e-4, 3e-4 and
     5e-4 (30 warm-up steps), each with and without dynamic resampling.
  2. **single-model imitation**, 9 candidates: ``self_imitate`` at supervised rates 1e-4, 3e-4 and
     5e-4; the **compute-matched control** (``self_imitate`` adding own verified successes of the last
     4 or 16 steps until each policy trains, a step, what that policy trained in the best sharing
     arm's run of the same seed) at those three rates and the two windows.
  3. **sharing**, 9 candidates: ``imitate`` at rates 1e-4 and 3e-4, with 4 steps of peer replay at
     3e-4 and 5e-4, with its peer rows weighted 2; ``distill`` at weights 0.5 and 2, alone and chained
     after ``imitate`` with replay.

- **Final seeds** (default 1-8, the plan's): each run on **its own zoo build** (build seed = run seed) and on a
  **fresh test split** (``task.heldout_seed``: problems none of the seed-0 splits or warm starts
  holds, read by no earlier run). Arms: the chosen GRPO, the chosen ``self_imitate``, the best sharing
  arm, and the chosen matched control with each policy's token budget read from the best sharing
  arm's run **of the same seed** (so the match holds per seed and per policy, not on averages).

Writes ``benchmarks/results/NAME.json`` (default ``mutual``), ``NAME_runs/`` (every run's compact
metrics) and ``NAME_report/``. The headline (``peers_share``, its pair's ``compute_match``): the best
sharing arm minus the strongest baseline inside the compute match; beside it, minus the strongest
single-model arm whatever its compute (``peers_share_any_compute``); on test, per seed, with 95 %
intervals.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _common import RESULTS, target_points

from mutualrl.study import Arm, Study, evidence

VAL_SIZE = 1000
TEST_SIZE = 1000
SUPERVISED = {"weight": 1.0, "max_rows": 64}
HELDOUT_SEED = 20261207
"""The fresh test split of the final seeds (``task.heldout_seed``), recorded in every final run's config."""
GRID_NEXT = {1e-4: 2e-4, 2e-4: 3e-4, 3e-4: 5e-4, 5e-4: 8e-4, 8e-4: 1.3e-3, 1.3e-3: 2e-3}
"""The learning rate after each on a grid extended upward (downward: the reverse, below 1e-4 halving)."""
MAX_EXTENSIONS = 3


def lr_name(lr: float) -> str:
    """``3e-4``, ``1.3e-3``: the names the first protocol gave its rates."""
    mantissa, exp = f"{lr:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exp)}"


def grpo_arm(lr: float, rs: bool) -> Arm:
    """GRPO at ``lr`` (1e-4: no warm-up, as the first protocol's ``independent``; else 30 warm-up
    steps), with one round of dynamic resampling when ``rs``."""
    grpo: dict[str, Any] = {} if lr == 1e-4 else {"learning_rate": lr, "warmup_steps": 30}
    if rs:
        grpo |= {"dynamic_sampling": "resample", "max_resample_rounds": 1}
    name = "independent" + ("" if lr == 1e-4 else f"_lr{lr_name(lr)}w") + ("_rs" if rs else "")
    return Arm(name, "independent", "baseline", {"grpo": grpo})


def self_imitate_arm(grpo: dict[str, Any], lr: float) -> Arm:
    return Arm(f"self_imitate_lr{lr_name(lr)}", "self_imitate", "baseline",
               {"grpo": grpo, "sharing": {"strategy": "self_imitate",
                                          "self_imitate": {"weight": 1.0, "learning_rate": lr}}})


def matched_arm(grpo: dict[str, Any], lr: float, replay: int) -> Arm:
    """The compute-matched control: ``self_imitate`` with up to 512 own earlier successes (of the
    last ``replay`` steps) a step, each policy's step held to its own token budget (set per seed by
    :meth:`~mutualrl.study.Study.matched_overrides`), as a floor and a ceiling (``match_ceiling``,
    the plan's amendment 3: whole GRPO groups left out where they alone pass it)."""
    block = {"weight": 1.0, "learning_rate": lr, "extra_rows": 512, "replay_steps": replay, "match_ceiling": True}
    return Arm(f"matched_lr{lr_name(lr)}_replay{replay}_ceiling", "matched", "baseline",
               {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": block}})


FINAL_MATCHED = "self_imitate_matched_ceiling"
"""The final round's matched control (amendment 3; ``self_imitate_matched``, without the ceiling, is
retired: on final seeds 1 and 2 it trained up to 1.38x the sharing arm's tokens)."""


def imitate_arm(grpo: dict[str, Any], variant: str, lr: float) -> Arm:
    """``imitate`` (its supervised step at ``lr``): ``plain``, ``replay4`` (peer successes of the last
    4 steps) or ``peer2`` (peer rows weighted 2). The first protocol's names where it ran them."""
    extra = {"plain": {}, "replay4": {"replay_steps": 4}, "peer2": {"peer_weight": 2.0}}[variant]
    names = {("plain", 3e-4): "imitate_lr3e-4", ("plain", 1e-4): "imitate_lr1e-4",
             ("replay4", 3e-4): "imitate_replay4", ("peer2", 3e-4): "imitate_peer2"}
    name = names.get((variant, lr), f"imitate_{variant}_lr{lr_name(lr)}")
    return Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": {
        "strategy": "imitate", "imitate": {**SUPERVISED, "learning_rate": lr, **extra}}})


def distill_arms(grpo: dict[str, Any]) -> list[Arm]:
    """The dense-signal candidates of ``benchmarks/mutual_distill.py``: ``distill`` at weight 0.5 (its
    default) and 2, alone and after ``imitate`` with 4 steps of replay."""
    best = {**SUPERVISED, "learning_rate": 3e-4, "replay_steps": 4}

    def arm(name: str, strategy: str, distill: dict[str, Any]) -> Arm:
        sharing = {"strategy": strategy, "distill": distill, **({"imitate": best} if "imitate" in strategy else {})}
        return Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": sharing})

    return [arm("distill", "distill", {}), arm("imitate_replay4+distill", "imitate+distill", {}),
            arm("distill_w2", "distill", {"weight": 2.0}),
            arm("imitate_replay4+distill_w2", "imitate+distill", {"weight": 2.0})]


def _step_lr(lr: float, up: bool, nxt: Mapping[float, float] = GRID_NEXT) -> float:
    if up:
        return nxt.get(lr, lr * 1.6)
    below = {v: k for k, v in nxt.items()}
    return below.get(lr, lr / 2)


def interior_tie(scores: Mapping[str, Mapping[str, Any]], chosen: str, by_name: Mapping[str, tuple[str, float]],
                 every: Sequence[float]) -> str | None:
    """The candidate whose validation ties ``chosen``'s (an edge choice) at a rate strictly inside
    ``every`` (the family's rates), the one nearest the rates' middle in log scale; None when none ties
    (the edge is then the best alone and the rule extends the grid)."""
    best = scores[chosen]["mean"]
    mid = (math.log(every[0]) + math.log(every[-1])) / 2
    inside = [(abs(math.log(lr) - mid), name) for name, (_, lr) in by_name.items()
              if name != chosen and every[0] < lr < every[-1] and scores[name]["mean"] == best]
    return min(inside)[1] if inside else None


def tune_grid(study: Study, family: str, grid: dict[str, tuple[Callable[[float], Arm], list[float]]],
              seeds: Sequence[int], fixed: Sequence[Arm] = (), nxt: Mapping[float, float] = GRID_NEXT) -> Arm:
    """Tune ``family`` on validation over every variant's learning-rate list (``grid``: variant ->
    (its arm at a rate, the rates)) and the ``fixed`` candidates; while the choice sits at the top or
    the bottom of the family's rates, add the chosen variant at the next rate out (``nxt``: each rate's
    next one up; down, the reverse, else halving) and tune again (at most :data:`MAX_EXTENSIONS`
    times). A choice at an edge that ties a candidate inside the rates on validation is not at an edge:
    the inside one is taken (:func:`interior_tie`). Records the grid and its extensions in the study's notes."""
    lrs = {v: sorted(rates) for v, (_, rates) in grid.items()}
    for extension in range(MAX_EXTENSIONS + 1):
        by_name = {grid[v][0](lr).name: (v, lr) for v in grid for lr in lrs[v]}
        cands = [grid[v][0](lr) for v in grid for lr in lrs[v]] + list(fixed)
        chosen = study.tune(family, cands, seeds)
        if chosen.name not in by_name:
            break
        variant, lr = by_name[chosen.name]
        every = sorted({r for rates in lrs.values() for r in rates})
        if lr not in (every[0], every[-1]):
            break
        tied = interior_tie(study.tuning[family]["candidates"], chosen.name, by_name, every)
        if tied is not None:  # the best validation is reached inside the rates too: the choice is not at an edge
            study.notes.append(f"{family}: {chosen.name} at an edge of the family's rates {every} ties {tied} inside "
                               f"them on validation; {tied} chosen, the grid not extended")
            chosen = next(c for c in cands if c.name == tied)
            study.tuning[family]["chosen"] = tied
            break
        if extension == MAX_EXTENSIONS:  # the rates stay the ones trained: a miss the notes state
            study.notes.append(f"{family}: {chosen.name} still at an edge of the family's rates {every} after "
                               f"{MAX_EXTENSIONS} extensions; the grid was not extended further")
            break
        nxt_lr = _step_lr(lr, up=lr == every[-1], nxt=nxt)
        study.notes.append(f"{family}: {chosen.name} chosen at the {'top' if lr == every[-1] else 'bottom'} of the "
                           f"family's rates {every}; {variant} added at {nxt_lr:g}")
        lrs[variant] = sorted({*lrs[variant], nxt_lr})
    study.tuning[family]["rates"] = {v: rates for v, rates in lrs.items()}
    return chosen


def task_file_policies(path: str, zoo_seed: int = 0) -> tuple[list[str], dict[str, Any]]:
    """The policies a ``zoo build --task`` file names, built for ``zoo_seed`` (cached), and its task section."""
    from mutualrl.zoo.build import build_zoo
    from mutualrl.zoo.cli import task_specs

    task, specs, section = task_specs(path)
    dirs = build_zoo(list(specs), seed=zoo_seed, progress=False, specs=specs, task=task, task_section=section)
    return [str(dirs[n]) for n in specs], section


def study_task_section(args: argparse.Namespace, seed: int, tune: Sequence[int]) -> dict[str, Any]:
    """The ``task:`` section of the study's run on ``seed`` (no zoo build needed): the zoo's, or the task
    file's; a final run reads the fresh test split (``heldout_seed``), a tuning run the one earlier
    runs read."""
    from mutualrl.demo import demo_config

    if args.task_file:
        from mutualrl.zoo.cli import task_specs

        section = {**task_specs(args.task_file)[2], "test_size": TEST_SIZE, "val_size": VAL_SIZE, "seed": 0,
                   "reward": "exact"}
    else:
        section = {**demo_config("independent", seed)["task"], "val_size": VAL_SIZE, "test_size": TEST_SIZE}
    if seed not in tune:
        section["heldout_seed"] = args.heldout_seed
    return section


def build_study(args: argparse.Namespace) -> Study:
    from mutualrl.demo import demo_config

    tune = [int(s) for s in args.tune_seeds.split(",")]
    final = [int(s) for s in args.final_seeds.split(",")]
    if set(tune) & set(final):
        raise SystemExit(f"--final-seeds {final} and --tune-seeds {tune} share a seed: the tuning seed is never a "
                         "final seed (the plan of benchmarks/README.md)")

    def base(seed: int) -> dict[str, Any]:
        zs = seed if args.zoo_seed_follows_seed else 0  # each final seed on its own build; tuning on build 0
        cfg = demo_config("independent", seed, steps=args.steps, zoo_seed=zs)
        if args.task_file:
            dirs, _ = task_file_policies(args.task_file, zs)
            cfg["policies"] = [{"name": Path(d).name, "model": d} for d in dirs]
        cfg["task"] = study_task_section(args, seed, tune)
        cfg["sharing"] = {"strategy": "independent"}
        cfg["checkpoint_every"] = 50  # a killed study resumes a run instead of redoing it
        cfg["threads"] = 1  # fixed, so a run's numbers do not depend on what else the machine does
        return cfg

    reuse_from = [s for s in args.reuse_from.split(",") if s]
    return Study(args.name, base, Path(args.out), results=RESULTS, jobs=args.jobs, reuse=True,
                 reuse_from=reuse_from, reuse_from_seeds=tune, final_seeds=final, target=args.target)


def tune_all(study: Study, tune: list[int]) -> tuple[Arm, Arm, Arm, Arm]:
    """The tuning rounds on the tuning seeds: (GRPO, self_imitate, the best sharing arm, the matched
    control) as chosen on validation."""
    ind = tune_grid(study, "independent", {"plain": (lambda lr: grpo_arm(lr, False), [1e-4, 2e-4, 3e-4, 5e-4]),
                                           "rs": (lambda lr: grpo_arm(lr, True), [1e-4, 3e-4, 5e-4])}, tune)
    grpo = ind.overrides["grpo"]
    best = tune_grid(study, "sharing", {
        "plain": (lambda lr: imitate_arm(grpo, "plain", lr), [1e-4, 3e-4]),
        "replay4": (lambda lr: imitate_arm(grpo, "replay4", lr), [3e-4, 5e-4]),
        "peer2": (lambda lr: imitate_arm(grpo, "peer2", lr), [3e-4])}, tune, fixed=distill_arms(grpo))
    ctrl = tune_grid(study, "self_imitate", {"lr": (lambda lr: self_imitate_arm(grpo, lr), [1e-4, 3e-4, 5e-4])}, tune)
    budgets = {s: study.policy_budget(best, s) for s in tune}
    samples, tag = matched_samples(study, best, tune, budgets)

    def matched(replay: int) -> Callable[[float], Arm]:
        def make(lr: float) -> Arm:
            arm = matched_arm(grpo, lr, replay)
            arm.name += tag
            arm.seed_overrides = {s: study.matched_overrides(s, "self_imitate", budgets[s], samples[s]) for s in tune}
            return arm
        return make

    grid = {"replay4": (matched(4), [1e-4, 3e-4, 5e-4]), "replay16": (matched(16), [1e-4, 3e-4, 5e-4])}
    held = tune_grid(study, "matched", grid, tune)
    current = {grid[v][0](lr).name for v, rates in study.tuning["matched"]["rates"].items() for lr in rates}
    retired = {r["arm"]: r for r in study.records_matching("matched_lr", tune) if r["arm"] not in current}
    if retired:
        study.notes.append("matched control candidates retired by the amendments (amendment 1: 8 samples a prompt, "
                           "outside the FLOPs match; amendment 3: no ceiling on the budget; committed as they ran), "
                           "validation: " + ", ".join(f"{a} {100 * (evidence.final_accuracy(r, 'val') or 0):.1f}"
                                                     for a, r in sorted(retired.items())))
    return ind, ctrl, best, held


def flops_only_inside(ratios: Mapping[str, Any], flops_only: Sequence[str]) -> bool:
    """Whether :func:`evidence.policy_ratios`'s ``ratios`` are inside the match with the ``flops_only``
    policies judged on their FLOPs alone (amendment 5): the others on all three quantities, and every
    ``flops_only`` policy must have a FLOPs ratio (one without is outside, never passed unjudged)."""
    drop = set(flops_only)
    if any(p not in ratios.get("flops", {}) for p in drop):
        return False
    kept = {k: v if k in ("seeds", "flops") else {p: c for p, c in v.items() if p not in drop}
            for k, v in ratios.items()}
    return evidence.inside_match(kept)


def match_on(study: Study, held: Arm, best: Arm, seeds: Sequence[int], what: str,
             flops_only: Sequence[str] = ()) -> bool:
    """Whether ``held`` is inside the compute match of ``best`` on ``seeds`` (each policy's trained
    tokens, optimizer steps and FLOPs within 10 % either way on every seed: ``evidence.inside_match``),
    noted in the study and shown, with the ratios farthest from 1 per policy. ``flops_only``: policies
    judged on their FLOPs alone (:func:`check_inside_match`); the note says so and still shows every
    ratio, and the strict verdict beside it."""
    ratios = evidence.policy_ratios(study.records(held, seeds) + study.records(best, seeds), held.name, best.name)
    worst = {k: {p: round(v, 3) for p, v in by_p.items()} for k, by_p in evidence.farthest(ratios).items()}
    strict = evidence.inside_match(ratios)
    inside = flops_only_inside(ratios, flops_only) if flops_only else strict
    verdict = (f"{'inside' if inside else 'OUTSIDE'} the gate's terms ({', '.join(flops_only)} judged on FLOPs "
               f"alone), {'inside' if strict else 'OUTSIDE'} the match on all three" if flops_only
               else f"{'inside' if inside else 'OUTSIDE'} the match")
    line = (f"matched control {held.name} against {best.name} on {what} {list(seeds)}: {verdict} (ratios per "
            f"policy, the farthest from 1: {worst})")
    study.notes.append(line)
    study.say(line)
    return inside


def check_inside_match(study: Study, held: Arm, best: Arm, seeds: Sequence[int], *, smoke: bool = False,
                       flops_only: Sequence[str] = ()) -> None:
    """Stop before any final seed unless the chosen matched control is inside the match (each policy's
    trained tokens, optimizer steps and FLOPs within 10 % of ``best``'s) on the tuning ``seeds``: the
    plan's gate (``benchmarks/README.md``, the amendment). Noted in the study either way. ``smoke``: a
    smoke test's few steps, where a policy trains on one or two of them and the per-step budget cannot
    match: the verdict is shown and noted, and the run goes on to exercise the final round.
    ``flops_only``: policies whose own successes cannot reach their budget even with more samples, given
    the compute as own samples instead (the real pair's amendment 5): the gate judges their FLOPs alone;
    the JSON's ``compute_match`` still judges all three."""
    if not match_on(study, held, best, seeds, "the tuning seeds", flops_only):
        if smoke:
            line = "smoke test: the gate would stop a study here; going on to exercise the final round"
            study.notes.append(line)
            study.say(line)
            return
        raise SystemExit(f"the chosen matched control {held.name} is not inside the compute match of {best.name} on "
                         f"the tuning seeds {list(seeds)} (the study's notes give the ratios); the plan stops here, "
                         "before any final seed: change how the control gets its compute and amend the plan")


def check_split(section: Callable[[int], Mapping[str, Any]], tune: Sequence[int], final: Sequence[int],
                notes: list[str]) -> dict[str, Any]:
    """The fresh test split, checked before any final seed: the final runs' task (``task.heldout_seed``)
    against the tuning seed's (the seed-0 splits every earlier run of this study read, whose training
    lists the zoo builds warm-started on). Stops the study unless no test question of the final runs
    is in any seed-0 split and every final seed reads the same test split (the pairs are per seed,
    the problems shared). Validation stays the seed-0 one (choices only, read by every run)."""
    from mutualrl.config.resolve import resolve_task
    from mutualrl.tasks.build import build_task

    def task(seed: int) -> Any:
        return build_task(resolve_task(dict(section(seed)), check_paths=False))

    def questions(t: Any, split: str) -> set[str]:
        return {p.question for ps in t.split(split).values() for p in ps}

    earlier = task(tune[0])
    fresh = {s: task(s) for s in final}
    shared = fresh[final[0]].heldout_check([earlier])
    same = all(questions(t, "test") == questions(fresh[final[0]], "test") for t in fresh.values())
    out = {"heldout_seed": section(final[0]).get("heldout_seed"),
           "test_size": len(questions(fresh[final[0]], "test")),
           "test_questions_in_seed0_splits": shared[f"test/{earlier.seed}"],
           "val_questions_in_seed0_splits": shared[f"val/{earlier.seed}"], "one_test_split_for_every_final_seed": same,
           "checked_against": "the tuning seed's task: its training (the zoo builds' warm-start lists), validation and "
                              "test splits"}
    notes.append(f"fresh test split: {out['test_size']} problems, {out['test_questions_in_seed0_splits']} of them "
                       f"in the seed-0 splits (training, validation, test); the same split on every final seed: {same}")
    if out["test_questions_in_seed0_splits"] or not same:
        raise SystemExit(f"the final runs' test split is not fresh ({out}): the plan stops here, before any final seed")
    return out


def matched_samples(study: Study, best: Arm, tune: Sequence[int],
                    budgets: Mapping[int, Mapping[str, int]]) -> tuple[dict[int, dict[str, int]], str]:
    """The matched control candidates' samples a prompt on each tuning seed (:func:`control_samples`)
    and the suffix their names take where any policy samples more (``_samples12``; empty where none
    does), with the note that states the candidates' budgets and samples."""
    samples = {s: control_samples(study, best, s) for s in tune}
    tag = "".join(sorted({f"_samples{n}" for per in samples.values() for n in per.values()}))
    study.notes.append(f"matched control candidates: each policy's token budget a step is what it trained a step in "
                       f"{best.name}'s run of the same seed, on the tuning seeds {dict(budgets)}"
                       + (f"; samples a prompt raised to spend in sampling what the policy spent sampling and scoring "
                          f"its peers' samples in that run (FLOPs matched): {samples}" if tag else ""))
    return samples, tag


def control_samples(study: Study, best: Arm, seed: int) -> dict[str, int]:
    """The policies whose matched control samples more, with their samples a prompt: those that spent
    FLOPs scoring their peers' samples in ``best``'s run of ``seed`` (``distill``) spend them in own
    samples instead (:meth:`~mutualrl.study.Study.scoring_samples`), so trained tokens, optimizer steps
    and FLOPs all stay within the match."""
    return study.scoring_samples(best, seed, int(study.base_config(seed)["grpo"]["num_generations"]))


def final_round(study: Study, arms: tuple[Arm, Arm, Arm, Arm], final: list[int], chunk: int,
                name: str = FINAL_MATCHED,
                match: Callable[[int, Mapping[str, int]], dict[str, Any]] | None = None,
                flops_only: Sequence[str] = ()) -> list[Arm]:
    """The chosen arms on the final seeds, ``chunk`` seeds at a time (so an interrupted study keeps
    whole seeds): GRPO, ``self_imitate`` and the best sharing arm first, then the matched control
    (``name``) with each policy's budget from the best sharing arm's run of that seed (``match``: seed,
    budget -> that run's overrides; default :meth:`~mutualrl.study.Study.matched_overrides`).
    ``flops_only``: as :func:`check_inside_match`, for the notes on each chunk's match."""
    ind, ctrl, best, held = arms
    match = match or (lambda s, budget: study.matched_overrides(s, "self_imitate", budget,
                                                                control_samples(study, best, s)))
    matched = Arm(name, "matched", "baseline", held.overrides)
    for i in range(0, len(final), chunk):
        seeds = final[i:i + chunk]
        study.run([(best, s) for s in seeds] + [(a, s) for s in seeds for a in (ind, ctrl)])
        for s in seeds:
            matched.seed_overrides[s] = match(s, study.policy_budget(best, s))
        study.run((matched, s) for s in seeds)
        match_on(study, matched, best, seeds, "final seeds", flops_only)  # reported as each chunk lands, never a stop
    scheduled = any("match_schedule" in p.get("sharing", {}).get("self_imitate", {})
                    for o in matched.seed_overrides.values() for p in o.get("policies", []))
    study.notes.append(f"{name}: {held.name} with each policy's token budget a step"
                       + (" (and step by step: match_schedule)" if scheduled else "")
                       + f" from {best.name}'s run of the same final seed, and the samples a prompt its overrides "
                       "give a policy that samples more: "
                       + "; ".join(f"seed {s}: {study.policy_budget(best, s)}"
                                   + (f", samples {more}" if (more := override_samples(matched.seed_overrides[s])) else "")
                                   for s in final if s in matched.seed_overrides))
    return [ind, ctrl, best, matched]


def override_samples(overrides: Mapping[str, Any]) -> dict[str, int]:
    """The samples a prompt a run's overrides give each policy that has its own
    (``policies[i].grpo.num_generations``)."""
    return {p["name"]: int(p["grpo"]["num_generations"]) for p in overrides.get("policies", [])
            if "num_generations" in p.get("grpo", {})}


RETIRED_FINAL = "self_imitate_matched"
"""The final matched arm amendment 3 retired (no ceiling: over the sharing arm's tokens on seeds 1-2)."""


def retired_final_note(study: Study, best: Arm, final: Sequence[int]) -> None:
    """A sensitivity note, written once every final seed has run: the retired matched control's runs
    (:data:`RETIRED_FINAL`, seeds 1 and 2 of the zoo), each seed's test accuracy and its trained tokens
    over ``best``'s per policy, beside the headline (it is not a headline arm)."""
    old = Arm(RETIRED_FINAL, "matched", "baseline", {})
    runs = study.records(old, final)
    if not runs:
        return
    ratios = evidence.policy_ratios(runs + study.records(best, final), old.name, best.name)
    tokens = {p: [round(v, 2) for v in c["values"]] for p, c in ratios.get("trained_tokens", {}).items()}
    study.notes.append(f"retired by amendment 3 (no ceiling), reported for sensitivity, not a headline arm: "
                       f"{old.name} on seeds {[r['seed'] for r in runs]}, test accuracy "
                       f"{[round(100 * (evidence.final_accuracy(r, 'test') or 0), 1) for r in runs]}, trained tokens "
                       f"over {best.name}'s per policy {tokens}")


def run(args: argparse.Namespace) -> None:
    study = build_study(args)
    tune, final = [int(s) for s in args.tune_seeds.split(",")], [int(s) for s in args.final_seeds.split(",")]
    arms = tune_all(study, tune)
    if args.phase == "tune":
        study.arms = {a.name: a for a in arms}
        study.write({"phase": "tune"}, report=False)
        return
    check_inside_match(study, arms[3], arms[2], tune)
    split = check_split(lambda s: study_task_section(args, s, tune), tune, final, study.notes)
    headline = final_round(study, arms, final, args.chunk)
    retired_final_note(study, arms[2], final)
    study.arms = {a.name: a for a in headline}
    study.write({"task_file": args.task_file, "zoo_seed": "run seed (tuning seed: build 0)"
                 if args.zoo_seed_follows_seed else 0, "steps": args.steps, "val_size": VAL_SIZE,
                 "test_size": TEST_SIZE, "tune_seeds": tune, "heldout_seed": args.heldout_seed, "split_check": split,
                 "plan": "benchmarks/README.md#the-sharing-studies-pre-registered-plan"})


def parser(name: str = "mutual", out: str = "runs/study_mutual",
           reuse_from: str = "mutual_protocol1,mutual_distill") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default=name)
    ap.add_argument("--out", default=out)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tune-seeds", default="0")
    ap.add_argument("--final-seeds", default="1,2,3,4,5,6,7,8", help="the plan's final seeds (zoo: 1-8)")
    ap.add_argument("--target", type=target_points, default=5.0,
                    help="the plan's target for the peers' share in points (zoo 5, task mix 3): the JSON's verdict")
    ap.add_argument("--chunk", type=int, default=2, help="final seeds run together (the study keeps whole seeds)")
    ap.add_argument("--heldout-seed", type=int, default=HELDOUT_SEED,
                    help="task.heldout_seed of the final runs: their fresh test split")
    ap.add_argument("--reuse-from", default=reuse_from,
                    help="studies whose tuning-seed records of the same config are reused (comma-separated)")
    ap.add_argument("--phase", choices=("tune", "all"), default="all",
                    help="tune: the tuning rounds only; all: then the final seeds")
    ap.add_argument("--task-file", default=None)
    ap.add_argument("--no-zoo-seed-follows-seed", dest="zoo_seed_follows_seed", action="store_false",
                    help="every run on zoo build 0 (the first protocol's design; the plan asks for a build per seed)")
    return ap


if __name__ == "__main__":
    run(parser().parse_args())
