"""Real models trained together: SmolLM2-135M-Instruct (Llama, 49k BPE) x Gemma-3-270M (Gemma, 262k
SentencePiece), from PyPI wheels, offline, under the pre-registered plan of ``benchmarks/README.md``
("The sharing studies: pre-registered plan"): a study definition on the library harness
(:mod:`mutualrl.study`) with the zoo study's tuning and final round (``benchmarks/mutual.py``).

    python benchmarks/mutual_real_small.py [--jobs 1] [--phase tune|all] [--final-seeds 1,...,14]
        [--tune-seeds 0] [--zero-shot-from RESULT.json] [--name mutual_real_small] [--quick]

1. **Zero-shot study on validation problems**: greedy exact accuracy of both models on candidate
   reasoning-gym task types (``--zero-shot-size`` validation problems each, held out of every test
   question the type could have in the study's task) under each model's prompt formats and two
   answer extractions. Each model keeps its best format; the extraction is the one best for both;
   the pair of types is the most complementary (or, with none, the one both partly solve best);
   types a constant answer solves 10 % of the time are left out. The chosen pair's task is then
   built once, before any run: a type whose problem space cannot supply the fresh split below stops
   the study with a message.
2. **Splits.** Every run, tuning and final, has ``task.heldout_seed: 20261207`` and
   ``task.val_like_test: true``: validation and test (200 problems per type each) are cut at random
   from one fresh pool per type, problems that none of the seed-0 splits holds (those the first
   protocol's runs trained and were tested on), so validation is distributed like test, type by type.
   Training keeps the seed-0 lists; a run's seed is its prompt stream's and its sampling's.
3. **Tuning** on the tuning seed (0; never a final seed: the script refuses one in both lists).
   Every family is chosen on the final validation accuracy (the mean over the two policies), and
   every grid is extended while its choice sits at an edge (:func:`mutual.tune_grid`). The
   supervised rows join the GRPO step, as in the first protocol (no optimizer step of their own), so
   their **weight** is the supervised step size both sides tune; its grid steps 0.25, 0.5, 1, 2, 4, 8.

   - **GRPO** (every other arm takes its choice): learning rates 5e-6, 1e-5, 3e-5 (the first
     protocol chose 1e-5, the bottom of {1e-5, 3e-5}).
   - **Single-model imitation, 10 candidates**: ``self_imitate`` at weights 0.5, 1, 2, 4 (4); the
     compute-matched control (``self_imitate`` adding the policy's own verified successes of the
     last 4 or 16 steps until it trains, step by step, what that policy trained in the best sharing
     arm's run of the same seed) at weights 0.5, 1, 2 x both windows (6); where a policy is short,
     the fallback below (not a candidate: amendment 5).
   - **Sharing, 10 candidates**: ``imitate`` at weights 1 and 2 (2); with 4 steps of peer replay at
     0.5, 1 and 2 (3); with replay and the peer rows weighted 2 (1); ``distill`` at weights 0.5 and 2,
     alone and chained after ``imitate`` with replay (4).

   **A policy its own replay cannot match** (plan amendment 5). In the first protocol Gemma-3 solved
   too little to replay (its control trained 10-28 tokens a step against the sharing arm's 112-137),
   and zero-shot it solves none of add, sub or mul: no control made of its own successes can train
   what its peer's successes give it. When the matched candidate chosen on validation leaves a policy
   below 1/1.1 of its budget on the tuning seed, the matched control is ``<chosen>_more_samples``: that
   candidate with the short policy given the compute as own samples, as many completions a prompt as
   spend that policy's FLOPs a step in the best sharing arm's run of the same seed (sampling, scoring
   and update) less the control's own update FLOPs (:func:`fallback_samples`, at most 32): first the
   chosen candidate's, then, if the fallback's FLOPs miss by more than 10 % on the tuning seed, the
   fallback's own, once (``_resized``); the final seeds take the chosen fallback's own. A short policy
   under half its budget is **FLOPs-only**: trained without the token ceiling (its tokens are not
   judged; the ceiling would drop whole groups of the samples it pays for) and judged by the gate on
   FLOPs alone; the other policy is judged on all three. The JSON's ``compute_match`` still judges
   all three for every policy, so the headline reports ``inside_match: false`` (near certain for
   Gemma-3), and the share against this control is reported beside it (the plan). It runs on the final
   seeds as ``self_imitate_matched_ceiling_more_samples``. Every matched candidate takes each
   policy's budget step by step (``match_schedule``: what the policy trained at each step of the best
   sharing arm's run of the same seed, 0 where it trained nothing), so its optimizer steps fall where
   the sharing arm's did (:func:`matched_on`).
4. **Final seeds** (default 1-14, the plan's): the chosen GRPO, ``self_imitate``, the best sharing
   arm and the chosen matched control, whose per-policy budget is read from the best sharing arm's
   run of the same seed (:meth:`~mutualrl.study.Study.policy_budget`). 100 steps of 4 prompts x 4
   samples; the test split is read once, at the end of each run.

Writes ``benchmarks/results/NAME.json`` (the peers' share with its interval, per arm and policy
accuracy and compute, the zero-shot table and choice, the split check, the pair's THL residual),
``NAME_runs/`` and ``NAME_report/``. A run takes about 10 minutes on 2 cores: run it alone. The
first protocol's study must be archived first (``NAME_protocol1``, as the zoo's and the task mix's
were): the script will not write over its records.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mutual
from _common import RESULTS, target_points

from mutualrl.study import Arm, Study, deep_merge, evidence

if TYPE_CHECKING:
    from mutualrl.tasks import Task

ROOT = Path(__file__).resolve().parent.parent
TWO = {"min_terms": 2, "max_terms": 2, "allow_parentheses": False, "allow_negation": False}
CANDIDATES: dict[str, dict[str, Any]] = {
    "add": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 2, "max_digits": 2, "operators": ["+"]}},
    "sub": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 2, "max_digits": 2, "operators": ["-"]}},
    "mul": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 1, "max_digits": 2, "operators": ["*"]}},
    "gcd": {"name": "gcd", "config": {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 40}},
    "legs": {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "min_instances": 1,
                                                "max_instances": 3}},
}
"""Task types both small models might partly solve. The study needs, per type, 400 fresh problems
(validation and test) outside the seed-0 test and training lists: ``gcd``'s space is too small for
that (the up-front check refuses it; the constant-answer rule leaves it out first)."""

FORMATS: dict[str, list[dict[str, Any]]] = {
    "smollm2": [{"prompt_template": "chat", "system_prompt": "Answer with only the final number."},
                {"prompt_template": "Question: {question}\nAnswer:"},
                {"prompt_template": "{question} Answer: "}],
    "gemma3": [{"prompt_template": "Question: {question}\nAnswer:"},
               {"prompt_template": "{question} Answer: "},
               {"prompt_template": "Q: {question}\nA:"}],
}
EXTRACTIONS = ("first_number", "last_number")
TEST_PER_TYPE = 200
"""Validation and test problems per task type, each."""
TRAIN_SIZE = 4000
"""Training problems of the study's task (both types together)."""
HELDOUT_SEED = mutual.HELDOUT_SEED
"""``task.heldout_seed`` of every run: the fresh validation and test pool (the plan's)."""


