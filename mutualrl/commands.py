"""CLI subcommands for training: ``train``, ``eval``, ``demo``, ``compare``, ``strategies``, ``tasks``
(``study`` lives with the study harness, :mod:`mutualrl.study.command`).

Each command imports what it runs when it runs (the resolver, the trainer, workers: torch and
transformers come with them), so ``mutualrl --help`` starts without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mutualrl.config import RESUMABLE
from mutualrl.demo import DEMO_ARMS, run_demo
from mutualrl.errors import UserError
from mutualrl.paths import METRICS
from mutualrl.tasks import available_datasets


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``train``, ``eval``, ``demo``, ``compare``, ``strategies`` and ``tasks`` to the command line."""
    _register_train(sub)
    _register_eval(sub)
    _register_demo(sub)
    _register_listings(sub)


def subcommand(sub: argparse._SubParsersAction, func: Callable[[argparse.Namespace], int],
               help: str) -> argparse.ArgumentParser:
    """Add the subcommand ``func`` runs, named after it (``cmd_eval``: ``eval``); its ``--help``
    description is ``func``'s docstring (one text for the reader of the code and of ``--help``)."""
    p = sub.add_parser(func.__name__.removeprefix("cmd_"), help=help, description=inspect.getdoc(func))
    p.set_defaults(func=func)
    return p


def _register_train(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, cmd_train, "train the policies of a config (one strategy)")
    p.add_argument("config", nargs="?", help="YAML run config (omit with --resume)")
    p.add_argument("-o", "--output", help="run directory (default: runs/<config name>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last good checkpoint")
    p.add_argument("--steps", type=int, help="override the number of steps (also when resuming: run further)")
    p.add_argument("--strategy", help="override sharing.strategy: a registered step or an a+b chain "
                   "(mutualrl strategies lists them)")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--scheduler", choices=["sequential", "local", "ray"], help="override the scheduler")
    p.add_argument("--workers", type=int, choices=[1], help="--workers 1 runs every policy in this process")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="override any config field by its dotted path, e.g. --set policies.0.grpo.learning_rate=3e-5 "
                   f"(repeatable). With --resume only {', '.join(sorted(RESUMABLE))} may change (steps not under a "
                   "linear/cosine schedule or warmup_ratio); any other override is refused (exit 2), never dropped")
    p.add_argument("--calibrate", type=int, nargs="?", const=3, default=0, metavar="STEPS",
                   help="before MWRA's first plan, time STEPS (default 3, the first a warm-up) real steps of each "
                   "policy as one of its ranks runs them, and plan from them (local/ray schedulers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="print MWRA's whole plan table at every re-plan "
                   "(default: the first plan's table, then one line per re-plan saying what changed)")


def _register_eval(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, cmd_eval, "held-out accuracy of a run's last checkpoint, or of any model on a run's task")
    p.add_argument("run_dir", nargs="?", help="a run directory")
    p.add_argument("--size", type=int, help="number of test problems (default: the run's eval_size)")
    p.add_argument("--model", metavar="DIR_OR_HUB_ID", help="evaluate this model instead of the run's checkpoint")
    p.add_argument("--config", metavar="CFG", help="with --model: the run config whose task, prompts and verifier "
                   "are used (a YAML file or a run directory)")
    p.add_argument("--policy", metavar="NAME", help="with --model: the config's policy whose prompt template, system "
                   "prompt and options apply (default: the exported policy, or the only one)")
    p.add_argument("--prompt-template", help="with --model: a prompt template instead of the policy's "
                   "('{question} Answer: ' or 'chat')")
    p.add_argument("--system-prompt", help="with --model: a system prompt instead of the policy's")
    p.add_argument("--device", help="with --model: cpu (default), cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print JSON (mutualrl eval RUN_DIR always does)")


def _register_demo(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, cmd_demo, "the embedded default end to end: zoo, arms, report")
    p.add_argument("-o", "--output", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="a smaller run (fewer steps and test problems)")
    p.add_argument("--arms", default=",".join(DEMO_ARMS),
                   help=f"comma-separated strategies (default {','.join(DEMO_ARMS)}; any registered step or a+b "
                   "chain: mutualrl strategies lists them)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--steps", type=int, help="override the number of steps")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--verbose", action="store_true", help="print MWRA's whole plan table every time "
                   "(default: once; later plans and re-plans one line each)")


