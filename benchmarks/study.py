"""The protocol a reviewer accepts, for every learning study (``mutual.py``, ``mutual_taskmix.py``,
``mutual_real_small.py``): choices on validation, the test split read once, compute-matched
baselines, seeds that vary the prompts, paired intervals, committed per-run metrics.

A study is a sequence of *tuning rounds* and one *final round*:

- a tuning round runs each candidate of a family (``independent`` at several learning rates, say)
  on the tuning seeds and keeps the candidate with the best mean final **validation** accuracy
  (the average over the policies); later rounds build on the choices of earlier ones (the sharing
  arms take the tuned GRPO settings);
- the final round runs every chosen arm on every final seed. A run's seed is its prompt stream's
  (``task.prompt_seed`` follows the run's ``seed``) and its sampling's; its test split is read once,
  at its end. Tuning runs of a chosen candidate on a final seed are final runs (their test figure was
  never looked at by the choice).

Every run's compact metrics (eval rows, per-step rows of the keys that matter, its config, the code
revision that trained it) go to ``benchmarks/results/<study>_runs/<arm>-seed<N>.json``; the study's
JSON is aggregated from those files alone (``python benchmarks/study.py aggregate <study>`` does it
again; ``--write`` replaces the committed JSON's figures with it, e.g. after runs of a further seed),
so every figure can be traced and recomputed.

Runs go ``--jobs`` at a time, each in its own process (torch threads = cores / jobs); ``--reuse``
keeps finished runs whose config is unchanged (a run directory's summary, or a committed compact
record when the run directories are gone) and resumes interrupted ones. Run the study from a
clean checkout (a ``git worktree`` at a commit) so that the recorded revision is the code that
trained each run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, cpu_kind, git_rev, machine, weights_fingerprint, write_result, write_result_to

STEP_KEYS = ("reward_mean", "train_acc", "train_tokens", "optimizer_steps", "gen_tokens", "peer_rows", "loss",
             "step_s", "informative_group_frac", "zero_var_group_frac", "imitate_rescue", "imitate_own",
             "self_imitate_extra", "imitate_own_extra", "imitate_replayed", "sgt_rescue", "prp_peer_samples",
             "resample_rounds")
"""The per-step metrics a compact run keeps (besides step and policy)."""
def spec_path(run_dir: Path) -> Path:
    """A run's spec beside its directory (``<arm>-seed<N>.spec.json``): arm, seed, config, revision."""
    return run_dir.with_name(run_dir.name + ".spec.json")


def provenance_path(run_dir: Path) -> Path:
    """What the run's own process recorded at its start (revision, load), beside its directory."""
    return run_dir.with_name(run_dir.name + ".provenance.json")


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in, mappings recursively (lists and scalars replace)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else copy.deepcopy(v)
    return out