def study_task_section(types: list[str], extraction: str, per_type: int) -> dict[str, Any]:
    """The ``task:`` section of the study's runs on ``types``: validation and test, ``per_type`` each
    per type, cut from one fresh pool per type (``heldout_seed``, ``val_like_test``)."""
    return {"datasets": [{**CANDIDATES[t], "alias": t} for t in types], "answer_extraction": extraction,
            "test_size": per_type * len(types), "val_size": per_type * len(types), "train_size": TRAIN_SIZE,
            "reward": "exact", "seed": 0, "heldout_seed": HELDOUT_SEED, "val_like_test": True}


def study_task(types: list[str], per_type: int, extraction: str = "last_number", heldout: bool = True) -> Task:
    """The :class:`~mutualrl.tasks.Task` of the study's runs on ``types`` (``heldout=False``: the same
    task on the seed-0 splits, those the first protocol's runs read). ``ValueError`` when a type's
    problem space cannot supply its fresh pool."""
    from mutualrl.config.resolve import resolve_task
    from mutualrl.tasks.build import build_task

    section = study_task_section(types, extraction, per_type)
    if not heldout:
        section = {k: v for k, v in section.items() if k not in ("heldout_seed", "val_like_test")}
    return build_task(resolve_task(section, check_paths=False))


def study_test_questions(per_type: int = TEST_PER_TYPE) -> dict[str, set[str]]:
    """Per candidate type, every test question it could have in the study's task: the study holds
    any two candidates in either order, and a type's splits depend on its place in the list (not on
    the other type), so the task is built for ordered pairs until every type has been seen at both
    places. A pair whose fresh pool cannot be drawn is no task the study can run (the up-front check
    refuses it): it holds no test question."""
    out: dict[str, set[str]] = {t: set() for t in CANDIDATES}
    seen: set[tuple[str, int]] = set()
    for pair in itertools.permutations(CANDIDATES, 2):
        if all((t, i) in seen for i, t in enumerate(pair)):
            continue
        try:
            task = study_task(list(pair), per_type)
        except ValueError:
            continue
        for i, t in enumerate(pair):
            out[t] |= {p.question for p in task.test[t]}
            seen.add((t, i))
    return out


def zero_shot_problems(n: int, per_type: int = TEST_PER_TYPE) -> tuple[Any, dict[str, list[Any]]]:
    """The zero-shot study's task and its ``n`` validation problems per candidate type, none of them a
    test question the type could have in the study's task (:func:`study_test_questions`, the study's
    test split being ``per_type`` problems a type), removed by text before the ``n`` are taken."""
    from mutualrl.tasks import GymSource, Task

    sources = [GymSource(c["name"], k, c["config"]) for k, c in CANDIDATES.items()]
    task = Task(sources, [1.0] * len(sources), test_size=TEST_PER_TYPE * len(sources), train_size=len(sources) * 1200,
                val_size=2 * n * len(sources), seed=0)
    held = study_test_questions(per_type)
    out = {}
    for src in task.source_names:
        out[src] = [p for p in task.val[src] if p.question not in held[src]][:n]
        if len(out[src]) < n:
            raise SystemExit(f"zero-shot: {src} has {len(out[src])} validation problems outside the study's test "
                             f"questions, fewer than {n}: lower --zero-shot-size")
    return task, out