def _register_listings(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, cmd_compare, "rebuild the comparison report from run directories")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("-o", "--output", default="report", help="output directory for report.md and figures")
    p = subcommand(sub, cmd_strategies, "list the registered sharing steps with what each does")
    p.add_argument("--module", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (where your own steps are registered; repeatable)")
    p = subcommand(sub, cmd_tasks, "list reasoning-gym datasets usable as tasks")
    p.add_argument("action", choices=["list"])


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config overrides a ``train`` command line asks for, as dotted paths (``--set`` and the
    shortcut flags, which name their fields: ``--seed`` is ``seed``, ``--strategy`` is
    ``sharing.strategy``)."""
    from mutualrl.config.resolve import parse_overrides

    overrides = parse_overrides(args.set or [])
    for flag, key in (("steps", "steps"), ("seed", "seed"), ("scheduler", "scheduler"),
                      ("strategy", "sharing.strategy")):
        value = getattr(args, flag)
        if value is not None:
            overrides[key] = value
    if args.workers == 1:
        overrides["scheduler"] = "sequential"
    return overrides


def cmd_train(args: argparse.Namespace) -> int:
    """Train the policies listed in CONFIG.yaml with GRPO and the configured sharing strategy (or
    continue a run with --resume) and print its summary. Writes a run directory: config.yaml,
    metrics.jsonl, checkpoints/, summary.json."""
    from mutualrl.config.resolve import resolve, resolve_run
    from mutualrl.run.trainer import MutualTrainer

    overrides = train_overrides(args)
    if args.resume:
        if args.config:
            raise UserError("give either CONFIG or --resume RUN_DIR, not both (a resumed run keeps its config)")
        run_dir = Path(args.resume)
        trainer = MutualTrainer(resolve_run(run_dir, overrides), run_dir, resume=True, progress=not args.no_progress,
                                calibrate=args.calibrate, verbose=args.verbose)
    else:
        if not args.config:
            raise UserError("give a CONFIG.yaml to train (or --resume RUN_DIR)")
        plan = resolve(args.config, overrides)
        out = Path(args.output or plan.config.output_dir or Path("runs") / Path(args.config).stem)
        trainer = MutualTrainer(plan, out, progress=not args.no_progress, calibrate=args.calibrate,
                                verbose=args.verbose)
    summary = trainer.train()
    print(json.dumps(summary, indent=1))
    print(f"run directory: {trainer.run_dir}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """mutualrl eval RUN_DIR: every policy of the run's last checkpoint on its held-out test problems
    (JSON). mutualrl eval --model DIR_OR_HUB_ID --config CFG.yaml [--policy NAME]: any model (a base
    model, an exported policy or adapter, a hub id, zoo:/real: references) on the same problems with
    the same prompts, template, answer extraction and verifier as the config's policy NAME in
    training (RUN_DIR in place of --config: the run's config)."""
    from mutualrl.config.resolve import resolve_run
    from mutualrl.run.checkpoint import latest_checkpoint
    from mutualrl.run.worker import PolicyWorker

    if args.model:
        from mutualrl.export.evaluate_model import cmd_eval_model

        return cmd_eval_model(args)
    if not args.run_dir or args.config:
        raise UserError("give a RUN_DIR to evaluate its checkpoint, or --model DIR_OR_HUB_ID with --config CFG.yaml")
    run_dir = Path(args.run_dir)
    plan = resolve_run(run_dir)
    ck = latest_checkpoint(run_dir)
    if ck is None:
        raise UserError(f"run {str(run_dir)!r} has no complete checkpoint yet")
    results = {}
    for i, p in enumerate(plan.config.policies):
        w = PolicyWorker(plan, i, None)
        w.load(str(ck / p.name))
        results[p.name] = w.evaluate(args.size)
        w.close()
    print(json.dumps({"checkpoint": str(ck), "results": results}, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Load the shipped policy zoo, run plain GRPO, the no-peer control self_imitate and imitate
    (peers' verified successes plus the learner's own; or the --arms given) on the same seeds and
    prompts, and write report.md: the peers' share (imitate minus the stronger single-model arm,
    chosen on validation) and figures (mutualrl.demo.run_demo)."""
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    run_demo(Path(args.output), quick=args.quick, arms=arms, seeds=seeds, steps=args.steps, force=args.force,
             verbose=args.verbose)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Rebuild the comparison report (report.md and figures) from run directories."""
    from mutualrl.study.report import write_report

    dirs = [Path(d) for d in args.run_dirs]
    for d in dirs:
        if not (d / METRICS).is_file():
            raise UserError(f"{str(d)!r} is not a run directory with metrics.jsonl")
    path = write_report(dirs, Path(args.output))
    print(f"report: {path}")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    """List the reasoning-gym datasets usable as tasks (mutualrl tasks list)."""
    for name in available_datasets():
        sys.stdout.write(name + "\n")
    return 0


def cmd_strategies(args: argparse.Namespace) -> int:
    """Every registered sharing step (the built-in ones and those of --module packages): its name,
    what it does, its settings block (sharing.<step>:) and what it needs of the batch. Chain them
    with +, e.g. imitate+prp."""
    from mutualrl.algorithms.registry import available_strategies, strategy_step

    for module in args.module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UserError(f"--module {module}: cannot import it ({exc}); give an importable module name") from exc
    for name in available_strategies():
        step = strategy_step(name)
        assert step is not None
        sys.stdout.write(f"{name}: {step.description}\n")
        if step.settings is not None:
            fields = ", ".join(f.name for f in dataclasses.fields(step.settings))
            sys.stdout.write(f"    settings (sharing.{name}): {fields}\n")
        for label, names in (("needs", step.needs), ("provides", step.provides), ("breaks", step.breaks)):
            if names:
                sys.stdout.write(f"    {label}: {', '.join(sorted(names))}\n")
    return 0