@dataclass
class Arm:
    """One arm of a study: a name, its family, its role and its config overrides."""

    name: str
    family: str
    role: str
    """``baseline`` (single model), ``sharing``, ``efficiency`` (sharing at a smaller own budget),
    ``half_baseline`` (single model at that budget) or ``matched_sharing`` (a sharing arm held to each
    policy's compute in the strongest baseline: reported against it, not a candidate for the best arm)."""
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Study:
    """Runs arms on seeds under one base config; records and aggregates them."""

    name: str
    base_config: Callable[[int], dict[str, Any]]
    """seed -> the run config every arm starts from."""
    out: Path
    jobs: int = 1
    reuse: bool = False
    parallel: int | None = None
    """Runs at once (default ``jobs``): fewer than ``jobs`` keeps the runs' configs (threads = cores /
    jobs) where memory does not hold ``jobs`` of them (two real-model runs peak at ~24 GB together)."""
    final_seeds: list[int] | None = None
    """The final round's seeds, when they are declared (fresh seeds apart from the tuning seeds): the
    headline is aggregated over these alone, so a tuning run on another seed of a chosen arm stays out
    of it. None: the longest seed list an arm holds (the tuning seed is then one of the final ones)."""
    reuse_from: list[str] = field(default_factory=list)
    """Other studies whose committed records this one may take, copied into its own ``_runs/`` (with
    ``reuse``; marked ``reused_from``): a later stage of a study reuses the earlier stage's runs of the
    same config instead of training them again."""
    reuse_from_seeds: list[int] | None = None
    """The seeds whose records ``reuse_from`` may give (a later stage takes the earlier one's tuning
    runs, never its final runs, whose test split was read); None: any."""
    keep_checkpoints: bool = False
    """Keep a finished run's checkpoints (default: removed once its compact record is written: the
    record is all the study reads, and two checkpoints of the real-model pair take ~10 GB a run)."""
    arms: dict[str, Arm] = field(default_factory=dict)
    tuning: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    load_start: float = field(default_factory=lambda: os.getloadavg()[0])
    _fingerprints: dict[str, str] = field(default_factory=dict)
    _trained: set[Path] = field(default_factory=set)
    """Run directories this study process trained (a later round reuses them even without --reuse)."""

    @property
    def runs_dir(self) -> Path:
        return RESULTS / f"{self.name}_runs"

    def config(self, arm: Arm, seed: int) -> dict[str, Any]:
        cfg = deep_merge(self.base_config(seed), arm.overrides)
        cfg["seed"] = seed
        cfg.setdefault("task", {}).pop("prompt_seed", None)  # the prompt stream follows the run's seed
        return cfg

    # ------------------------------------------------------------------ running
    def run(self, pairs: Iterable[tuple[Arm, int]]) -> None:
        """Train every (arm, seed) not yet recorded, ``jobs`` at a time; record each compactly."""
        from mutualrl.run.checkpoint import latest_checkpoint

        todo = []
        for arm, seed in pairs:
            self.arms.setdefault(arm.name, arm)
            d = self.out / f"{arm.name}-seed{seed}"
            cfg = self.config(arm, seed)
            if (self.reuse or d in self._trained) and self._finished(d, cfg):  # this study trained it already
                self._record(arm, seed, d)
                continue
            if self.reuse and self._recorded(arm, seed, cfg):  # a committed record of this run: kept as it is
                continue
            resume = self.reuse and d.is_dir() and self._same_spec(d, cfg) and latest_checkpoint(d) is not None
            if d.exists() and not resume:
                shutil.rmtree(d)
            d.parent.mkdir(parents=True, exist_ok=True)
            spec_path(d).write_text(json.dumps({"arm": arm.name, "family": arm.family, "role": arm.role, "seed": seed,
                                                "overrides": arm.overrides, "config": cfg, "git_rev": git_rev()}))
            todo.append((arm, seed, d, resume))
        threads = max(1, (os.cpu_count() or 1) // max(1, self.jobs))
        running: list[tuple[Arm, int, Path, subprocess.Popen]] = []
        at_once = max(1, min(self.parallel or self.jobs, self.jobs))  # more than jobs would oversubscribe
        for arm, seed, d, resume in todo:
            while len(running) >= at_once:
                running = self._reap(running)
                if len(running) >= at_once:
                    time.sleep(2)
            cmd = [sys.executable, __file__, "--one", str(d)] + (["--resume"] if resume else [])
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            print(f"[{self.name}] {arm.name} seed {seed}{' (resumed)' if resume else ''} -> {d}", file=sys.stderr,
                  flush=True)
            log = open(d.with_name(d.name + ".log"), "ab")  # noqa: SIM115 - the run writes it for its whole life
            running.append((arm, seed, d, subprocess.Popen(cmd, env=env, stdout=log, stderr=log)))
        while running:
            running = self._reap(running)
            if running:
                time.sleep(2)

    def _reap(self, running: list[tuple[Arm, int, Path, subprocess.Popen]]) -> list[tuple[Arm, int, Path, subprocess.Popen]]:
        """Record every run that finished (at once, so that a study stopped later keeps it); stop the
        study at the first failed run, terminating the others (a rerun would race them)."""
        left = []
        for arm, seed, d, proc in running:
            code = proc.poll()
            if code is None:
                left.append((arm, seed, d, proc))
            elif code != 0:
                for *_, other in running:
                    if other.poll() is None:
                        other.terminate()
                        other.wait()
                raise SystemExit(f"run {arm.name} seed {seed} failed (exit {code}); log {d}.log")
            else:
                self._record(arm, seed, d)
                self._trained.add(d)
                if not self.keep_checkpoints:  # the record is what the study reads; a real model's are GBs
                    shutil.rmtree(d / "checkpoints", ignore_errors=True)
                print(f"[{self.name}] {arm.name} seed {seed} recorded ({self.runs_dir.name}/{arm.name}-seed{seed}.json)",
                      file=sys.stderr, flush=True)
        return left

    def _same_spec(self, d: Path, cfg: dict[str, Any]) -> bool:
        from mutualrl.config.resolve import load_config

        try:
            spec = json.loads(spec_path(d).read_text())
            return load_config(spec["config"], check_paths=False) == load_config(cfg, check_paths=False)
        except (OSError, ValueError, KeyError):
            return False

    def _recorded(self, arm: Arm, seed: int, cfg: dict[str, Any]) -> bool:
        """Whether ``runs_dir`` already holds this run's compact record, trained on the same config
        (torch ``threads`` aside).

        The records are what is committed, so a study continued on a fresh machine (its run directories
        gone) reuses them instead of retraining."""
        from mutualrl.config.resolve import load_config

        name = f"{arm.name}-seed{seed}.json"
        try:
            wanted = dataclasses.replace(load_config(cfg, check_paths=False), threads=None)
        except ValueError:
            return False
        others = [] if self.reuse_from_seeds is not None and seed not in self.reuse_from_seeds else self.reuse_from
        for runs_dir in (self.runs_dir, *(RESULTS / f"{other}_runs" for other in others)):
            path = runs_dir / name
            try:
                record = json.loads(path.read_text())
                recorded = load_config(record["config"], check_paths=False)
            except (OSError, ValueError, KeyError):
                continue
            # torch threads set the speed, not the training: a record trained on other threads is kept
            # (its config, threads included, stays in the record)
            if dataclasses.replace(recorded, threads=None) != wanted:
                continue
            if record.get("weights") and (here := self.weights(cfg)) and record["weights"] != here:
                # the same config on other starting weights (a zoo build of another CPU kind): trained again
                print(f"[{self.name}] {name}: recorded on other starting weights than this machine's; trained again",
                      file=sys.stderr, flush=True)
                continue
            if runs_dir != self.runs_dir:  # the record joins this study's runs, marked where it came from
                self.runs_dir.mkdir(parents=True, exist_ok=True)
                record["reused_from"] = runs_dir.name[:-len("_runs")]
                (self.runs_dir / name).write_text(json.dumps(record, separators=(",", ":")))
            return True
        return False

    def weights(self, cfg: Mapping[str, Any]) -> dict[str, str]:
        """The fingerprint of each policy's starting weights in ``cfg`` (cached per model path)."""
        from mutualrl.config.modelref import resolve_model_path

        out = {}
        for pol in cfg["policies"]:
            try:
                path = resolve_model_path(pol["model"])
            except Exception:  # noqa: BLE001 - a model this machine cannot resolve: nothing to compare
                return {}
            if path not in self._fingerprints:
                self._fingerprints[path] = weights_fingerprint(path)
            out[pol["name"]] = self._fingerprints[path]
        return out

    def _finished(self, d: Path, cfg: dict[str, Any]) -> bool:
        return (d / "summary.json").is_file() and self._same_spec(d, cfg)

    def _record(self, arm: Arm, seed: int, d: Path) -> None:
        from mutualrl.study.report import load_run

        run = load_run(d)
        spec = json.loads(spec_path(d).read_text())
        prov = json.loads(provenance_path(d).read_text()) if provenance_path(d).is_file() else {}
        compact = {"arm": arm.name, "family": arm.family, "role": arm.role, "seed": seed, "overrides": arm.overrides,
                   "git_rev": prov.get("git_rev", spec.get("git_rev")), "load_avg": prov.get("load_avg"),
                   **{k: prov[k] for k in ("cpu", "weights") if k in prov},
                   "policies": run["policies"], "strategy": run["strategy"], "wall_s": run["wall_s"],
                   "config": json.loads(json.dumps(spec["config"])), "evals": run["evals"],
                   "steps": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                              if k in STEP_KEYS or k in ("step", "policy")} for r in run["steps"]]}
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        (self.runs_dir / f"{arm.name}-seed{seed}.json").write_text(json.dumps(compact, separators=(",", ":")))

    # ------------------------------------------------------------------ protocol
    def tune(self, family: str, candidates: Sequence[Arm], seeds: Sequence[int]) -> Arm:
        """Run ``candidates`` on ``seeds``; the one with the best mean final validation accuracy."""
        self.run((a, s) for a in candidates for s in seeds)
        runs = load_compacts(self.runs_dir)
        _check_paired_builds([r for r in runs if r["arm"] in {a.name for a in candidates} and r["seed"] in seeds])
        scores = {}
        for a in candidates:
            vals = [_val(r) for r in runs if r["arm"] == a.name and r["seed"] in seeds]
            scores[a.name] = {"val_final": vals, "mean": statistics.fmean(vals), "overrides": a.overrides}
        chosen = max(candidates, key=lambda a: scores[a.name]["mean"])
        self.tuning[family] = {"seeds": list(seeds), "candidates": scores, "chosen": chosen.name,
                               "rule": "highest mean final validation accuracy (average over the policies)"}
        print(f"[{self.name}] {family}: chose {chosen.name} "
              + ", ".join(f"{n} {100 * v['mean']:.1f}" for n, v in scores.items()), file=sys.stderr, flush=True)
        return chosen

    def per_step_by_policy(self, arm: Arm, seeds: Sequence[int], key: str) -> dict[str, float]:
        """The mean of step metric ``key`` of ``arm`` per step, for each policy (from its recorded runs)."""
        runs = [r for r in load_compacts(self.runs_dir) if r["arm"] == arm.name and r["seed"] in seeds]
        return {p: statistics.fmean(s.get(key, 0) for r in runs for s in r["steps"] if s["policy"] == p)
                for p in runs[0]["policies"]}

    def per_step(self, arm: Arm, seeds: Sequence[int], key: str) -> float:
        """The mean of step metric ``key`` of ``arm`` per policy and step (from its recorded runs)."""
        runs = [r for r in load_compacts(self.runs_dir) if r["arm"] == arm.name and r["seed"] in seeds]
        return statistics.fmean(s.get(key, 0) for r in runs for s in r["steps"])

    def write(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Aggregate the recorded runs of this study's arms into ``results/<name>.json`` and the report."""
        threads = sorted({r["config"].get("threads") or 0 for r in load_compacts(self.runs_dir) if r["arm"] in self.arms})
        if len(threads) > 1:
            self.notes.append(f"Runs trained on {' or '.join(map(str, threads))} torch threads (records reused "
                              "across a change of threads, which sets the speed, not the training).")
        result = aggregate(self.name, [a.name for a in self.arms.values()], self.final_seeds)
        mach = machine()
        mach["load_avg"] = {"start": self.load_start, "end": os.getloadavg()[0]}
        result.update({"tuning": self.tuning, "notes": self.notes, "machine": mach, "jobs": self.jobs,
                       **({"declared_final_seeds": self.final_seeds} if self.final_seeds else {}),
                       "wall_s": time.perf_counter() - self.t0, **(extra or {})})
        write_result(self.name, result)
        dirs = [self.out / f"{r['arm']}-seed{r['seed']}" for r in load_compacts(self.runs_dir)
                if r["arm"] in self.arms and (self.out / f"{r['arm']}-seed{r['seed']}").is_dir()]
        if dirs:
            from mutualrl.study.report import write_report

            write_report(dirs, RESULTS / f"{self.name}_report", title=f"mutualrl {self.name}", notes=self.notes)
        print_table(result)
        return result


# ----------------------------------------------------------------------------- aggregation
def load_compacts(runs_dir: Path) -> list[dict[str, Any]]:
    """Every compact run of a study (``<arm>-seed<N>.json``)."""
    return [json.loads(p.read_text()) for p in sorted(runs_dir.glob("*-seed*.json"))]


def _val(run: Mapping[str, Any]) -> float:
    from mutualrl.study.evidence import final_accuracy

    v = final_accuracy(run, "val")
    if v is None:
        raise SystemExit(f"run {run['arm']} seed {run['seed']} has no validation accuracy (task.val_size)")
    return v


def aggregate(name: str, arms: Sequence[str] | None = None, final_seeds: Sequence[int] | None = None
              ) -> dict[str, Any]:
    """The study's figures from its compact runs alone: per arm accuracy and compute, the pairwise
    differences, the peers' share and the efficiency comparisons (see the module docstring).

    The final seeds are ``final_seeds`` when given (runs on other seeds, such as a chosen arm's tuning
    run, are left out), else the longest seed list any arm holds; the arms holding all of them make the
    headline (``arms``, ``peers_share``). An arm trained on fewer seeds (a study whose later seeds
    trained only the headline's arms) is kept apart in ``arms_on_fewer_seeds``, over its own seeds, and
    ``on_common_seeds`` repeats the peers' share over the seeds every arm holds, every arm competing:
    so the strongest baseline among all the chosen arms stays visible."""
    runs = [r for r in load_compacts(RESULTS / f"{name}_runs") if (arms is None or r["arm"] in arms)
            and (final_seeds is None or r["seed"] in final_seeds)]
    _check_paired_builds(runs)
    roles = {r["arm"]: r["role"] for r in runs}
    seeds_of: dict[str, list[int]] = {}
    for r in runs:
        seeds_of.setdefault(r["arm"], []).append(r["seed"])
    final_seeds = sorted(final_seeds) if final_seeds is not None else (
        sorted(max(seeds_of.values(), key=len)) if seeds_of else [])
    final = [a for a, s in seeds_of.items() if set(final_seeds) <= set(s)]  # arms of the final round
    fewer = [a for a in seeds_of if a not in final]
    out: dict[str, Any] = {"study": name, "protocol": PROTOCOL, "final_seeds": final_seeds,
                           "arms": {a: _arm_summary(runs, a, final_seeds) for a in final},
                           "git_rev": git_rev(), "quick": False}
    out.update(_comparisons(runs, roles, final, final_seeds, out["arms"]))
    if fewer:
        out["arms_on_fewer_seeds"] = {a: _arm_summary(runs, a, sorted(seeds_of[a])) for a in fewer}
        common = sorted(set.intersection(*(set(s) for s in seeds_of.values())))
        if common:
            every = {a: _arm_summary(runs, a, common) for a in seeds_of}
            cmp = _comparisons(runs, roles, list(seeds_of), common, every)
            out["on_common_seeds"] = {"seeds": common, **{k: cmp[k] for k in ("peers_share", "pairwise") if k in cmp}}
    return out


def _check_paired_builds(runs: Sequence[Mapping[str, Any]]) -> None:
    """Refuse to pair runs of one seed that started from different weights (a zoo build made on
    another CPU kind under the same cache path): their difference would not be the arms'. Records
    from before the weights were recorded are not checked."""
    seen: dict[int, dict[str, str]] = {}
    for r in runs:
        if not r.get("weights"):
            continue
        first = seen.setdefault(r["seed"], {"arm": r["arm"], "weights": json.dumps(r["weights"], sort_keys=True)})
        if json.dumps(r["weights"], sort_keys=True) != first["weights"]:
            raise SystemExit(f"seed {r['seed']}: {r['arm']} started from other weights ({r['weights']}) than "
                             f"{first['arm']} ({first['weights']}); runs of one seed pair only on one build: "
                             "train the seed's arms on one machine kind, or leave one out (--arms)")


def _arm_summary(runs: Sequence[Mapping[str, Any]], arm: str, seeds: Sequence[int]) -> dict[str, Any]:
    """One arm's accuracy and compute over ``seeds`` (its runs' final test and validation accuracy,
    per policy, what they spent, the revisions that trained them)."""
    from mutualrl.study import evidence

    rs = [r for r in runs if r["arm"] == arm and r["seed"] in seeds]
    test = [evidence.final_accuracy(r, "test") for r in rs]
    val = [evidence.final_accuracy(r, "val") for r in rs]
    spent = [evidence.compute_spent(r) for r in rs]
    per_pol = [evidence.final_per_policy(r, "test") for r in rs]
    return {"role": rs[0]["role"], "family": rs[0]["family"], "strategy": rs[0]["strategy"],
            "overrides": rs[0]["overrides"], "seeds": [r["seed"] for r in rs],
            "test_final": _summary(test), "val_final": _summary(val),
            "per_policy_test_final": {p: {k: statistics.fmean(x[p][k] for x in per_pol) for k in per_pol[0][p]}
                                      for p in per_pol[0]},
            **{k: _summary([s.get(k, 0.0) for s in spent]) for k in spent[0]},
            "git_revs": sorted({str(r.get("git_rev")) for r in rs})}


def _compute_ratios(runs: Sequence[Mapping[str, Any]], table: Mapping[str, Mapping[str, Any]], arm: str,
                    baseline: str) -> dict[str, Any]:
    """``arm``'s compute over ``baseline``'s: the means' ratios of trained tokens, optimizer steps and
    sampled tokens, and the trained tokens' ratio per seed and per policy."""
    from mutualrl.study import evidence

    tok = evidence.token_ratios(runs, arm, baseline)
    return {**{k: table[arm][k]["mean"] / max(table[baseline][k]["mean"], 1e-9)
               for k in ("trained_tokens", "optimizer_steps", "sampled_tokens")},
            "trained_tokens_per_seed": tok["per_seed"], "trained_tokens_per_policy": tok["per_policy"]}


def _comparisons(runs: Sequence[Mapping[str, Any]], roles: Mapping[str, str], arms: Sequence[str],
                 seeds: Sequence[int], table: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The peers' share, the pairwise differences, the compute match and the efficiency comparisons
    among ``arms`` over ``seeds``."""
    from mutualrl.study import evidence

    base = [a for a in arms if roles[a] == "baseline"]
    share = [a for a in arms if roles[a] == "sharing"]
    sel = [r for r in runs if r["seed"] in seeds and r["arm"] in arms]
    out: dict[str, Any] = {}
    if base and share:
        out["peers_share"] = evidence.peers_share(sel, share, base)
        out["pairwise"] = [evidence.paired(sel, s, b) for s in share for b in base]
        strong = out["peers_share"]["strongest_baseline"] if out["peers_share"] else None
        best = out["peers_share"]["best_sharing_arm"] if out["peers_share"] else None
        if strong and best:
            cm = _compute_ratios(sel, table, best, strong)
            per_run = [*cm["trained_tokens_per_seed"],
                       *(v for p in cm["trained_tokens_per_policy"].values() for v in p["values"])]
            out["compute_match"] = {
                **cm, "within_10_percent": all(abs(cm[k] - 1) <= 0.10 for k in ("trained_tokens", "optimizer_steps")),
                "every_seed_and_policy_within_10_percent": all(abs(x - 1) <= 0.10 for x in per_run)}
    held = [a for a in arms if roles[a] == "matched_sharing"]
    if held and base:
        strong = evidence.strongest(sel, base)
        out["matched_sharing"] = {a: {"vs_strongest_baseline": evidence.paired(sel, a, strong),
                                      "compute_match": _compute_ratios(sel, table, a, strong)} for a in held}
    eff = [a for a in arms if roles[a] == "efficiency"]
    half = [a for a in arms if roles[a] == "half_baseline"]
    if eff and base:
        strong_full = evidence.strongest(sel, base)
        out["efficiency"] = {e: {"vs_full_budget": evidence.paired(sel, e, strong_full),
                                 **({"vs_half_budget": evidence.paired(sel, e, evidence.strongest(sel, half))}
                                    if half else {})} for e in eff}
    return out


def _summary(values: Sequence[float | None]) -> dict[str, Any]:
    v = [float(x) for x in values if x is not None]
    if not v:
        return {}
    return {"mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}


PROTOCOL = {
    "validation": "task.val_size problems held out of training (the last of each type's training list, the "
                  "zoo builds' own validation slice); every choice (each family's candidate, the strongest "
                  "baseline, the best sharing arm) by mean final validation accuracy",
    "test": "read once per run, at its end; reported as it is",
    "seeds": "a run's seed sets its prompt stream (task.prompt_seed follows it) and its sampling",
    "interval": "paired differences per seed (same seed: same prompts, same test problems), mean, sample sd "
                "and the 95 % t interval over seeds",
    "compute": "trained tokens (completion tokens of every training row, each optimizer phase counted), "
               "optimizer steps and sampled tokens per run, both policies",
    "provenance": "each run's compact metrics and training revision in <study>_runs/; this file is "
                  "aggregated from them alone",
}


def print_table(result: Mapping[str, Any]) -> None:
    print(f"\n{'arm':<26}{'role':<14}{'test final':>12}{'val final':>11}{'tokens/run':>12}{'opt steps':>10}"
          f"{'wall s':>8}")
    for a, t in result["arms"].items():
        print(f"{a:<26}{t['role']:<14}{100 * t['test_final']['mean']:>11.1f}%{100 * t['val_final']['mean']:>10.1f}%"
              f"{t['trained_tokens']['mean']:>12,.0f}{t['optimizer_steps']['mean']:>10,.0f}"
              f"{t.get('wall_s', {}).get('mean', float('nan')):>8.0f}")
    for a, t in result.get("arms_on_fewer_seeds", {}).items():
        print(f"{a:<26}{t['role']:<14}{100 * t['test_final']['mean']:>11.1f}%{100 * t['val_final']['mean']:>10.1f}%"
              f"{t['trained_tokens']['mean']:>12,.0f}{t['optimizer_steps']['mean']:>10,.0f}"
              f"{t.get('wall_s', {}).get('mean', float('nan')):>8.0f}  seeds {t['seeds']} only")
    for label, ps in (("", result.get("peers_share")),
                      (f" on seeds {result.get('on_common_seeds', {}).get('seeds')}, every arm",
                       result.get("on_common_seeds", {}).get("peers_share"))):
        if ps:
            lo, hi = ps["ci95"]
            print(f"\npeers' share{label}: {ps['best_sharing_arm']} - {ps['strongest_baseline']} = {ps['mean']:+.1f} "
                  f"pts [{lo:+.1f}, {hi:+.1f}] per seed {', '.join(f'{v:+.1f}' for v in ps['values'])}")
    cm = result.get("compute_match")
    if cm and "trained_tokens_per_policy" in cm:
        seeds = ", ".join(f"{x:.2f}" for x in cm["trained_tokens_per_seed"])
        pols = ", ".join(f"{p} {v['mean']:.2f}" for p, v in cm["trained_tokens_per_policy"].items())
        print(f"compute: trained tokens x{cm['trained_tokens']:.2f} (per seed {seeds}; per policy {pols}), "
              f"optimizer steps x{cm['optimizer_steps']:.2f}")
    for a, cmp in result.get("matched_sharing", {}).items():
        v = cmp["vs_strongest_baseline"]
        lo, hi = v["ci95"]
        print(f"compute-matched sharing {a} - {v['baseline']} = {v['mean']:+.1f} pts [{lo:+.1f}, {hi:+.1f}] "
              f"(trained tokens x{cmp['compute_match']['trained_tokens']:.2f})")
    for e, cmp in result.get("efficiency", {}).items():
        for k, v in cmp.items():
            lo, hi = v["ci95"]
            print(f"efficiency {e} {k} ({v['baseline']}): {v['mean']:+.1f} pts [{lo:+.1f}, {hi:+.1f}]")


# ----------------------------------------------------------------------------- one run
def _run_one(run_dir: Path, resume: bool) -> None:
    import torch

    from mutualrl.study.report import ARM_FILE
    from mutualrl.config.resolve import load_config
    from mutualrl.run.trainer import MutualTrainer

    spec = json.loads(spec_path(run_dir).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(spec["config"])
    from mutualrl.config.modelref import resolve_model_path

    weights = {p.name: weights_fingerprint(resolve_model_path(p.model)) for p in cfg.policies}
    provenance_path(run_dir).write_text(json.dumps({"git_rev": git_rev(), "started": time.time(),
                                                     "load_avg": os.getloadavg()[0], "cpu": cpu_kind(),
                                                     "weights": weights}))
    tr = MutualTrainer(cfg, run_dir, resume=resume, progress=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ARM_FILE).write_text(json.dumps({"arm": spec["arm"]}))
    tr.train()


def _arms_to_aggregate(name: str, arms: str | None) -> list[str] | None:
    """``--arms`` as a list; else the arms the committed result of ``name`` reports; else None (all)."""
    if arms:
        return [a.strip() for a in arms.split(",") if a.strip()]
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return [*result.get("arms", {}), *result.get("arms_on_fewer_seeds", {})] or None


def _seeds_to_aggregate(name: str, seeds: str | None) -> list[int] | None:
    """``--seeds`` as a list; else the final seeds the committed result of ``name`` declared (a study
    whose final seeds are not its tuning seeds); else None (the longest seed list an arm holds)."""
    if seeds:
        return [int(s) for s in seeds.split(",") if s.strip()]
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()).get("declared_final_seeds") if path.is_file() else None


AGGREGATE_KEYS = ("final_seeds", "arms", "peers_share", "pairwise", "compute_match", "efficiency", "matched_sharing",
                  "arms_on_fewer_seeds", "on_common_seeds")
"""The keys of a study's JSON that :func:`aggregate` computes (the rest describe the run that wrote it)."""


def rewrite(name: str, result: Mapping[str, Any], seeds_given: bool = False) -> dict[str, Any]:
    """Replace the figures of the committed ``results/<name>.json`` with ``result`` (a fresh
    :func:`aggregate`): what the study run recorded about itself (tuning, notes, machine, load, wall
    time, its extras) is kept, the aggregated keys are replaced (one the new aggregation lacks is
    dropped), and a note says when and from which seeds it was re-aggregated."""
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = {k: v for k, v in old.items() if k not in AGGREGATE_KEYS and k not in result}
    note = (f"Figures re-aggregated at {result.get('git_rev')} from the committed runs in {name}_runs/ "
            f"(python benchmarks/study.py aggregate {name} --write), final seeds {result.get('final_seeds')}; "
            "machine, load, jobs and wall_s are those of the study run that wrote this file before.")
    out = {**kept, **result, "notes": [*old.get("notes", []), note]}
    if seeds_given:  # a later plain re-aggregation takes the same seeds
        out["declared_final_seeds"] = list(result["final_seeds"])
    write_result_to(path, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd")
    ag = sub.add_parser("aggregate", help="re-aggregate a study's JSON from its committed compact runs")
    ag.add_argument("name")
    ag.add_argument("--arms", default=None,
                    help="comma-separated arms to aggregate (default: those of the committed results/<name>.json, "
                    "else every recorded arm, tuning candidates included)")
    ag.add_argument("--seeds", default=None,
                    help="comma-separated final seeds (default: those the committed results/<name>.json declared, "
                    "else the longest seed list an arm holds)")
    ag.add_argument("--write", action="store_true",
                    help="replace the figures of results/<name>.json with this aggregation (the study run's "
                    "tuning, notes and machine kept; a note added)")
    args = ap.parse_args()
    if args.one:
        _run_one(args.one, args.resume)
    elif args.cmd == "aggregate":
        result = aggregate(args.name, _arms_to_aggregate(args.name, args.arms), _seeds_to_aggregate(args.name, args.seeds))
        if args.write:
            result = rewrite(args.name, result, seeds_given=bool(args.seeds))
        print_table(result)
        print(json.dumps({k: result[k] for k in ("peers_share", "efficiency", "compute_match") if k in result},
                         indent=1))
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
