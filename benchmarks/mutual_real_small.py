"""Real models trained together: SmolLM2-135M-Instruct (Llama, 49k BPE) x Gemma-3-270M (Gemma, 262k
SentencePiece), from PyPI wheels, offline: a study definition on the library harness (:mod:`mutualrl.study`).

    python benchmarks/mutual_real_small.py [--steps 100] [--final-seeds 0,1,2] [--jobs 1] [--reuse]
        [--zero-shot-from RESULT.json] [--name mutual_real_small]

1. **Zero-shot study on validation problems**: greedy exact accuracy of both models on candidate
   reasoning-gym task types (``--zero-shot-size`` validation problems each, held out of the study's
   test split) under each model's prompt formats and two answer extractions. Each model keeps its
   best format; the extraction is the one best for both; the pair of types is the most
   complementary (or, with none, the one both partly solve best); types a constant answer solves
   10 % of the time are left out.
2. **Tuning on validation** (the tuning seeds): independent GRPO at two learning rates; then
   ``self_imitate`` and the sharing candidates (``imitate``, with and without replay) at the chosen
   GRPO settings; the compute-matched control (``self_imitate`` adding own earlier successes until a
   step trains as many tokens as the chosen sharing arm did). With ``--own-replay`` second-stage
   candidates: ``imitate_replay16_own``, imitate with the control's own replay rows at the control's
   token budget, so that it differs from the control by the peers' rows alone, and the same with the
   peers' rows at half weight.
3. **The final seeds**: every chosen arm; the test split (200 problems per type) read once, at the
   end of each run. 100 steps of 4 prompts x 4 samples; rows of the supervised steps join the GRPO
   step (weight 1).

Writes ``benchmarks/results/NAME.json`` (the peers' share with its interval, per arm accuracy and
compute, the zero-shot table and choice, the pair's THL residual), ``NAME_runs/`` and
``NAME_report/``. A run takes about 10 minutes on 2 cores (``--evals 2``: validation at the start and end
only, which is all the protocol reads): run it alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _common import RESULTS

from mutualrl.study import Arm, Study, deep_merge

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
"""Task types both small models might partly solve, each with room for the protocol's disjoint
splits (200 test, 200 validation and the training problems per type: one-digit products alone
are 100 problems, too few)."""

FORMATS: dict[str, list[dict[str, Any]]] = {
    "smollm2": [{"prompt_template": "chat", "system_prompt": "Answer with only the final number."},
                {"prompt_template": "Question: {question}\nAnswer:"},
                {"prompt_template": "{question} Answer: "}],
    "gemma3": [{"prompt_template": "Question: {question}\nAnswer:"},
               {"prompt_template": "{question} Answer: "},
               {"prompt_template": "Q: {question}\nA:"}],
}
EXTRACTIONS = ("first_number", "last_number")
SGT_LAMBDA = 1.0
"""The rescue loss weight of the zoo study's SGT arm (``examples/zoo_sgt.yaml``)."""


def study_test_questions(sources: list[Any], per_type: int) -> dict[str, set[str]]:
    """Per candidate type, every test question it could have in the study's task (seed 0): the
    study's task holds any subset of the candidates, each at any place in its list."""
    from mutualrl.tasks import Task

    return {s.name: {p.question for i in range(len(sources))
                     for p in s.generate("test", per_type, Task.split_seed(0, i, "test"))} for s in sources}


def zero_shot_problems(n: int) -> tuple[Any, dict[str, list[Any]]]:
    """The zero-shot study's task and its ``n`` validation problems per candidate type, held out of
    the study's test split: the study's task holds any of the candidates at any place, and a type's
    test problems depend on its place, so every test question the type could have there is removed
    by text before the ``n`` are taken."""
    from mutualrl.tasks import GymSource, Task

    sources = [GymSource(c["name"], k, c["config"]) for k, c in CANDIDATES.items()]
    task = Task(sources, [1.0] * len(sources), test_size=TEST_PER_TYPE * len(sources), train_size=len(sources) * 1200,
                val_size=2 * n * len(sources), seed=0)
    held = study_test_questions(sources, TEST_PER_TYPE)
    out = {}
    for src in task.source_names:
        out[src] = [p for p in task.val[src] if p.question not in held[src]][:n]
        if len(out[src]) < n:
            raise SystemExit(f"zero-shot: {src} has {len(out[src])} validation problems outside the study's test "
                             f"questions, fewer than {n}: lower --zero-shot-size")
    return task, out


