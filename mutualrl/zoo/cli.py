"""``mutualrl zoo build|list``: build the embedded policies (for the zoo task or yours) and list them."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from mutualrl.config.resolve import resolve_task
from mutualrl.errors import ConfigError, UserError
from mutualrl.tasks.build import build_task
from mutualrl.zoo.build import build_zoo, is_built, is_shipped, load_card, policy_dir
from mutualrl.zoo.specs import DEFAULT_NAMES, ZOO, ZooSpec, check_names
from mutualrl.zoo.steps import TooFewProblems, check_task_size

TASK_FILE_HELP = """A YAML file with a run config's `task:` section and a `zoo:` section that
gives each policy to build its skill mixture over the task's dataset aliases and its band per
skill, e.g.
  zoo:
    - {name: gpt2-gcd, like: gpt2-add, sft_mixture: {gcd: 0.8, lcm: 0.2},
       bands: {gcd: [0.3, 0.5], lcm: [0.03, 0.15]}}
`like` picks the architecture and tokenizer of an embedded policy (default gpt2-add), and its warm
start: a generalist phase until every skill reaches generalist_target (the default policies: 0.3;
0 for none), then the specialisation on sft_mixture until every skill is in its band. An entry may
also set lr, generalist_lr, generalist_catch_up, sft_max_steps, generalist_max_steps and the stall rule (stall_checks,
stall_min_gain, stall_patience, stall_restarts; docs/zoo.md); the flags above set them for every
policy built.

A phase whose validation figure for a skill comes no stall_min_gain closer to its goal in
stall_checks checks has stalled: the build starts over from another initialisation
(stall_restarts times), then stops with exit code 2 naming the skill, its figure, its band and
what to change; nothing is written to the cache."""

SPEC_FIELDS: dict[str, type] = {"lr": float, "generalist_lr": float, "generalist_catch_up": float,
                                "sft_max_steps": int, "generalist_max_steps": int, "stall_checks": int, "stall_min_gain": float, "stall_patience": int,
                                "stall_restarts": int}
"""Recipe fields a ``zoo:`` entry of a task file may set (and their types)."""


def task_specs(path: str | Path) -> tuple[Any, dict[str, ZooSpec], dict[str, Any]]:
    """The task, the zoo specs and the ``task:`` section a ``zoo build --task FILE`` asks for
    (``UserError`` if invalid)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--task: file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"--task: {p} is not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict) or "task" not in data or "zoo" not in data:
        raise UserError(f"--task: {p} needs a `task:` and a `zoo:` section.\n{TASK_FILE_HELP}")
    for d in (data["task"] or {}).get("datasets") or []:  # a relative data path is beside the task file
        for key in ("path", "dataset"):
            value = d.get(key) if isinstance(d, dict) else None
            if isinstance(value, str) and not Path(value).expanduser().is_absolute() and (p.parent / value).exists():
                d[key] = str((p.parent / value).resolve())
    tcfg = resolve_task(data["task"])
    try:
        task = build_task(tcfg)
    except (ValueError, OSError) as exc:
        raise UserError(f"task: {exc}") from None
    try:
        check_task_size(task)
    except TooFewProblems as exc:
        raise ConfigError(f"task.datasets[{exc.index}]", str(exc)) from None
    entries = data["zoo"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("zoo", "expected a list of policies to build (name, like, sft_mixture, bands)")
    specs: dict[str, ZooSpec] = {}
    for i, e in enumerate(entries):
        spec = _entry_spec(e, f"zoo[{i}]", p.name, specs)
        spec.check(list(task.train))
        specs[spec.name] = spec
    return task, specs, data["task"]


def _entry_spec(e: Any, where: str, file_name: str, specs: dict[str, ZooSpec]) -> ZooSpec:
    """The spec of the ``zoo:`` entry ``e`` of task file ``file_name`` (``ConfigError`` at ``where``);
    ``specs``: the entries before it (names are unique)."""
    if not isinstance(e, dict):
        raise ConfigError(where, f"expected a mapping, got {type(e).__name__}")
    valid = ["name", "like", "sft_mixture", "bands", "generalist_target", *SPEC_FIELDS]
    unknown = sorted(set(e) - set(valid))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown field; valid: {', '.join(valid)}")
    like = e.get("like", "gpt2-add")
    if like not in ZOO:
        raise ConfigError(f"{where}.like", f"unknown zoo policy {like!r}; valid: {', '.join(ZOO)}")
    name = str(e.get("name") or "")
    if not name or name in specs:
        raise ConfigError(f"{where}.name", f"must be a non-empty, unique name, got {name!r}")
    try:
        mix = {str(k): float(v) for k, v in dict(e.get("sft_mixture") or {}).items()}
        bands = {str(k): (float(v[0]), float(v[1])) for k, v in dict(e.get("bands") or {}).items()}
    except (TypeError, ValueError, IndexError, KeyError):
        raise ConfigError(where, "sft_mixture maps skills to weights, bands maps skills to [low, high]") from None
    try:
        generalist = float(e.get("generalist_target", ZOO[like].generalist_target))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}.generalist_target", "expected a number in [0, 1)") from None
    if not 0 <= generalist < 1:
        raise ConfigError(f"{where}.generalist_target", f"expected a number in [0, 1), got {generalist}")
    return dataclasses.replace(ZOO[like], name=name, sft_mixture=mix, bands=bands, generalist_target=generalist,
                               description=f"{ZOO[like].description.split(';')[0]}; built for {file_name}",
                               **_recipe_fields(e, where))


