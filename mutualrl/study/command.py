"""``mutualrl study STUDY.yaml``: compare sharing strategies on your own task under the protocol.

The study file (:mod:`mutualrl.study.spec`) names a base run config, the arms (a strategy each,
optionally candidates tuned on validation), the tuning seeds and the final seeds. The command
tunes each arm's candidates on the tuning seeds (the highest mean final validation accuracy wins),
trains every chosen arm on every final seed, records each run compactly, and aggregates the records
into ``<output>/<name>.json`` (per arm accuracy and compute, paired differences with their 95 %
intervals, the peers' share, the compute match) and ``<output>/<name>_report/`` (report.md and the
figure). ``--reuse`` keeps every run already recorded with the same config; ``--aggregate``
re-aggregates the records without training anything.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

from mutualrl.errors import UserError
from mutualrl.run.progress import Progress
from mutualrl.study.aggregate import (
    aggregate,
    committed_arms,
    committed_final_seeds,
    print_table,
    result_path,
    rewrite,
    runs_dir,
)
from mutualrl.study.harness import Arm, RunFailed, Study
from mutualrl.study.records import deep_merge, load_records, run_name
from mutualrl.study.spec import MIN_SEEDS, ArmSpec, StudySpec, load_study

DESCRIPTION = """\
Compare sharing strategies on your own task under the protocol a reviewer accepts. Each arm's
candidates are tried on the tuning seeds and the one with the highest mean final validation
accuracy is kept; every chosen arm then trains on every final seed (the test split read once, at
the end of each run). Each run is recorded compactly, and the figures are aggregated from those
records alone: per arm test and validation accuracy and compute (trained tokens, optimizer steps,
sampled tokens, wall time), the paired difference of every sharing arm and baseline (mean, sd, 95 %
t interval over seeds), the peers' share (best sharing arm minus strongest baseline, both chosen on
validation) and the compute match per seed and policy."""

EPILOG = """\
a study file (YAML):
  base: my_run.yaml             # the run config every arm starts from (relative to this file), or a mapping
  seeds: [1, 2, 3, 4, 5]        # final seeds: prompt stream and sampling (two or more; the protocol asks 5)
  tune_seeds: [0]               # tuning seeds, never final ones (needed when an arm has candidates)
  val_size: 200                 # validation problems every choice is made on (or task.val_size in base)
  output: runs/study_my_task    # optional (default runs/study/<name>; -o overrides it)
  jobs: 1                       # optional: runs at once
  arms:
    independent:
      strategy: independent
      candidates: {lr1e-4: {grpo: {learning_rate: 1.0e-4}}, lr3e-4: {grpo: {learning_rate: 3.0e-4}}}
    imitate:
      strategy: imitate
      grpo_from: independent    # start from the GRPO settings chosen for independent
      overrides: {sharing: {imitate: {weight: 1.0}}}