def zero_shot(n: int, max_new: int, per_type: int = TEST_PER_TYPE) -> dict[str, Any]:
    """Greedy exact accuracy per model, format, extraction and task type."""
    import torch

    from mutualrl.config import GRPOOptions
    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.rollout.policy import Policy

    task, problems = zero_shot_problems(n, per_type)
    out: dict[str, Any] = {}
    for model, formats in FORMATS.items():
        path = resolve_model_path(f"real:{model}")
        out[model] = []
        for fmt in formats:
            pol = Policy(model, path, GRPOOptions(max_completion_length=max_new), **fmt)
            row: dict[str, Any] = {**fmt, "accuracy": {}}
            t = time.perf_counter()
            for src, probs in problems.items():
                with torch.no_grad():
                    texts = [s.text for s in pol.generate([p.question for p in probs], greedy=True, batch_size=50)]
                for ex in EXTRACTIONS:
                    task.answer_extraction = ex
                    ok = [task.is_success(task.verify(p, t_)) for p, t_ in zip(probs, texts, strict=True)]
                    row["accuracy"].setdefault(ex, {})[src] = sum(ok) / len(ok)
            row["seconds"] = time.perf_counter() - t
            out[model].append(row)
            print(f"zero-shot {model:8s} {fmt['prompt_template'][:28]!r:32s} " + "  ".join(
                f"{ex}: " + " ".join(f"{k} {v:.2f}" for k, v in row["accuracy"][ex].items()) for ex in EXTRACTIONS),
                flush=True)
            del pol
    return out


SHORTCUT_SHARE = 0.10
"""A task type whose most common answer is this share of its problems or more is left out of the
mix: a policy that always gives that answer earns that reward without solving anything, and
GRPO finds it (on ``gcd``, 21 % of whose problems have gcd 1, Gemma-3 collapsed to chains of ones
by step 30 and its verified "successes" reached SmolLM2 as SGT rescue rows)."""


def constant_answer_share(n: int = 600) -> dict[str, float]:
    """Per candidate type, the share of ``n`` training problems taken by its most common answer."""
    from collections import Counter

    from mutualrl.tasks import GymSource, Task

    sources = [GymSource(c["name"], k, c["config"]) for k, c in CANDIDATES.items()]
    task = Task(sources, [1.0] * len(sources), test_size=len(sources), train_size=len(sources) * n, seed=0)
    share = {}
    for src in task.source_names:
        answers = Counter(p.answer.strip() for p in task.train[src][:n])
        share[src] = max(answers.values()) / sum(answers.values())
    return share


def choose(zs: dict[str, Any], shortcut: dict[str, float] | None = None, n: int = 100) -> dict[str, Any]:
    """Best format per model and the shared extraction, then the pair of task types.

    Types a constant answer would solve :data:`SHORTCUT_SHARE` of the time are left out. A pair is
    complementary when model A beats B on one type and B beats A on the other, each by more than two
    standard errors of the difference on ``n`` problems; the most complementary such pair is taken.
    With none, the pair both models can partly solve best (the highest lowest accuracy of the four),
    ties broken by the pair whose weaker type the better model on it solves best: a type one model
    solves and the other does not is what sharing can pass on. Refused only when every pair holds a
    type neither model solves (no success there to learn from or to share).
    """
    excluded = {t: v for t, v in (shortcut or {}).items() if v >= SHORTCUT_SHARE}
    kept = [t for t in CANDIDATES if t not in excluded]
    if len(kept) < 2:
        raise SystemExit(f"zero-shot choice: {len(kept)} candidate type(s) left after leaving out those a constant "
                         f"answer solves {SHORTCUT_SHARE:.0%} of the time ({sorted(excluded)}); two are needed")

    missing = sorted({t for rows in zs.values() for r in rows for ex in EXTRACTIONS for t in kept
                      if t not in r["accuracy"][ex]})
    if missing:
        raise SystemExit(f"zero-shot table: no accuracy for {missing} (a table measured on other candidate types); "
                         "measure it again without --zero-shot-from")

    def mean_kept(accuracy: dict[str, float]) -> float:  # formats and extraction are judged on kept types only
        return statistics.fmean(accuracy[t] for t in kept)

    best: dict[str, Any] = {}
    for ex in EXTRACTIONS:
        fmts = {m: max(rows, key=lambda r: mean_kept(r["accuracy"][ex])) for m, rows in zs.items()}
        score = sum(mean_kept(f["accuracy"][ex]) for f in fmts.values())
        if not best or score > best["score"]:
            best = {"extraction": ex, "formats": fmts, "score": score}
    ex, (a, b) = best["extraction"], list(zs)
    acc = {m: best["formats"][m]["accuracy"][ex] for m in (a, b)}

    def se(t: str) -> float:  # standard error of the two models' accuracy difference on type t
        return math.sqrt(sum(acc[m][t] * (1 - acc[m][t]) for m in (a, b)) / n)

    complementary, able = [], []
    for t1, t2 in itertools.permutations(kept, 2):
        # a better on t1, b better on t2, and each model partly able on its weaker type
        gain = (acc[a][t1] - acc[b][t1]) + (acc[b][t2] - acc[a][t2])
        floor = min(acc[a][t2], acc[b][t1], acc[a][t1], acc[b][t2])
        if acc[a][t1] - acc[b][t1] > 2 * se(t1) and acc[b][t2] - acc[a][t2] > 2 * se(t2):
            complementary.append((gain + 0.5 * floor, t1, t2))
        reach = min(max(acc[a][t1], acc[b][t1]), max(acc[a][t2], acc[b][t2]))  # each type solved by someone
        able.append((floor, reach, acc[a][t1] + acc[a][t2] + acc[b][t1] + acc[b][t2], *sorted((t1, t2))))
    if complementary:
        rule = "complementary: each model better on one type by more than 2 standard errors"
        _, t1, t2 = max(complementary)
    else:
        rule = ("no pair complementary beyond 2 standard errors: the pair both models partly solve best "
                "(highest lowest accuracy), ties by the pair whose weaker type one model solves best")
        _, reach, _, t1, t2 = max(able)
        if reach <= 0:
            raise SystemExit(f"zero-shot choice: no pair of {kept} is complementary beyond 2 standard errors, and "
                             f"every pair holds a type neither model solves ({t1}, {t2} at best): a study on it "
                             "would measure nothing; try more candidate types or other prompt formats")
    return {"extraction": ex, "formats": {m: {k: v for k, v in f.items() if k not in ("accuracy", "seconds")}
                                          for m, f in best["formats"].items()},
            "tasks": [t1, t2], "accuracy": {m: {t: acc[m][t] for t in (t1, t2)} for m in (a, b)},
            "rule": rule, "excluded_shortcut": excluded, "constant_answer_share": shortcut}