def _recipe_fields(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """The :data:`SPEC_FIELDS` a ``zoo:`` entry sets, typed (``ConfigError`` naming a bad one)."""
    out: dict[str, Any] = {}
    for key, kind in SPEC_FIELDS.items():
        if key in entry:
            value = entry[key]
            positive = key in ("lr", "generalist_lr", "generalist_catch_up", "sft_max_steps", "generalist_max_steps")
            if (isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value))
                    or (positive and value <= 0)):
                raise ConfigError(f"{where}.{key}", f"expected {'a positive ' if positive else 'an '}"
                                  f"{'integer' if kind is int else 'number'}, got {value!r}")
            if key == "generalist_catch_up" and value > 1:
                raise ConfigError(f"{where}.{key}", f"expected a number in (0, 1] (1: an even mixture), got {value!r}")
            out[key] = kind(value)
    return out


def _overrides(args: Any) -> dict[str, Any]:
    """The spec fields ``zoo build``'s flags set for every policy it builds."""
    flags = {"lr": args.lr, "generalist_lr": args.generalist_lr, "generalist_catch_up": args.catch_up,
             "stall_checks": args.stall_checks,
             "stall_min_gain": args.stall_min_gain, "stall_restarts": args.restarts}
    out = {k: v for k, v in flags.items() if v is not None}
    if args.max_steps is not None:
        out.update(sft_max_steps=args.max_steps, generalist_max_steps=args.max_steps)
    return out