writes OUTPUT/NAME.json (the figures), OUTPUT/NAME_runs/ (one record per run: what the figures are
aggregated from), OUTPUT/NAME_report/ (report.md and curves.png), OUTPUT/runs/ (the run directories).
Bad input exits with code 2 before anything is written."""


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``mutualrl study`` to the command line."""
    p = sub.add_parser("study", help="compare sharing strategies on your task under the protocol (tuned on "
                       "validation, paired intervals over seeds)", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="STUDY.yaml", help="the study file (see below)")
    p.add_argument("-o", "--output", help="output folder (default: the study file's output, else runs/study/<name>)")
    p.add_argument("--reuse", action="store_true",
                   help="keep every run of OUTPUT already recorded with the same config (resume interrupted ones); "
                   "train only what is missing, then aggregate")
    p.add_argument("--aggregate", action="store_true",
                   help="train nothing: aggregate OUTPUT's records again into NAME.json (its arms and final seeds) "
                   "and the report")
    p.add_argument("--force", action="store_true", help="delete a non-empty OUTPUT first and start over")
    p.add_argument("--jobs", type=int, help="runs at once (default: the study file's jobs, else 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_study)


def cmd_study(args: argparse.Namespace) -> int:
    """Run (or re-aggregate) the study of ``args.config``; 0 when its JSON and report are written."""
    spec = load_study(args.config)
    out = Path(args.output) if args.output else spec.output
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs must be a positive integer, got {args.jobs}")
    if sum((args.reuse, args.force, args.aggregate)) > 1:
        raise UserError("give one of --reuse, --force and --aggregate")
    if args.aggregate:
        return reaggregate(spec, out)
    if out.exists() and any(out.iterdir()):
        if args.force:
            shutil.rmtree(out)
        elif not args.reuse:
            raise UserError(f"output folder {str(out)!r} exists and is not empty: --reuse keeps its recorded runs, "
                            "--force starts over, -o chooses another")
    total = planned_runs(spec)
    with Progress(f"study {spec.name}", total, enabled=not args.no_progress, every=1) as progress:
        study = Study(spec.name, lambda seed: dict(spec.base), out / "runs", results=out, jobs=args.jobs or spec.jobs,
                      reuse=args.reuse, final_seeds=list(spec.seeds), progress=progress, target=spec.target)
        try:
            result = run_study(spec, study)
        except RunFailed as exc:
            print(f"mutualrl: error: {exc} (the runs recorded so far stay: --reuse continues)", file=sys.stderr)
            return 1
        progress.finish(f"{total} runs recorded")
    print_table(result)
    print(f"study: {result_path(out, spec.name)}")
    print(f"report: {out / f'{spec.name}_report' / 'report.md'}")
    return 0


def planned_runs(spec: StudySpec) -> int:
    """How many runs the study trains or reuses: every candidate on every tuning seed, every arm on
    every final seed."""
    return sum(len(a.candidates) * len(spec.tune_seeds) for a in spec.arms) + len(spec.arms) * len(spec.seeds)


def _arm_with_grpo(arm: ArmSpec, chosen: dict[str, Arm]) -> dict[str, Any]:
    """The arm's overrides on top of the GRPO settings chosen for its ``grpo_from`` arm."""
    if arm.grpo_from is None:
        return arm.overrides
    return deep_merge({"grpo": chosen[arm.grpo_from].overrides.get("grpo", {})}, arm.overrides)


def tune_round(study: Study, spec: StudySpec, arms: list[ArmSpec], chosen: dict[str, Arm]) -> None:
    """Tune the arms of one round on the tuning seeds (all their candidates trained together) and
    put each one's final arm into ``chosen``: its name, its chosen candidate's overrides."""
    families = {}
    for arm in arms:
        base = _arm_with_grpo(arm, chosen)
        families[arm.name] = [Arm(f"{arm.name}.{c}", arm.name, arm.role, deep_merge(base, over))
                              for c, over in arm.candidates.items()]
        if not arm.candidates:
            chosen[arm.name] = Arm(arm.name, arm.name, arm.role, base)
    study.run((c, s) for cands in families.values() for c in cands for s in spec.tune_seeds)
    for name, cands in families.items():
        if cands:
            best = study.tune(name, cands, spec.tune_seeds)
            chosen[name] = Arm(name, name, best.role, best.overrides)


def run_study(spec: StudySpec, study: Study) -> dict[str, Any]:
    """The rounds of ``spec`` on ``study``: tuning in the order ``grpo_from`` asks, then every chosen
    arm on every final seed (seed by seed: a study stopped early has whole seeds); its JSON and report."""
    chosen: dict[str, Arm] = {}
    for arms in spec.order():
        tune_round(study, spec, arms, chosen)
    final = [chosen[a.name] for a in spec.arms]
    study.run((a, s) for s in spec.seeds for a in final)
    study.arms = {a.name: a for a in final}
    study.notes.extend(protocol_notes(spec))
    return study.write({"definition": spec.source, "tune_seeds": spec.tune_seeds}, table=False)


def protocol_notes(spec: StudySpec) -> list[str]:
    """What the study leaves short of the protocol, said in its JSON."""
    notes = []
    if len(spec.seeds) < MIN_SEEDS:
        notes.append(f"{len(spec.seeds)} final seeds: the protocol asks for {MIN_SEEDS} or more (with 5 a 95 % t "
                     "interval clears 0 only above 1.24 x the seed sd).")
    sides = {role: sorted({len(a.candidates) or 1 for a in spec.arms if a.role == role})
             for role in ("baseline", "sharing")}
    if sides["baseline"] != sides["sharing"]:
        notes.append(f"Candidates per arm: baselines {sides['baseline']}, sharing arms {sides['sharing']}; the "
                     "protocol gives each side the same number.")
    return notes


def reaggregate(spec: StudySpec, out: Path) -> int:
    """``--aggregate``: the figures of ``out``'s study JSON again from its records alone (its arms and
    final seeds), the report again from the run directories that are there."""
    if not result_path(out, spec.name).is_file() or not runs_dir(out, spec.name).is_dir():
        raise UserError(f"no study {spec.name!r} in {str(out)!r} ({result_path(out, spec.name).name} and "
                        f"{runs_dir(out, spec.name).name}/): run `mutualrl study` on it first, or give -o")
    arms = committed_arms(out, spec.name)
    result = aggregate(out, spec.name, arms, committed_final_seeds(out, spec.name), spec.target)
    result = rewrite(out, spec.name, result, how="mutualrl study --aggregate")
    dirs = [d for r in load_records(runs_dir(out, spec.name)) if (arms is None or r["arm"] in arms)
            and (d := out / "runs" / run_name(r["arm"], r["seed"])).is_dir()]
    if dirs:
        from mutualrl.study.report import write_report

        write_report(dirs, out / f"{spec.name}_report", title=f"mutualrl {spec.name}", notes=result.get("notes"))
    print_table(result)
    print(f"study: {result_path(out, spec.name)}")
    return 0