def thl_residual(run_dirs: list[Path]) -> dict[str, Any]:
    """THL's residual of the pair (SmolLM2 -> Gemma-3 and back) on the completions the runs sampled."""
    from transformers import AutoTokenizer

    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.config.resolve import load_config
    from mutualrl.exchange import open_exchange
    from mutualrl.tasks.build import build_task
    from mutualrl.thl.align import align_batch
    from mutualrl.thl.residual import pair_report

    texts: list[str] = []
    for d in run_dirs:
        ids = sorted(build_task(load_config(str(d / "config.yaml"), check_paths=False).task).known_ids())
        with open_exchange(f"sqlite:///{(d / 'exchange.db').resolve()}") as ex:
            texts.extend(r.completion for r in ex.query(ids, kinds=["rollout"], limit=2000))
    toks = {m: AutoTokenizer.from_pretrained(resolve_model_path(f"real:{m}")) for m in ("smollm2", "gemma3")}
    texts = [t for t in texts if t]
    return {"texts": len(texts),
            "smollm2_to_gemma3": pair_report(align_batch(texts, toks["smollm2"], toks["gemma3"])).as_dict(),
            "gemma3_to_smollm2": pair_report(align_batch(texts, toks["gemma3"], toks["smollm2"])).as_dict()}


def per_type(args: argparse.Namespace) -> int:
    """Validation and test problems per task type (fewer with ``--quick``)."""
    return 20 if args.quick else TEST_PER_TYPE


