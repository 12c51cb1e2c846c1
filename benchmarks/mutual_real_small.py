"""Real models trained together: SmolLM2-135M-Instruct (Llama, 49k BPE) x Gemma-3-270M (Gemma, 262k
SentencePiece), from PyPI wheels, offline.

    python benchmarks/mutual_real_small.py [--steps 100] [--arms independent,sgt,imitate] [--seeds 0,1,2]
        [--zero-shot-only] [--zero-shot-from RESULT.json] [--reuse] [--name mutual_real_small]

1. **Zero-shot study**: greedy exact accuracy of both models on candidate reasoning-gym task types
   (``--zero-shot-size`` problems each) under each model's prompt formats and two answer
   extractions (``--zero-shot-from`` takes the table of an earlier result instead of measuring
   it). Each model keeps its best format; the extraction (shared by the task's verifier) is the
   one best for both together.
2. **The task mix, by measurement**: the two candidate types on which the models are most
   complementary (model A better on one, B on the other, both partly able), equal weights.
3. **The arms**: each on the same seeds (``--seeds``; run directories ``OUT/ARM-seedN``), steps
   and prompts, from the real-small preset (``examples/real_small.yaml``) with that mix; held-out
   greedy exact accuracy on ``--eval-size`` problems at ``--evals`` points; the paper-style curves and the THL residual of the
   pair (``mutualrl thl report``'s measures on the run's completions) in the report. SGT and
   imitate arms use the zoo study's ``sgt_lambda`` (1.0), their rows joined to the GRPO step. ``--reuse`` keeps an arm whose
   run directory holds a finished run of the same config (``bench_arm.json``: its config and wall
   time) instead of training it again.

Writes ``benchmarks/results/NAME.json`` (``--name``, default ``mutual_real_small``): ``policies``,
``tasks``, ``steps``, ``prompts_per_step``, ``num_generations``, ``eval_size``, ``zero_shot``,
``arms`` -> arm -> ``per_policy_initial``/``_final``/``_best``, ``avg_test_acc_final``, ``wall_s``
(mean per seed); ``thl_residual``; the common keys; and the report under
``benchmarks/results/NAME_report/``. One seed of three arms takes about 1 h 20 min on 2 cores:
run it alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, git_rev, machine, write_result

ROOT = Path(__file__).resolve().parent.parent
TWO = {"min_terms": 2, "max_terms": 2, "allow_parentheses": False, "allow_negation": False}
CANDIDATES: dict[str, dict[str, Any]] = {
    "add": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 2, "max_digits": 2, "operators": ["+"]}},
    "sub": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 2, "max_digits": 2, "operators": ["-"]}},
    "mul": {"name": "basic_arithmetic", "config": {**TWO, "min_digits": 1, "max_digits": 1, "operators": ["*"]}},
    "gcd": {"name": "gcd", "config": {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 40}},
    "legs": {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "min_instances": 1,
                                                "max_instances": 3}},
}
"""Task types both small models might partly solve."""

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


def zero_shot(n: int, max_new: int) -> dict[str, Any]:
    """Greedy exact accuracy per model, format, extraction and task type."""
    import torch

    from mutualrl.config import GRPOOptions
    from mutualrl.modelref import resolve_model_path
    from mutualrl.policy import Policy
    from mutualrl.tasks import GymSource, Task

    sources = [GymSource(c["name"], k, c["config"]) for k, c in CANDIDATES.items()]
    task = Task(sources, [1.0] * len(sources), test_size=n * len(sources), train_size=len(sources) * 600, seed=0)
    out: dict[str, Any] = {}
    for model, formats in FORMATS.items():
        path = resolve_model_path(f"real:{model}")
        out[model] = []
        for fmt in formats:
            pol = Policy(model, path, GRPOOptions(max_completion_length=max_new), **fmt)
            row: dict[str, Any] = {**fmt, "accuracy": {}}
            t = time.perf_counter()
            for src in task.source_names:
                probs = task.test[src][:n]
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


def run_config(choice: dict[str, Any], arm: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The run config of one arm and seed: the real-small preset on the chosen mix and formats."""
    import yaml

    base = yaml.safe_load((ROOT / "examples" / "real_small.yaml").read_text())
    for pol in base["policies"]:
        pol.pop("system_prompt", None)
        pol.update(choice["formats"][pol["name"]])
    base["task"] = {"datasets": [{**CANDIDATES[t], "alias": t} for t in choice["tasks"]],
                    "answer_extraction": choice["extraction"], "test_size": args.eval_size, "train_size": 4000,
                    "reward": "exact", "seed": 0}
    base["grpo"] = {**base["grpo"], "num_generations": args.generations}
    # the arm alone decides the sharing section (not the preset's default strategy), so editing the
    # preset's sharing keeps finished arms reusable; non-SGT arms take the config default λ (unused)
    base["sharing"] = {"strategy": arm}
    base["sharing"].update({step: {"weight": SGT_LAMBDA} for step in ("sgt", "imitate", "self_imitate")})
    base.update(steps=args.steps, prompts_per_step=args.prompts, eval_size=args.eval_size,
                eval_every=max(1, args.steps // (args.evals - 1)), checkpoint_every=10**6, seed=seed)
    return base


def _finished(run_dir: Path, cfg: dict[str, Any]) -> tuple[float, Any] | None:
    """(wall time, load average) of a finished run of ``cfg`` in ``run_dir`` (its ``bench_arm.json``),
    else None. Configs are compared as resolved (defaults filled in), so a field spelled out at its
    default value is the same run as one left out."""
    from mutualrl.errors import UserError
    from mutualrl.resolve import load_config

    try:
        rec = json.loads((run_dir / "bench_arm.json").read_text())
        same = load_config(rec["config"], check_paths=False).to_dict() == load_config(cfg, check_paths=False).to_dict()
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None
    if not same:
        return None
    return float(rec["wall_s"]), rec.get("load_avg")


def thl_residual(run_dirs: list[Path]) -> dict[str, Any]:
    """THL's residual of the pair (SmolLM2 -> Gemma-3 and back) on the completions the runs sampled."""
    from transformers import AutoTokenizer

    from mutualrl.exchange import open_exchange
    from mutualrl.modelref import resolve_model_path
    from mutualrl.resolve import load_config
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


def real_targets(summ: dict[str, Any], best: str = "imitate") -> dict[str, Any]:
    """The sharing issue's figure for real models, measured: the best arm >= independent + 5 points on
    the average of the two policies, positive on every seed."""
    ind, arm = summ.get("independent"), summ.get(best)
    if not ind or not arm:
        return {}
    gap = 100 * (arm["avg_test_acc_final"]["mean"] - ind["avg_test_acc_final"]["mean"])
    per_seed = [100 * (a - i) for a, i in zip(arm["avg_test_acc_final"]["values"], ind["avg_test_acc_final"]["values"],
                                              strict=True)]
    return {"best_arm": best, "best_minus_independent_pts": {"value": gap, "target": 5.0, "met": gap >= 5.0},
            "positive_every_seed": {"values": per_seed, "met": all(v > 0 for v in per_seed)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--arms", default="independent,sgt,imitate")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--eval-size", type=int, default=400)
    ap.add_argument("--evals", type=int, default=6, help="evaluation points (start and end included)")
    ap.add_argument("--zero-shot-size", type=int, default=100)
    ap.add_argument("--zero-shot-only", action="store_true")
    ap.add_argument("--zero-shot-from", type=Path, default=None,
                    help="take the zero-shot table from this result JSON instead of measuring it")
    ap.add_argument("--reuse", action="store_true",
                    help="keep arms whose run directory holds a finished run of the same config")
    ap.add_argument("--out", default="runs/bench_real_small")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (every arm runs each)")
    ap.add_argument("--name", default="mutual_real_small", help="result name (JSON and report directory)")
    args = ap.parse_args()
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1,2")
    zs_given: dict[str, Any] | None = None
    if args.zero_shot_from is not None:
        try:
            zs_given = json.loads(args.zero_shot_from.read_text())["zero_shot"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"--zero-shot-from {args.zero_shot_from}: no zero-shot table there ({exc!r}); give a "
                     "result JSON this benchmark wrote")

    import torch

    from mutualrl.realmodels import prepare_preset
    from mutualrl.report import load_run, summarize, write_report
    from mutualrl.resolve import load_config
    from mutualrl.trainer import MutualTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    prepare_preset("real-small", progress=False)
    zs = zs_given if zs_given is not None else zero_shot(args.zero_shot_size, 12)
    choice = choose(zs, constant_answer_share(), args.zero_shot_size)
    print(f"task mix: {choice['tasks']} (zero-shot {choice['accuracy']}), extraction {choice['extraction']}, "
          f"formats {choice['formats']}", flush=True)
    result: dict[str, Any] = {"zero_shot": zs, "choice": choice, "candidates": CANDIDATES,
                              "zero_shot_from": str(args.zero_shot_from) if args.zero_shot_from else None}
    arms = [a.strip() for a in args.arms.split(",")] if not args.zero_shot_only else []
    dirs: list[Path] = []
    wall: dict[str, list[float]] = {a: [] for a in arms}
    loads: dict[str, list[Any]] = {a: [] for a in arms}
    reused: list[str] = []
    for seed, arm in itertools.product(seeds, arms):  # arms alternate within a seed
        out = Path(args.out) / f"{arm}-seed{seed}"
        cfg = run_config(choice, arm, args, seed)
        done = _finished(out, cfg) if args.reuse else None
        if done is not None:
            wall[arm].append(done[0])
            loads[arm].append(done[1])
            reused.append(f"{arm}-seed{seed}")
            print(f"reusing {arm} seed {seed} ({out}, {done[0]:.0f}s)", flush=True)
        else:
            if out.exists():
                shutil.rmtree(out)
            t, load = time.perf_counter(), os.getloadavg()[0]
            MutualTrainer(load_config(cfg), out, progress=False).train()
            wall[arm].append(time.perf_counter() - t)
            loads[arm].append({"start": load, "end": os.getloadavg()[0]})
            (out / "bench_arm.json").write_text(json.dumps({"config": cfg, "wall_s": wall[arm][-1],
                                                            "load_avg": loads[arm][-1]}, indent=1))
            print(f"done {arm} seed {seed} in {wall[arm][-1]:.0f}s", flush=True)
        dirs.append(out)
    result["reused_arms"] = reused
    if dirs:
        summ = summarize([load_run(x) for x in dirs])
        for arm, s in summ.items():
            s["wall_s"], s["wall_s_per_seed"], s["load_avg"] = statistics.fmean(wall[arm]), wall[arm], loads[arm]
            print(f"{arm:<14} average {s['avg_test_acc_initial']['mean']:.3f} -> {s['avg_test_acc_final']['mean']:.3f}"
                  f"  per policy " + ", ".join(f"{p} {s['per_policy_initial'][p]['mean']:.3f} -> "
                                              f"{s['per_policy_final'][p]['mean']:.3f}" for p in s["per_policy_final"])
                  + f"  ({s['wall_s']:.0f}s per seed)", flush=True)
        write_report(dirs, RESULTS / f"{args.name}_report", title="mutualrl real-small: SmolLM2-135M x Gemma-3-270M",
                     notes=[(f"Task mix chosen by the zero-shot study: {', '.join(choice['tasks'])}; "
                            f"{args.prompts} prompts x {args.generations} samples per step, seeds {args.seeds}, "
                            f"{args.steps} steps per arm."),
                            *([f"Arms {', '.join(reused)} are earlier runs of the same config, kept (--reuse)."]
                              if reused else [])])
        result.update(arms=summ, thl_residual=thl_residual(dirs))
    mach = machine()
    mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
    # the study alone (--zero-shot-only) does not stand for a training run: its own file
    write_result("mutual_real_small_zero_shot" if args.zero_shot_only else args.name, {
        "policies": ["smollm2 (SmolLM2-135M-Instruct)", "gemma3 (Gemma-3-270M)"], "tasks": choice["tasks"],
        "steps": args.steps if arms else 0, "prompts_per_step": args.prompts, "num_generations": args.generations,
        "eval_size": args.eval_size, "seeds": seeds, **result,
        "config": run_config(choice, arms[0] if arms else "independent", args, seeds[0]),
        "targets": real_targets(result.get("arms", {})),
        "machine": mach, "quick": False, "wall_s": time.perf_counter() - t0, "git_rev": git_rev(),
    })


if __name__ == "__main__":
    main()