def zero_shot(n: int, max_new: int) -> dict[str, Any]:
    """Greedy exact accuracy per model, format, extraction and task type."""
    import torch

    from mutualrl.config import GRPOOptions
    from mutualrl.config.modelref import resolve_model_path
    from mutualrl.rollout.policy import Policy

    task, problems = zero_shot_problems(n)
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
    With none, the pair both models can partly solve best (the highest lowest accuracy of the four).
    """
    best: dict[str, Any] = {}
    for ex in EXTRACTIONS:
        fmts = {m: max(rows, key=lambda r: statistics.fmean(r["accuracy"][ex].values())) for m, rows in zs.items()}
        score = sum(statistics.fmean(f["accuracy"][ex].values()) for f in fmts.values())
        if not best or score > best["score"]:
            best = {"extraction": ex, "formats": fmts, "score": score}
    ex, (a, b) = best["extraction"], list(zs)
    acc = {m: best["formats"][m]["accuracy"][ex] for m in (a, b)}
    excluded = {t: v for t, v in (shortcut or {}).items() if v >= SHORTCUT_SHARE}
    kept = [t for t in CANDIDATES if t not in excluded]

    def se(t: str) -> float:  # standard error of the two models' accuracy difference on type t
        return math.sqrt(sum(acc[m][t] * (1 - acc[m][t]) for m in (a, b)) / n)

    complementary, able = [], []
    for t1, t2 in itertools.permutations(kept, 2):
        # a better on t1, b better on t2, and each model partly able on its weaker type
        gain = (acc[a][t1] - acc[b][t1]) + (acc[b][t2] - acc[a][t2])
        floor = min(acc[a][t2], acc[b][t1], acc[a][t1], acc[b][t2])
        if acc[a][t1] - acc[b][t1] > 2 * se(t1) and acc[b][t2] - acc[a][t2] > 2 * se(t2):
            complementary.append((gain + 0.5 * floor, t1, t2))
        able.append((floor, acc[a][t1] + acc[a][t2] + acc[b][t1] + acc[b][t2], *sorted((t1, t2))))
    if complementary:
        rule = "complementary: each model better on one type by more than 2 standard errors"
        _, t1, t2 = max(complementary)
    else:
        rule = ("no pair complementary beyond 2 standard errors: the pair both models partly solve best "
                "(highest lowest accuracy)")
        *_, t1, t2 = max(able)
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


TEST_PER_TYPE = 200


def per_type(args: argparse.Namespace) -> int:
    """Validation and test problems per task type (fewer with ``--quick``)."""
    return 20 if args.quick else TEST_PER_TYPE


def base_config(choice: dict[str, Any], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """A run of the study: the real-small preset on the chosen mix and formats, validation and test
    held out (200 problems each per type), its seed its prompt stream's."""
    import yaml

    base = yaml.safe_load((ROOT / "examples" / "real_small.yaml").read_text())
    for pol in base["policies"]:
        pol.pop("system_prompt", None)
        pol.update(choice["formats"][pol["name"]])
    types = choice["tasks"]
    base["task"] = {"datasets": [{**CANDIDATES[t], "alias": t} for t in types],
                    "answer_extraction": choice["extraction"], "test_size": per_type(args) * len(types),
                    "val_size": per_type(args) * len(types), "train_size": 4000, "reward": "exact", "seed": 0}
    base["grpo"] = {**base["grpo"], "num_generations": args.generations}
    base["sharing"] = {"strategy": "independent"}
    base.update(steps=args.steps, prompts_per_step=args.prompts, eval_size=per_type(args) * len(types),
                eval_every=max(1, args.steps // (args.evals - 1)), checkpoint_every=20, seed=seed,
                scheduler="sequential", threads=max(1, (os.cpu_count() or 1) // args.jobs))
    return base


def held_to_control(study: Study, best: Arm, matched: Arm, tune: list[int], choice: dict[str, Any],
                    args: argparse.Namespace) -> Arm:
    """The chosen sharing arm held, policy by policy, to the trained tokens a step the compute-matched
    control reached on the tuning seeds (``policies[i].sharing.imitate.match_tokens``): peers' rows first
    within that budget, then the policy's own earlier successes, as the control adds them. The control
    cannot reach a common budget when a policy has few successes of its own (Gemma-3), so this arm
    trains what the control trains, policy by policy: the headline's sharing arm may train more."""
    study.run((matched, s_) for s_ in tune)
    per_policy = study.per_step_by_policy(matched, tune, "train_tokens")
    block = {**best.overrides["sharing"]["imitate"], "own_extra_rows": 64,
             "replay_steps": max(16, best.overrides["sharing"]["imitate"].get("replay_steps", 0))}
    policies = [dict(p, sharing={"imitate": {"match_tokens": round(per_policy[p["name"]])}})
                for p in base_config(choice, args, tune[0])["policies"]]
    study.notes.append("matched_sharing: " + best.name + " with the control's own replay rows, held to the control's "
                       "trained tokens a step per policy on the tuning seeds (" + ", ".join(
                           f"{k} {v:.0f}" for k, v in per_policy.items()) + ")")
    return Arm(f"{best.name}_held", "matched_sharing", "matched_sharing",
               deep_merge(best.overrides, {"sharing": {"imitate": block}, "policies": policies}))


FINAL_ARMS = ("independent", "self_imitate", "matched", "sharing", "matched_sharing")
"""The chosen arms a study can train on its final seeds (``--final-arms``)."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--evals", type=int, default=3, help="validation points (start and end included)")
    ap.add_argument("--zero-shot-size", type=int, default=100)
    ap.add_argument("--zero-shot-from", type=Path, default=None,
                    help="take the zero-shot table (on validation problems) from this result JSON")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=None,
                    help="runs at once (default --jobs; threads stay cores / jobs, so committed runs are reused)")
    ap.add_argument("--out", default="runs/study_real_small")
    ap.add_argument("--tune-seeds", default="0")
    ap.add_argument("--final-seeds", default="0,1,2")
    ap.add_argument("--final-arms", default="independent,self_imitate,matched,sharing",
                    help="which chosen arms train on the final seeds (comma-separated of independent, "
                    "self_imitate, matched, sharing, matched_sharing): the headline needs only matched and sharing; "
                    "matched_sharing is the chosen sharing arm held to the control's tokens per policy")
    ap.add_argument("--name", default="mutual_real_small")
    ap.add_argument("--quick", action="store_true", help="4 steps, 20 problems per type, one seed (a smoke test)")
    ap.add_argument("--own-replay", action="store_true",
                    help="add the stage-2 sharing candidates imitate_replay16_own (imitate with the compute-matched "
                    "control's own replay rows, at its token budget) and the same with peer rows at half weight")
    return ap


def checked_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line, checked before any run (a typo must not cost an hour); ``wanted``: the final
    arms, ``tune`` and ``final``: the seeds."""
    args = ap.parse_args()
    args.wanted = [x.strip() for x in args.final_arms.split(",") if x.strip()]
    if not args.wanted or set(args.wanted) - set(FINAL_ARMS):
        ap.error(f"--final-arms: {args.final_arms!r} names {sorted(set(args.wanted) - set(FINAL_ARMS)) or 'no arm'}; "
                 f"choose from {', '.join(FINAL_ARMS)}")
    if args.own_replay and args.name == "mutual_real_small":  # stage 1's result is kept as it is
        args.name = "mutual_real_small_stage2"
    if args.quick:
        args.steps, args.evals, args.zero_shot_size, args.final_seeds = 4, 2, 20, args.tune_seeds
        args.name = args.name + "_quick"
    args.tune, args.final = [int(x) for x in args.tune_seeds.split(",")], [int(x) for x in args.final_seeds.split(",")]
    # stage 2 takes stage 1's runs of the same config (its tuning rounds) instead of training them again
    if args.own_replay and not args.quick:  # stage 2's final seeds are fresh: stage 1's test splits were read
        stage1 = RESULTS / "mutual_real_small.json"
        seen = set(json.loads(stage1.read_text()).get("final_seeds", [])) if stage1.is_file() else set()
        if seen & set(args.final):
            ap.error(f"--final-seeds {args.final_seeds}: stage 1 read the test split of seeds {sorted(seen)}; "
                     "stage 2 needs fresh ones (e.g. --final-seeds 3,4,5)")
    return args


def task_choice(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The zero-shot table (measured, or ``--zero-shot-from``) and the task mix, formats and
    extraction chosen from it."""
    from mutualrl.realmodels import prepare_preset

    prepare_preset("real-small", progress=False)
    if args.zero_shot_from is not None:
        zs = json.loads(args.zero_shot_from.read_text())["zero_shot"]
    else:
        t = time.perf_counter()
        zs = zero_shot(args.zero_shot_size, 12)
        print(f"zero-shot study {time.perf_counter() - t:.0f}s", flush=True)
    choice = choose(zs, constant_answer_share(), args.zero_shot_size)
    print(f"task mix: {choice['tasks']} (zero-shot on validation {choice['accuracy']}), extraction "
          f"{choice['extraction']}, formats {choice['formats']}", flush=True)
    return zs, choice


def stage2(study: Study, best: Arm, grpo: dict[str, Any], tokens: int, tune: list[int]) -> Arm:
    """``--own-replay``: the control's own rows inside the sharing arm, at the control's budget,
    against the first round's choice (on validation of the tuning seeds)."""
    own = {"weight": SGT_LAMBDA, "replay_steps": 16, "own_extra_rows": 64, "match_tokens": tokens}
    candidates = [Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": {"strategy": "imitate",
                                                                             "imitate": {**own, **extra}}})
                  for name, extra in (("imitate_replay16_own", {}),
                                      ("imitate_replay16_own_pw0.5", {"peer_weight": SGT_LAMBDA / 2}))]
    study.notes.append("Sharing candidates in two stages: imitate and imitate_replay4 first (the matched "
                       f"control's budget, {tokens} tokens a step, is the stage-1 choice's); then, added after "
                       "the first round's test figures were seen, imitate_replay16_own (imitate with the "
                       "control's own earlier successes up to the same budget: the two arms differ by the "
                       "peers' rows) and the same with the peers' rows at half weight; all chosen on validation "
                       "of the tuning seeds only.")
    return study.tune("sharing_stage2", [best, *candidates], tune)


def tuned_arms(study: Study, args: argparse.Namespace) -> tuple[dict[str, Arm], int, str]:
    """The tuning rounds on the tuning seeds: the chosen arms by kind, the compute-matched control's
    token budget a step and the arm it was taken from."""
    tune = args.tune
    ind = study.tune("independent", [Arm(f"independent_lr{n}", "independent", "baseline",
                                         {"grpo": {"learning_rate": lr}})
                                     for n, lr in (("1e-5", 1e-5), ("3e-5", 3e-5))], tune)
    grpo = ind.overrides["grpo"]
    ctrl = Arm("self_imitate", "self_imitate", "baseline",
               {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": {"weight": SGT_LAMBDA}}})
    sharing = [Arm(name, "sharing", "sharing", {"grpo": grpo, "sharing": {"strategy": "imitate",
                                                                          "imitate": {"weight": SGT_LAMBDA, **extra}}})
               for name, extra in (("imitate", {}), ("imitate_replay4", {"replay_steps": 4}))]
    study.run((a, s_) for a in (ctrl, *sharing) for s_ in tune)
    ctrl = study.tune("self_imitate", [ctrl], tune)
    best = study.tune("sharing", sharing, tune)
    tokens = round(study.per_step(best, tune, "train_tokens"))
    budget_from = best.name
    matched = Arm("self_imitate_matched", "self_imitate_matched", "baseline",
                  {"grpo": grpo, "sharing": {"strategy": "self_imitate", "self_imitate": {
                      "weight": SGT_LAMBDA, "extra_rows": 64, "match_tokens": tokens, "replay_steps": 16}}})
    if args.own_replay:
        best = stage2(study, best, grpo, tokens, tune)
    return {"independent": ind, "self_imitate": ctrl, "matched": matched, "sharing": best}, tokens, budget_from


def main() -> None:
    args = checked_args(parser())
    zs, choice = task_choice(args)
    tune, final = args.tune, args.final
    study = Study(args.name, lambda seed: base_config(choice, args, seed), Path(args.out), results=RESULTS,
                  jobs=args.jobs, reuse=args.reuse, parallel=args.parallel, final_seeds=final,
                  reuse_from=["mutual_real_small"] if args.own_replay else [], reuse_from_seeds=tune)
    chosen, tokens, budget_from = tuned_arms(study, args)
    study.notes.append(f"Task mix chosen by the zero-shot study on validation problems: {', '.join(choice['tasks'])}; "
                       f"{args.prompts} prompts x {args.generations} samples per step, {args.steps} steps. "
                       f"Compute-matched control: self_imitate with own earlier successes until a step trains "
                       f"{tokens} tokens ({budget_from}'s per step on the tuning seeds).")
    if "matched_sharing" in args.wanted:  # the chosen sharing arm held to each policy's tokens in the control
        chosen["matched_sharing"] = held_to_control(study, chosen["sharing"], chosen["matched"], tune, choice, args)
    arms = tuple(a for w, a in chosen.items() if w in args.wanted)
    if len(arms) < len(chosen):
        study.notes.append(f"Final seeds {args.final_seeds} trained only: {', '.join(a.name for a in arms)}; the other "
                           "chosen arms are reported on the seeds they trained (arms_on_fewer_seeds), and "
                           "on_common_seeds repeats the peers' share there with every arm competing. The strongest "
                           "baseline of the headline is chosen by validation among the arms on every final seed.")
    study.run((a, s_) for s_ in final for a in arms)
    # every chosen arm is reported: one trained on fewer seeds apart, over its own (the aggregation)
    study.arms = {a.name: a for a in chosen.values()}
    dirs = [Path(args.out) / f"{a.name}-seed{s_}" for a in chosen.values() for s_ in final]
    study.write({"policies": ["smollm2 (SmolLM2-135M-Instruct)", "gemma3 (Gemma-3-270M)"], "zero_shot": zs,
                 "choice": choice, "candidates": CANDIDATES, "steps": args.steps, "tune_seeds": tune,
                 "thl_residual": thl_residual([d for d in dirs if d.is_dir()])})

if __name__ == "__main__":
    main()