def base_config(choice: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A run of the study: the real-small preset on the chosen mix and formats, validation and test
    from the fresh pool (:func:`study_task_section`), its seed its prompt stream's."""
    import yaml

    base = yaml.safe_load((ROOT / "examples" / "real_small.yaml").read_text())
    for pol in base["policies"]:
        pol.pop("system_prompt", None)
        pol.update(choice["formats"][pol["name"]])
    types = choice["tasks"]
    base["task"] = study_task_section(types, choice["extraction"], per_type(args))
    base["grpo"] = {**base["grpo"], "num_generations": args.generations}
    base["sharing"] = {"strategy": "independent"}
    base.update(steps=args.steps, prompts_per_step=args.prompts, eval_size=per_type(args) * len(types),
                eval_every=max(1, args.steps // (args.evals - 1)), checkpoint_every=20, seed=seed,
                scheduler="sequential", threads=max(1, (os.cpu_count() or 1) // args.jobs))
    return base


def checked_task(choice: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Build the chosen pair's task once, before any run: its fresh pool must exist. The split check
    it records: how many of its validation and test questions the seed-0 splits of the same types
    hold (those the first protocol's runs read; zeros: disjoint)."""
    n = per_type(args)
    try:
        task = study_task(choice["tasks"], n, choice["extraction"])
    except ValueError as exc:
        raise SystemExit(f"task types {choice['tasks']}: the plan's fresh split ({n} validation + {n} test problems "
                         f"per type outside the seed-0 splits, task.heldout_seed {HELDOUT_SEED}) cannot be drawn: "
                         f"{exc}") from exc
    earlier = study_task(choice["tasks"], n, choice["extraction"], heldout=False)
    return {"heldout_seed": HELDOUT_SEED, "val_like_test": True,
            "sizes": {s: {t: len(ps) for t, ps in task.split(s).items()} for s in ("val", "test")},
            "shared_with_seed0_splits": task.heldout_check([earlier])}


# ---------------------------------------------------------------------------- the arms
LR_NEXT = {2.5e-6: 5e-6, 5e-6: 1e-5, 1e-5: 3e-5, 3e-5: 5e-5, 5e-5: 1e-4}
"""The GRPO learning rate after each on a grid extended upward (:func:`mutual.tune_grid`; downward the
reverse, then halving)."""
WEIGHT_NEXT = {0.25: 0.5, 0.5: 1.0, 1.0: 2.0, 2.0: 4.0, 4.0: 8.0}
"""The supervised weight after each, likewise."""
WEIGHTS = [0.5, 1.0, 2.0]
SELF_WEIGHTS = [0.5, 1.0, 2.0, 4.0]
"""``self_imitate``'s weights: a fourth candidate in place of the fallback, which amendment 5 took off
validation, so each side has 10."""
SHORT = 1 / 1.1
"""A policy whose matched control trains less than this share of its budget a step is short (the
match's 10 %, judged either way round: the sharing arm trains more than 1.1x the control's): the
fallback gives it own samples to spend its FLOPs."""


def grpo_arm(lr: float) -> Arm:
    return Arm(f"independent_lr{mutual.lr_name(lr)}", "independent", "baseline", {"grpo": {"learning_rate": lr}})


def self_imitate_arm(grpo: dict[str, Any], w: float) -> Arm:
    return Arm(f"self_imitate_w{w:g}", "self_imitate", "baseline",
               {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": {"weight": w}}})


def matched_arm(grpo: dict[str, Any], w: float, replay: int) -> Arm:
    """The compute-matched control: ``self_imitate`` with up to 64 own earlier successes (of the last
    ``replay`` steps) a step, each policy held to its own token budget (its seed overrides), as a
    floor and a ceiling (``match_ceiling``: the plan's amendment 3)."""
    block = {"weight": w, "extra_rows": 64, "replay_steps": replay, "match_ceiling": True}
    return Arm(f"matched_w{w:g}_replay{replay}_ceiling", "matched", "baseline",
               {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": block}})


def imitate_arm(grpo: dict[str, Any], variant: str, w: float) -> Arm:
    """``imitate`` at weight ``w``: ``plain``, ``replay4`` (peer successes of the last 4 steps) or
    ``replay4_peer2`` (the same, peer rows weighted 2)."""
    extra = {"plain": {}, "replay4": {"replay_steps": 4},
             "replay4_peer2": {"replay_steps": 4, "peer_weight": 2.0}}[variant]
    name = "imitate" + ("" if variant == "plain" else f"_{variant}") + f"_w{w:g}"
    return Arm(name, "sharing", "sharing",
               {"grpo": grpo, "sharing": {"strategy": "imitate", "imitate": {"weight": w, **extra}}})


def distill_arms(grpo: dict[str, Any]) -> list[Arm]:
    """``distill`` at weight 0.5 (its default) and 2, alone and after ``imitate`` with 4 steps of replay
    (weight 1)."""
    def arm(strategy: str, w: float) -> Arm:
        sharing = {"strategy": strategy, "distill": {"weight": w}}
        if "imitate" in strategy:
            sharing["imitate"] = {"weight": 1.0, "replay_steps": 4}
        name = ("imitate_replay4+distill" if "imitate" in strategy else "distill") + f"_w{w:g}"
        return Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": sharing})

    return [arm(s, w) for s in ("distill", "imitate+distill") for w in (0.5, 2.0)]


def more_samples(overrides: dict[str, Any], samples: Mapping[str, int]) -> dict[str, Any]:
    """``overrides`` (with a ``policies`` list) with each policy of ``samples`` sampling that many
    completions a prompt (``policies[i].grpo.num_generations``), or the samples ``overrides`` already
    gives it where more (those that spend a ``distill`` arm's scoring FLOPs: :func:`mutual.control_samples`)."""
    def raised(p: dict[str, Any]) -> dict[str, Any]:
        n = max(samples[p["name"]], p.get("grpo", {}).get("num_generations", 0))
        return deep_merge(p, {"grpo": {"num_generations": n}})

    pols = [raised(p) if p["name"] in samples else p for p in overrides["policies"]]
    return {**overrides, "policies": pols}


FLOPS_KEYS = ("flops_sampling", "flops_scoring", "flops_update")
MAX_SAMPLES = 32
"""The fallback's samples a prompt, at most (4 prompts x 32 completions of 12 tokens: memory is no
concern at these sizes; the cap keeps a broken FLOPs count from asking for thousands)."""
UNMATCHABLE = 0.5
"""A short policy whose chosen matched candidate trains under this share of its budget a step on a
tuning seed cannot be matched by its own successes: the gate judges its fallback on FLOPs alone
(amendment 5). A short policy above it is judged on all three quantities, fallback or not."""


def fallback_samples(study: Study, best: Arm, update: Mapping[str, float], seed: int, generations: int
                     ) -> dict[str, int]:
    """Amendment 5: samples a prompt for each policy of ``update`` (a short policy -> the update FLOPs a
    step its control is expected to spend), as many as spend in sampling what that policy spent a step
    in ``best``'s run of ``seed`` (sampling, scoring its peers' samples and update FLOPs) less that
    update: ``generations x (total - update) / sampling``, rounded, between ``generations`` and
    :data:`MAX_SAMPLES`. The sharing arm samples ``generations`` a prompt, so its sampling FLOPs are
    those of ``generations`` samples (sampling FLOPs are linear in the samples)."""
    spent = {k: study.per_step_by_policy(best, [seed], k) for k in FLOPS_KEYS}
    out: dict[str, int] = {}
    for p, own in update.items():
        sampling = spent["flops_sampling"].get(p, 0.0)
        total = sum(spent[k].get(p, 0.0) for k in FLOPS_KEYS)
        n = round(generations * (total - own) / sampling) if sampling > 0 else generations
        out[p] = max(generations, min(MAX_SAMPLES, n))
    return out


def without_ceiling(overrides: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``overrides`` with the policies ``names`` trained without the token ceiling
    (``sharing.self_imitate.match_ceiling: false``): the fallback's FLOPs-only policies, whose tokens are
    not judged; the ceiling would leave out whole groups of the samples they pay for."""
    pols = [deep_merge(p, {"sharing": {"self_imitate": {"match_ceiling": False}}}) if p["name"] in names else p
            for p in overrides["policies"]]
    return {**overrides, "policies": pols}


def matched_on(study: Study, best: Arm, seed: int, budget: Mapping[str, int]) -> dict[str, Any]:
    """A matched control's overrides on ``seed``: each policy's budget a step (``budget``) and, step by
    step, what it trained in ``best``'s run of that seed (``match_schedule``: amendment 5, so it trains
    on the steps that arm trained on), with the samples that spend ``best``'s scoring FLOPs
    (:func:`mutual.control_samples`)."""
    return study.matched_overrides(seed, "self_imitate", budget, mutual.control_samples(study, best, seed),
                                   study.policy_schedule(best, seed))


def short_policies(study: Study, held: Arm, budgets: dict[int, dict[str, int]], share: float = SHORT) -> list[str]:
    """The policies ``held`` (a matched control) leaves below ``share`` of their budget a step on some
    tuning seed (default :data:`SHORT`: its own replay cannot reach the budget)."""
    return sorted({p for s, budget in budgets.items() for p, spent in study.policy_budget(held, s).items()
                   if spent < share * budget[p]})


@dataclass
class Tuned:
    """What the tuning rounds chose: GRPO (``ind``), ``self_imitate`` (``ctrl``), the best sharing arm
    (``best``) and the matched control (``held``); ``short``: the policies whose own successes leave
    them below their budget, given own samples instead (none: no fallback); ``update``: the update
    FLOPs a step the fallback's samples are sized with, per short policy; ``flops_only``: the short
    policies the gate judges on FLOPs alone (:data:`UNMATCHABLE`); ``fallback``: whether ``held`` is
    the fallback."""

    study: Study
    ind: Arm
    ctrl: Arm
    best: Arm
    held: Arm
    short: list[str]
    generations: int
    update: dict[str, float] = field(default_factory=dict)
    flops_only: list[str] = field(default_factory=list)
    fallback: bool = False

    def samples(self, seed: int) -> dict[str, int]:
        """The short policies' samples a prompt on ``seed`` (:func:`fallback_samples`)."""
        return fallback_samples(self.study, self.best, self.update, seed, self.generations)

    def match(self, seed: int, budget: Mapping[str, int]) -> dict[str, Any]:
        """The matched control's overrides on ``seed``: each policy's budget step by step from the best
        sharing arm's run of that seed (:func:`matched_on`); the fallback's short policies with more
        samples, the FLOPs-only ones without the ceiling."""
        over = matched_on(self.study, self.best, seed, budget)
        if not self.fallback:
            return over
        return without_ceiling(more_samples(over, self.samples(seed)), self.flops_only)

    def arms(self) -> tuple[Arm, Arm, Arm, Arm]:
        return self.ind, self.ctrl, self.best, self.held


def flops_outside(study: Study, arm: Arm, best: Arm, seeds: Sequence[int], names: Sequence[str]) -> list[str]:
    """The policies of ``names`` whose FLOPs in ``arm``'s runs on ``seeds`` are not within 10 % of
    ``best``'s on some seed (or not counted)."""
    ratios = evidence.policy_ratios(study.records(arm, seeds) + study.records(best, seeds), arm.name, best.name)
    flops = ratios.get("flops", {})
    return [p for p in names if p not in flops or not all(evidence.within(v) for v in flops[p]["values"])]


def tune_all(study: Study, tune: list[int], generations: int) -> Tuned:
    """The tuning rounds on the tuning seeds (the module docstring); ``generations``: the samples a
    prompt of every run (the fallback's are sized from it: :func:`fallback_samples`)."""
    ind = mutual.tune_grid(study, "independent", {"lr": (grpo_arm, [5e-6, 1e-5, 3e-5])}, tune, nxt=LR_NEXT)
    grpo = ind.overrides["grpo"]
    best = mutual.tune_grid(study, "sharing", {
        "plain": (lambda w: imitate_arm(grpo, "plain", w), [1.0, 2.0]),
        "replay4": (lambda w: imitate_arm(grpo, "replay4", w), WEIGHTS)}, tune,
        fixed=[imitate_arm(grpo, "replay4_peer2", 1.0), *distill_arms(grpo)], nxt=WEIGHT_NEXT)
    ctrl = mutual.tune_grid(study, "self_imitate", {"w": (lambda w: self_imitate_arm(grpo, w), SELF_WEIGHTS)},
                            tune, nxt=WEIGHT_NEXT)
    budgets = {s: study.policy_budget(best, s) for s in tune}
    _, tag = mutual.matched_samples(study, best, tune, budgets)

    def matched(replay: int) -> Callable[[float], Arm]:
        def make(w: float) -> Arm:
            arm = matched_arm(grpo, w, replay)
            arm.name += tag
            arm.seed_overrides = {s: matched_on(study, best, s, budgets[s]) for s in tune}
            return arm
        return make

    grid = {f"replay{r}": (matched(r), WEIGHTS) for r in (4, 16)}
    held = mutual.tune_grid(study, "matched", grid, tune, nxt=WEIGHT_NEXT)
    tuned = Tuned(study, ind, ctrl, best, held, short_policies(study, held, budgets), generations)
    if not tuned.short:
        study.notes.append(f"matched: {held.name} reaches {SHORT:.0%} of every policy's budget on the tuning seeds; "
                           "no fallback (10 candidates a side before any grid extension)")
        return tuned
    return with_fallback(tuned, study, tune, budgets)


def with_fallback(tuned: Tuned, study: Study, tune: list[int], budgets: dict[int, dict[str, int]]) -> Tuned:
    """Amendment 5: the matched control becomes the chosen candidate with its short policies sampling to
    spend their FLOPs, sized first with the chosen candidate's update FLOPs a step; where a short
    policy's FLOPs then miss the sharing arm's by more than 10 % on a tuning seed, sized once again with
    the fallback's own update FLOPs and run again (at most once). Refused when every policy is FLOPs-only
    (no policy would be matched on what it trained)."""
    held, best = tuned.held, tuned.best
    tuned.flops_only = short_policies(study, held, budgets, UNMATCHABLE)
    policies = study.records(held, tune)[0]["policies"]
    if set(tuned.flops_only) >= set(policies):
        raise SystemExit(f"matched: {held.name} trains under {UNMATCHABLE:.0%} of every policy's budget on the tuning "
                         f"seeds ({budgets}); a control judged on FLOPs alone for every policy matches nothing it "
                         "trained: the plan stops here, before any final seed")
    tuned.fallback = True
    tuned.update = {p: v for p, v in study.per_step_by_policy(held, tune, "flops_update").items() if p in tuned.short}
    sized: list[str] = []
    extra = held
    for attempt in range(2):
        extra = Arm(f"{held.name}_more_samples" + ("_resized" if attempt else ""), "matched", "baseline",
                    held.overrides, {s: tuned.match(s, budgets[s]) for s in tune})
        study.run([(extra, s) for s in tune])
        sized.append(f"{extra.name}: samples a prompt {({s: tuned.samples(s) for s in tune})}")
        outside = flops_outside(study, extra, best, tune, tuned.short)
        if not outside or attempt:
            break
        before = {s: tuned.samples(s) for s in tune}
        tuned.update = {p: v for p, v in study.per_step_by_policy(extra, tune, "flops_update").items()
                        if p in tuned.short}
        if {s: tuned.samples(s) for s in tune} == before:  # the same samples again: nothing to run
            break
    val = {s: evidence.final_accuracy(r, "val") for s in tune for r in study.records(extra, [s])}
    study.notes.append(
        f"matched (amendment 5): {held.name}, chosen on validation, leaves {', '.join(tuned.short)} below "
        f"{SHORT:.0%} of the budget on the tuning seeds (its own successes cannot reach it); the matched control is "
        f"{extra.name}: the same with {', '.join(tuned.short)} sampling to spend that policy's FLOPs "
        f"({'; '.join(sized)}; validation {val}); judged on FLOPs alone by the gate: "
        f"{', '.join(tuned.flops_only) or 'none'} (under {UNMATCHABLE:.0%} of the budget; trained without the ceiling)")
    study.tuning["matched"]["chosen_on_validation"] = held.name
    study.tuning["matched"]["chosen"] = extra.name
    study.tuning["matched"]["fallback"] = {"arm": extra.name, "short": tuned.short, "flops_only": tuned.flops_only,
                                           "samples": {s: mutual.override_samples(extra.seed_overrides[s])
                                                       for s in tune}, "val": val}
    # the final seeds' samples: sized with the chosen fallback's own update FLOPs a step on the tuning seeds
    tuned.update = {p: v for p, v in study.per_step_by_policy(extra, tune, "flops_update").items() if p in tuned.short}
    tuned.held = extra
    return tuned


# ---------------------------------------------------------------------------- the command line
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4,
                    help="samples a prompt (the matched control's fallback gives a short policy as many as spend its FLOPs)")
    ap.add_argument("--evals", type=int, default=3, help="validation points (start and end included)")
    ap.add_argument("--zero-shot-size", type=int, default=100)
    ap.add_argument("--zero-shot-from", type=Path, default=None,
                    help="take the zero-shot table (on validation problems) from this result JSON")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=None,
                    help="runs at once (default --jobs; threads stay cores / jobs, so committed runs are reused)")
    ap.add_argument("--out", default="runs/study_real_small")
    ap.add_argument("--tune-seeds", default="0")
    ap.add_argument("--final-seeds", default=",".join(str(s) for s in range(1, 15)),
                    help="the plan's final seeds (real pair: 1-14); never a tuning seed")
    ap.add_argument("--chunk", type=int, default=2, help="final seeds run together (the study keeps whole seeds)")
    ap.add_argument("--target", type=target_points, default=5.0,
                    help="the plan's target for the peers' share in points: the JSON's verdict")
    ap.add_argument("--phase", choices=("tune", "all"), default="all",
                    help="tune: the tuning rounds only; all: then the final seeds")
    ap.add_argument("--name", default="mutual_real_small")
    ap.add_argument("--quick", action="store_true",
                    help="4 steps, 20 problems per type, one final seed (a smoke test; NAME_quick): the "
                         "compute-match gate is shown, not applied (in 4 steps one step more or less is 1.33x)")
    return ap


def checked_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, checked before any run (a typo must not cost an hour): ``tune`` and
    ``final``, the seeds, never sharing one; a first-protocol study of the same name archived."""
    args = ap.parse_args()
    args.tune = [int(x) for x in args.tune_seeds.split(",")]
    if args.quick:  # its own run folders and results: a smoke test never touches the study's
        args.steps, args.evals, args.zero_shot_size = 4, 2, 20
        args.final_seeds, args.name, args.out = str(max(args.tune) + 1), args.name + "_quick", args.out + "_quick"
    args.results = Path(args.out) / "results" if args.quick else RESULTS
    if args.evals < 2:
        raise SystemExit(f"--evals {args.evals}: at least 2 (the start and the end of a run)")
    args.final = [int(x) for x in args.final_seeds.split(",")]
    if set(args.tune) & set(args.final):
        raise SystemExit(f"--final-seeds {args.final} and --tune-seeds {args.tune} share a seed: the tuning seed is "
                         "never a final seed (the plan of benchmarks/README.md)")
    result = RESULTS / f"{args.name}.json"
    if (not args.quick and result.is_file() and "plan" not in json.loads(result.read_text())
            and not (RESULTS / f"{args.name}_protocol1.json").is_file()):
        raise SystemExit(f"{result} is the first protocol's study: archive it first as {args.name}_protocol1 (its "
                         f".json, _runs/ and _report/, as mutual and mutual_taskmix were), or pick another --name; "
                         "this study would write over its records")
    return args


def task_choice(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The zero-shot table (measured, or ``--zero-shot-from``) and the task mix, formats and
    extraction chosen from it."""
    from mutualrl.realmodels import prepare_preset

    prepare_preset("real-small", progress=False)
    source = "measured"
    if args.zero_shot_from is not None:
        loaded = json.loads(args.zero_shot_from.read_text())
        zs = loaded["zero_shot"]
        source = (f"{args.zero_shot_from}" + ("" if loaded.get("heldout_seed") == HELDOUT_SEED else
                  f" (measured before the fresh split of heldout_seed {HELDOUT_SEED}: its problems were not "
                  "checked against this study's test split)"))
    else:
        t = time.perf_counter()
        zs = zero_shot(args.zero_shot_size, 12, per_type(args))
        print(f"zero-shot study {time.perf_counter() - t:.0f}s", flush=True)
    choice = choose(zs, constant_answer_share(), args.zero_shot_size)
    choice["zero_shot_source"] = source
    print(f"task mix: {choice['tasks']} (zero-shot on validation {choice['accuracy']}), extraction "
          f"{choice['extraction']}, formats {choice['formats']}", flush=True)
    return zs, choice


def main() -> None:
    args = checked_args(parser())
    zs, choice = task_choice(args)
    split_check = checked_task(choice, args)
    study = Study(args.name, lambda seed: base_config(choice, args, seed), Path(args.out), results=args.results,
                  jobs=args.jobs, reuse=True, parallel=args.parallel, final_seeds=args.final, target=args.target)
    study.notes.append(f"Task mix chosen by the zero-shot study on validation problems: {', '.join(choice['tasks'])}; "
                       f"{args.prompts} prompts x {args.generations} samples a step, {args.steps} steps; validation "
                       f"and test from one fresh pool per type (task.heldout_seed {HELDOUT_SEED}, val_like_test).")
    tuned = tune_all(study, args.tune, args.generations)
    extra = {"policies": ["smollm2 (SmolLM2-135M-Instruct)", "gemma3 (Gemma-3-270M)"], "zero_shot": zs,
             "choice": choice, "candidates": CANDIDATES, "steps": args.steps, "tune_seeds": args.tune,
             "heldout_seed": HELDOUT_SEED, "split_check": split_check,
             "more_samples": {"policies": tuned.short, "chosen": tuned.fallback, "judged_on_flops_alone": tuned.flops_only,
                              "num_generations": {s: mutual.override_samples(tuned.held.seed_overrides[s])
                                                  for s in args.tune} if tuned.fallback else {}},
             "plan": "benchmarks/README.md#the-sharing-studies-pre-registered-plan"}
    if args.phase == "tune":
        study.arms = {a.name: a for a in tuned.arms()}
        study.write({**extra, "phase": "tune"}, report=False)
        return
    flops_only = tuned.flops_only
    mutual.check_inside_match(study, tuned.held, tuned.best, args.tune, smoke=args.quick,  # the plan's gate
                              flops_only=flops_only)
    name = f"{mutual.FINAL_MATCHED}_more_samples" if tuned.fallback else mutual.FINAL_MATCHED
    headline = mutual.final_round(study, tuned.arms(), args.final, args.chunk, name=name,
                                  match=tuned.match, flops_only=flops_only)
    study.arms = {a.name: a for a in headline}
    if tuned.fallback:
        extra["more_samples"]["final_num_generations"] = {s: mutual.override_samples(o)
                                                          for s, o in sorted(headline[3].seed_overrides.items())}
    dirs = [d for a in headline for s in args.final if (d := Path(args.out) / f"{a.name}-seed{s}").is_dir()]
    study.write({**extra, "thl_residual": thl_residual(dirs) if dirs else None})


if __name__ == "__main__":
    main()
