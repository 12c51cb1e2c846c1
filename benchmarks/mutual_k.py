"""Three and more policies: does a third peer add to the first two, and what does K cost?

    python benchmarks/mutual_k.py [--seeds 0,1,2] [--steps 300] [--cost-only] [--sweep-only] [--reuse]
                                  [--k2-from runs/bench_mutual/full]

1. **Three policies of three families and tokenizer kinds** on the zoo task (2-digit addition and
   subtraction): the shipped ``gpt2-add`` (GPT-2, byte-level BPE; addition, subtraction lost) and
   ``llama-sub`` (Llama, Unigram; the reverse), and ``neox-mix`` (GPT-NeoX, characters), a weak
   generalist warm-started to 10-30 % on both skills (built once here, cached): a third peer that
   holds some of each skill, so it can give to both others and take from both.
2. **The K-sweep**: ``independent`` for every policy (independent training does not depend on K:
   the first two together, the third alone), the best sharing arm (``imitate``) with the first two
   policies (K = 2; ``--k2-from`` takes these and the independent pair from ``benchmarks/mutual.py``'s
   runs, which have the same config) and with all three (K = 3); 3 seeds, the demo's settings (64 prompts
   x 8 samples per policy per step: equal rollout budget per policy), held-out accuracy per policy
   and skill, peer rows used from each peer and their acceptance (used / offered), the THL residual
   of each tokenizer pair on the peers' verified texts.
3. **Cost against K** (K = 1..4 zoo policies, the fourth a second GPT-2): measured step time, rows
   published and query time per step, peak memory per worker, and the planner's predicted step
   time, from short runs of ``imitate`` (``independent`` at K = 1), one after another, idle.

The sweep is a study definition on the library harness (:class:`mutualrl.study.Study`): each run in
its own process, recorded in ``benchmarks/results/mutual_k_runs/``; ``--reuse`` keeps a finished run
directory of the same config (the sweep reads the directories: their peer rows and exchange). The
cost runs are timed in this process.

Writes ``benchmarks/results/mutual_k.json`` and ``benchmarks/results/mutual_k_report/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, git_rev, machine, write_result

from mutualrl.study import Arm, Study

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["gpt2-add", "llama-sub", "neox-mix"]
BEST = "imitate"


def build_three() -> tuple[dict[str, Path], dict[str, Any]]:
    """The three zoo policies (the shipped two, neox-mix built once and cached) and the zoo task."""
    from mutualrl.zoo.build import build_zoo

    return build_zoo(NAMES, seed=0, progress=False), {"preset": "zoo"}


def run_config(dirs: dict[str, Path], names: list[str], task: dict[str, Any], strategy: str, seed: int,
               steps: int, *, eval_every: int | None = None, eval_size: int = 1000) -> dict[str, Any]:
    """The demo's settings for ``names`` (a ``-b`` suffix: a second copy of a policy) on ``task``."""
    from mutualrl.demo import demo_config

    cfg = demo_config(strategy, seed, steps=steps)
    cfg["policies"] = [{"name": n, "model": str(dirs.get(n, dirs.get(n.removesuffix("-b"))))} for n in names]
    cfg["task"] = {**task, "test_size": eval_size, "seed": 0, "reward": "exact"}
    cfg["eval_size"] = eval_size
    cfg["eval_every"] = eval_every or max(1, steps // 6)
    return cfg


def train(cfg: dict[str, Any], out: Path) -> Path:
    """Train ``cfg`` into ``out`` (emptied first) in this process: the cost runs are timed here."""
    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer

    if out.exists():
        shutil.rmtree(out)
    MutualTrainer(load_config(cfg), out, progress=False).train()
    return out


def peer_table(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per learner, per peer: rows used per step and acceptance (used / offered over the run)."""
    out: dict[str, dict[str, Any]] = {}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("event") != "eval"]
    for r in steps:
        learner = out.setdefault(r["policy"], {})
        for k, v in r.items():
            if k.startswith("peer_rows/"):
                peer = k.split("/", 1)[1]
                e = learner.setdefault(peer, {"used": 0.0, "offered": 0.0, "steps": 0})
                e["used"] += v
                e["offered"] += r.get(f"peer_offered/{peer}", 0.0)
                e["steps"] += 1
    for learner in out.values():
        for e in learner.values():
            e["used_per_step"] = e["used"] / max(1, e["steps"])
            e["acceptance"] = e["used"] / e["offered"] if e["offered"] else None
    return out


def pair_residuals(dirs: dict[str, Path], run_dir: Path, names: list[str]) -> dict[str, Any]:
    """THL's residual for each ordered tokenizer pair on the verified texts the run's peers shared."""
    from transformers import AutoTokenizer

    from mutualrl.config.resolve import run_config as saved_config
    from mutualrl.exchange import open_exchange
    from mutualrl.tasks.build import build_task
    from mutualrl.thl.align import align_batch
    from mutualrl.thl.residual import pair_report

    ids = sorted(build_task(saved_config(run_dir).task).known_ids())
    with open_exchange(f"sqlite:///{(run_dir / 'exchange.db').resolve()}") as ex:
        texts = {n: [r.completion for r in ex.query(ids, kinds=["verified_success"], limit=4000)
                     if r.source_policy == n and r.completion] for n in names}
    toks = {n: AutoTokenizer.from_pretrained(dirs[n]) for n in names}
    out = {}
    for a in names:
        for b in names:
            if a != b and texts[a]:
                out[f"{a}->{b}"] = pair_report(align_batch(texts[a][:1000], toks[a], toks[b])).as_dict()
    return out


def _runs_for(key: str, seed: int, args: argparse.Namespace) -> Path | None:
    """A finished run of ``benchmarks/mutual.py`` (``--k2-from``) that is this sweep's run: same
    demo config, same policies, same seed (``independent-K2`` / ``imitate-K2``)."""
    if not args.k2_from or not key.endswith("-K2"):
        return None
    d = Path(args.k2_from) / f"{key.removesuffix('-K2')}-seed{seed}"
    return d if (d / "summary.json").is_file() else None


def sweep_arms(dirs: dict[str, Path]) -> list[Arm]:
    """The sweep's arms: independent training does not depend on K (no policy reads another's rows),
    so the first two alone (K = 2) and the third alone (K = 1) give every policy's independent figure;
    the best sharing arm with the first two (K = 2) and with all three (K = 3)."""
    names = list(dirs)
    arms = [("independent", names[:2], "K2"), ("independent", names[2:], "K1"), (BEST, names[:2], "K2"),
            (BEST, names, "K3")]
    return [Arm(f"{strategy}-{k}", strategy, "baseline" if strategy == "independent" else "sharing",
                {"policies": [{"name": n, "model": str(dirs[n])} for n in pols], "sharing": {"strategy": strategy}})
            for strategy, pols, k in arms]


def sweep_runs(dirs: dict[str, Path], task: dict[str, Any], args: argparse.Namespace) -> dict[str, list[Path]]:
    """Train (or reuse) every sweep arm on every seed; the run directories by arm."""
    study = Study("mutual_k", lambda seed: run_config(dirs, list(dirs), task, "independent", seed, args.steps),
                  Path(args.out), results=RESULTS, reuse=args.reuse, records_suffice=False)
    run_dirs: dict[str, list[Path]] = {}
    todo = []
    for seed in args.seeds:
        for arm in sweep_arms(dirs):
            study_run = _runs_for(arm.name, seed, args)
            if study_run is not None:
                print(f"{arm.name} seed {seed}: the zoo study's run {study_run}", flush=True)
            else:
                todo.append((arm, seed))
            run_dirs.setdefault(arm.name, []).append(study_run or Path(args.out) / f"{arm.name}-seed{seed}")
    study.run(todo)
    return run_dirs


def sweep(dirs: dict[str, Path], task: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from mutualrl.study.report import load_run, summarize, write_report

    names = list(dirs)
    run_dirs = sweep_runs(dirs, task, args)
    result: dict[str, Any] = {"runs": {k: [str(d) for d in ds] for k, ds in run_dirs.items()}}
    for key, ds in run_dirs.items():
        (s,) = summarize([load_run(d) for d in ds]).values()
        s["peers"] = [peer_table(d) for d in ds]
        result[key] = s
    write_report(run_dirs[f"{BEST}-K3"], RESULTS / "mutual_k_report", title="mutualrl: three policies (K = 3)",
                 notes=[f"{BEST} with all three policies; independent and the K = 2 runs are in mutual_k.json."])

    def per_policy(key: str, pol: str) -> list[float]:
        return result[key]["per_policy_final"][pol]["values"]

    independent = {p: per_policy("independent-K2" if p in names[:2] else "independent-K1", p) for p in names}
    result["per_policy_final"] = {
        p: {"independent": independent[p], **({f"{BEST}-K2": per_policy(f"{BEST}-K2", p)} if p in names[:2] else {}),
            f"{BEST}-K3": per_policy(f"{BEST}-K3", p)} for p in names}
    shared = names[:2]

    def shared_avg(by_policy: dict[str, list[float]]) -> list[float]:
        return [statistics.fmean(v) for v in zip(*(by_policy[p] for p in shared), strict=True)]

    ind = shared_avg(independent)
    k2 = shared_avg({p: per_policy(f"{BEST}-K2", p) for p in shared})
    k3 = shared_avg({p: per_policy(f"{BEST}-K3", p) for p in shared})
    third = names[2]
    result["shared_policies"] = shared
    result["shared_avg_final"] = {"independent": ind, f"{BEST}-K2": k2, f"{BEST}-K3": k3}
    result["third_policy"] = {"name": third, "independent": independent[third],
                              f"{BEST}-K3": per_policy(f"{BEST}-K3", third)}
    result["target_k3_ge_k2"] = {"k2_mean": statistics.fmean(k2), "k3_mean": statistics.fmean(k3),
                                 "met": statistics.fmean(k3) >= statistics.fmean(k2)}
    result["thl_pair_residual"] = pair_residuals(dirs, run_dirs[f"{BEST}-K3"][0], names)
    return result


def cost(dirs: dict[str, Path], task: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Step time, rows and query time per step, peak memory and the plan's prediction, K = 1..4."""
    names = list(dirs) + [f"{next(iter(dirs))}-b"]
    out: dict[str, Any] = {"steps": args.cost_steps, "load_avg": {"start": os.getloadavg()[0]}}
    for k in range(1, 5):
        strategy = "independent" if k == 1 else BEST
        run = Path(args.out) / f"cost-K{k}"
        cfg = run_config(dirs, names[:k], task, strategy, 0, args.cost_steps, eval_every=10**6, eval_size=40)
        train(cfg, run)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in rows if r.get("event") != "eval" and r["step"] >= 2]  # the first steps warm up
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in steps:
            by_step.setdefault(r["step"], []).append(r)
        plan = json.loads((run / "allocation.json").read_text())["plans"][0] if (run / "allocation.json").is_file() \
            else {}
        out[f"K{k}"] = {
            "strategy": strategy,
            "step_s": statistics.fmean(max(r["step_s"] for r in rs) for rs in by_step.values()),
            "predicted_step_s": plan.get("predicted_step_s"),
            "rows_published_per_step": statistics.fmean(sum(r.get("published", 0) for r in rs)
                                                        for rs in by_step.values()),
            "query_s_per_step": statistics.fmean(max(r.get("query_s", 0.0) for r in rs) for rs in by_step.values()),
            "peer_rows_used_per_step": statistics.fmean(sum(r.get("peer_rows", 0) for r in rs)
                                                        for rs in by_step.values()),
            "peak_rss_mb_per_worker": max(r.get("rss_peak_mb", 0.0) for r in steps),
        }
        print(f"cost K={k}: {out[f'K{k}']}", flush=True)
    out["load_avg"]["end"] = os.getloadavg()[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--cost-steps", type=int, default=12)
    ap.add_argument("--cost-only", action="store_true")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="keep finished sweep runs of the same config in --out")
    ap.add_argument("--out", default="runs/bench_mutual_k")
    ap.add_argument("--k2-from", default=None, help="the run folder of `benchmarks/mutual.py` (e.g. "
                    "runs/bench_mutual/full): its independent and imitate runs are this sweep's K = 2 runs "
                    "(the same demo config and seeds), so they are not trained twice")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    dirs, task = build_three()
    result: dict[str, Any] = {"policies": list(dirs), "task": "zoo (add, sub)",
                              "seeds": args.seeds, "steps": args.steps, "best_arm": BEST}
    previous = RESULTS / "mutual_k.json"
    if previous.is_file():  # one part at a time keeps the other's figures
        old = json.loads(previous.read_text())
        result.update({k: old[k] for k in ("sweep", "cost") if k in old})
    if not args.cost_only:
        result["sweep"] = sweep(dirs, task, args)
    if not args.sweep_only:
        result["cost"] = cost(dirs, task, args)
    mach = machine()
    mach["load_avg"] = {"start": load0, "end": os.getloadavg()[0]}
    write_result("mutual_k", {**result, "machine": mach, "quick": False, "wall_s": time.perf_counter() - t0,
                              "git_rev": git_rev()})


if __name__ == "__main__":
    main()