def _value(kind: type, ok: Callable[[float], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``text`` read as ``kind`` and accepted when ``ok``, else an error saying ``what``."""
    def parse(text: str) -> Any:
        try:
            x = kind(text)
        except ValueError:
            x = None
        if x is None or not ok(x):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return x
    return parse


_positive_int = _value(int, lambda n: n >= 1, "a positive integer")
_positive_float = _value(float, lambda x: x > 0, "a positive number")
_count = _value(int, lambda n: n >= 0, "a non-negative integer")
_share = _value(float, lambda x: 0 <= x < 1, "a number in [0, 1)")


def _cmd_build(args: Any) -> int:
    t0 = time.perf_counter()
    over = _overrides(args)
    if args.task:
        task, specs, section = task_specs(args.task)
        specs = {n: dataclasses.replace(spec, **over) for n, spec in specs.items()}
        names = args.names or list(specs)
        dirs = build_zoo(names, seed=args.seed, cache_dir=args.cache_dir, progress=True, specs=specs, task=task,
                         jobs=args.jobs, task_section=section)
    else:
        if args.names:
            check_names(args.names)
        table = {n: dataclasses.replace(spec, **over) for n, spec in ZOO.items()} if over else None
        dirs = build_zoo(args.names or None, seed=args.seed, cache_dir=args.cache_dir, progress=True, jobs=args.jobs,
                         shipped=not args.rebuild, specs=table)
    for name, path in dirs.items():
        card = load_card(path)
        acc = "  ".join(f"{k} {v:.1%}" for k, v in card["accuracy_greedy"].items())
        print(f"{name:10s} {card['architecture']:20s} {card['tokenizer_model']:9s} vocab {card['vocab_size']:4d}  "
              f"{card['n_params'] / 1e6:.2f}M  greedy test: {acc}  ({card['sft_steps_done']} SFT steps)  {path}")
    if args.task:
        print("use these directories as `model:` in a run config with the same `task:` section")
    print(f"zoo ready in {time.perf_counter() - t0:.1f}s")
    return 0


def _cmd_list(args: Any) -> int:
    for name, spec in ZOO.items():
        path = policy_dir(name, args.seed, args.cache_dir)
        if is_built(path):
            card = load_card(path)
            how = "shipped" if is_shipped(name, args.seed) else "built"
            state = f"{how}: greedy " + ", ".join(f"{k} {v:.1%}" for k, v in card["accuracy_greedy"].items())
        else:
            state = "not built"
        default = "*" if name in DEFAULT_NAMES else " "
        bands = ", ".join(f"{k} {lo:.0%}-{hi:.0%}" for k, (lo, hi) in spec.bands.items())
        print(f"{default} zoo:{name:10s} {spec.arch:8s} {spec.tokenizer:8s} L{spec.n_layer} d{spec.n_embd}  "
              f"bands [{bands}]  {state}")
    print("(* = the default policies, shipped prebuilt for build seed 0; `mutualrl zoo build --names ...` builds "
          "others, `--rebuild` builds the default ones on this machine)")
    return 0


def register(subparsers: Any) -> None:
    """Add ``mutualrl zoo build|list`` to the CLI."""
    p = subparsers.add_parser("zoo", help="build or list the embedded default policies (the zoo)",
                              description="The policy zoo: small heterogeneous LMs built locally (no download), "
                              "warm-started until each skill is inside its accuracy band, and cached.")
    sub = p.add_subparsers(dest="zoo_command", metavar="ACTION")
    for action, func, text in (("build", _cmd_build, "build (or load from the cache) zoo policies"),
                               ("list", _cmd_list, "list zoo policies and whether they are built")):
        q = sub.add_parser(action, help=text, description=text, epilog=TASK_FILE_HELP if action == "build" else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        q.add_argument("--seed", type=int, default=0, help="build seed (default 0; zoo:NAME@SEED in configs)")
        q.add_argument("--cache-dir", default=None, help="cache folder (default $MUTUALRL_CACHE/zoo or "
                       "~/.cache/mutualrl/zoo)")
        if action == "build":
            q.add_argument("--names", nargs="+", metavar="NAME",
                           help=f"policies to build (default: {' '.join(DEFAULT_NAMES)}; all: {' '.join(ZOO)})")
            q.add_argument("--task", metavar="CONFIG.yaml", help="build for your own task (see below)")
            q.add_argument("--jobs", type=_positive_int, default=None, metavar="N",
                           help="policies built at once, one process and one torch thread each (default: one "
                           "per core; the weights are the same as one after another)")
            q.add_argument("--lr", type=_positive_float, default=None, help="learning rate of every policy built "
                           "(default: the policy's, 3e-3 for the embedded ones; the specialisation runs at a third)")
            q.add_argument("--generalist-lr", type=_positive_float, default=None, metavar="LR",
                           help="learning rate of the generalist phase (default: the policy's, 1e-3 for gpt2-add, "
                           "its --lr for the others)")
            q.add_argument("--catch-up", type=_value(float, lambda x: 0 < x <= 1, "a number in (0, 1]"),
                           default=None, metavar="X",
                           help="in the generalist phase, the mixture weight of a skill already at the target "
                           "relative to one below it (default: the policy's, 0.25 for the embedded ones; 1: even)")
            q.add_argument("--max-steps", type=_positive_int, default=None, metavar="N",
                           help="step cap of each phase of a warm start (default 6000 generalist, 4000 after)")
            q.add_argument("--stall-checks", type=_count, default=None, metavar="N",
                           help="checks of a phase without progress toward a skill's goal that stop it (default "
                           "60; 0: never)")
            q.add_argument("--stall-min-gain", type=_share, default=None, metavar="X",
                           help="progress: a skill's best distance to its goal falls by at least this (default 0.01)")
            q.add_argument("--restarts", type=_count, default=None, metavar="N",
                           help="restarts from another initialisation after a stall (default 1)")
            q.add_argument("--rebuild", action="store_true",
                           help="build the default policies (seed 0) on this machine instead of using the shipped, "
                           "hash-checked weights (floating-point rounding differs between CPUs, so the weights will "
                           "differ; a finished local build is cached and reused)")
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
