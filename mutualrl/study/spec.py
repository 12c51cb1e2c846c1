"""The study file of ``mutualrl study``: which sharing strategies to compare on which task, under
the protocol (choices on validation, fresh final seeds, paired intervals).

.. code-block:: yaml

    name: my_task                 # optional (default: the file's name); names <output>/<name>.json
    base: my_run.yaml             # the run config every arm starts from: a file (relative to this one) or a mapping
    output: runs/study_my_task    # optional (default runs/study/<name>); -o overrides it
    seeds: [1, 2, 3, 4, 5]        # the final seeds (each: the prompt stream and the sampling); two or more
    tune_seeds: [0]               # the seeds candidates are tuned on (never a final seed); needed with candidates
    val_size: 200                 # optional: validation problems (default: the base config's task.val_size)
    jobs: 1                       # optional: runs at once, each in its own process (threads = cores / jobs)
    target: 3                     # optional: the peers' share (points) you set out to show; the JSON says if it was met
    arms:
      independent:
        strategy: independent                 # shorthand for overrides: {sharing: {strategy: ...}}
        candidates:                           # optional: tuned on validation over tune_seeds, the best one kept
          lr1e-4: {grpo: {learning_rate: 1.0e-4}}
          lr3e-4: {grpo: {learning_rate: 3.0e-4}}
      imitate:
        strategy: imitate
        grpo_from: independent                # take the GRPO settings chosen for that arm
        overrides: {sharing: {imitate: {weight: 1.0}}}   # any run config fields, merged into base
        role: sharing                         # optional: baseline or sharing (default: from the strategy)

Everything is checked before anything is written: a bad field raises
:class:`~mutualrl.errors.ConfigError` naming it (exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mutualrl.config import read_config_data
from mutualrl.errors import ConfigError, UserError
from mutualrl.study.evidence import MIN_SEEDS, check_target
from mutualrl.study.harness import ROLES
from mutualrl.study.records import deep_merge

FIELDS = ("name", "base", "output", "seeds", "tune_seeds", "val_size", "jobs", "target", "arms")
"""The fields of a study file."""
ARM_FIELDS = ("strategy", "role", "overrides", "candidates", "grpo_from")
"""The fields of one arm."""
NAME = re.compile(r"^[A-Za-z0-9_+-]+$")
"""Arm and candidate names: they name files (``<arm>-seed<N>.json``; a candidate ``<arm>.<candidate>``)."""


@dataclass(frozen=True)
class ArmSpec:
    """One arm of a study file: its run config overrides and, when tuned, its candidates (name ->
    overrides merged on top); ``grpo_from``: the arm whose chosen GRPO settings it starts from."""

    name: str
    role: str
    overrides: dict[str, Any]
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)
    grpo_from: str | None = None


@dataclass(frozen=True)
class StudySpec:
    """A checked study file (see the module docstring)."""

    name: str
    base: dict[str, Any]
    output: Path
    seeds: list[int]
    tune_seeds: list[int]
    jobs: int
    arms: list[ArmSpec]
    source: dict[str, Any]
    """The study file as read (written into the study's JSON)."""
    target: float | None = None
    """The peers' share, in points, the study sets out to show (None: no verdict)."""

    def order(self) -> list[list[ArmSpec]]:
        """The arms in rounds: an arm comes after the arm it takes its GRPO settings from."""
        done: set[str] = set()
        left = list(self.arms)
        rounds = []
        while left:
            ready = [a for a in left if a.grpo_from is None or a.grpo_from in done]
            if not ready:  # a circle (refused when the file is parsed)
                raise ConfigError("arms", f"grpo_from never resolves for {', '.join(a.name for a in left)}")
            rounds.append(ready)
            done |= {a.name for a in ready}
            left = [a for a in left if a.name not in done]
        return rounds


def _unknown(where: str, key: str, known: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"{where}{key}", f"unknown field; {hint}the fields are {', '.join(known)}")


def _seed_list(data: Mapping[str, Any], key: str, least: int) -> list[int]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in value):
        raise ConfigError(key, f"expected a list of seeds (integers >= 0), got {value!r}")
    if len(set(value)) != len(value):
        raise ConfigError(key, f"a seed is listed twice in {value}")
    if len(value) < least:
        raise ConfigError(key, f"give at least {least} seeds (a paired interval needs two or more; the protocol "
                          f"asks for {MIN_SEEDS}), e.g. {key}: [1, 2, 3, 4, 5]")
    return value


def _positive(data: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = data.get(key, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(key, f"expected a positive integer, got {value!r}")
    return value


def _base(data: Mapping[str, Any], here: Path) -> dict[str, Any]:
    """The base run config: a file relative to the study file, or a mapping."""
    base = data.get("base")
    if base is None:
        raise ConfigError("base", "required: the run config every arm starts from (a YAML file, relative to the "
                          "study file, or a mapping of run config fields)")
    if isinstance(base, str):
        path = (here / base) if not Path(base).is_absolute() else Path(base)
        if not path.is_file():
            raise ConfigError("base", f"run config file {str(path)!r} does not exist (a relative path is read from "
                              f"the study file's folder, {str(here)!r})")
        try:
            return dict(read_config_data(path))
        except ConfigError as exc:
            raise ConfigError(f"base ({path})", exc.reason) from None
    if not isinstance(base, dict):
        raise ConfigError("base", f"expected a file name or a mapping of run config fields, got {type(base).__name__}")
    return dict(base)


def _overrides(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a mapping of run config fields, got {value!r}")
    return dict(value)


def _arm(name: Any, data: Any) -> ArmSpec:
    """One arm's entry, its names and shape checked (its configs are checked by :func:`check_configs`)."""
    where = f"arms.{name}"
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(where, "an arm's name holds letters, digits, '_', '+' and '-' only (it names files)")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(where, f"expected a mapping with {', '.join(ARM_FIELDS)}, got {data!r}")
    for key in data:
        if key not in ARM_FIELDS:
            raise _unknown(where + ".", str(key), ARM_FIELDS)
    overrides = _overrides(f"{where}.overrides", data.get("overrides"))
    if data.get("strategy") is not None:
        overrides = deep_merge(overrides, {"sharing": {"strategy": str(data["strategy"])}})
    candidates = data.get("candidates") or {}
    if not isinstance(candidates, dict) or len(candidates) == 1:
        raise ConfigError(f"{where}.candidates", "expected a mapping of two or more candidates (name: overrides), "
                          "each tried on the tune_seeds; a single setting belongs in overrides")
    for c in candidates:
        if not isinstance(c, str) or not NAME.match(c):
            raise ConfigError(f"{where}.candidates.{c}", "a candidate's name holds letters, digits, '_', '+' and '-'")
    role = data.get("role")
    if role is not None and role not in ROLES:
        raise ConfigError(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    grpo_from = data.get("grpo_from")
    if grpo_from is not None and not isinstance(grpo_from, str):
        raise ConfigError(f"{where}.grpo_from", f"expected the name of another arm, got {grpo_from!r}")
    return ArmSpec(name, str(role or ""), overrides,
                   {c: _overrides(f"{where}.candidates.{c}", v) for c, v in candidates.items()}, grpo_from)


def _check_links(arms: list[ArmSpec]) -> None:
    names = {a.name for a in arms}
    for a in arms:
        if a.grpo_from is not None and (a.grpo_from not in names or a.grpo_from == a.name):
            raise ConfigError(f"arms.{a.name}.grpo_from", f"{a.grpo_from!r} is not another arm of this study "
                              f"(arms: {', '.join(sorted(names))})")
        for c in a.candidates:
            if f"{a.name}.{c}" in names:
                raise ConfigError(f"arms.{a.name}.candidates.{c}", "a candidate's run name is another arm's")
    seen: set[str] = set()
    for a in arms:  # a circle of grpo_from never gets ready
        chain, at = [a.name], a
        while at.grpo_from is not None and at.grpo_from not in seen:
            if at.grpo_from in chain:
                raise ConfigError(f"arms.{a.name}.grpo_from", f"a circle: {' -> '.join([*chain, at.grpo_from])}")
            chain.append(at.grpo_from)
            at = next(x for x in arms if x.name == at.grpo_from)
        seen.add(a.name)


def parse_study(data: Any, here: Path, default_name: str) -> StudySpec:
    """A checked :class:`StudySpec` from a study file's mapping (``here``: its folder)."""
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"expected a mapping of study fields ({', '.join(FIELDS)})")
    for key in data:
        if key not in FIELDS:
            raise _unknown("", str(key), FIELDS)
    name = str(data.get("name") or default_name)
    if not NAME.match(name):
        raise ConfigError("name", "a study's name holds letters, digits, '_', '+' and '-' only (it names files)")
    arms_data = data.get("arms")
    if not isinstance(arms_data, dict) or len(arms_data) < 2:
        raise ConfigError("arms", "give two arms or more to compare (name: {strategy: ...}), e.g. independent: "
                          "{strategy: independent} and imitate: {strategy: imitate}")
    arms = [_arm(n, a) for n, a in arms_data.items()]
    _check_links(arms)
    seeds = _seed_list(data, "seeds", 2)
    tuned = [a.name for a in arms if a.candidates]
    tune_seeds = _seed_list(data, "tune_seeds", 1 if tuned else 0)
    if set(tune_seeds) & set(seeds):
        raise ConfigError("tune_seeds", f"seeds {sorted(set(tune_seeds) & set(seeds))} are final seeds too: the "
                          "tuning seed is never a final seed (its test split must stay unread by the choice)")
    base = _base(data, here)
    val_size = _positive(data, "val_size", None)
    if val_size is not None:
        base = deep_merge(base, {"task": {"val_size": val_size}})
    if not (base.get("task") or {}).get("val_size"):
        raise ConfigError("val_size", "the protocol makes every choice on a validation split: set val_size (e.g. "
                          "200) here or task.val_size in the base run config")
    output = Path(str(data.get("output") or Path("runs") / "study" / name))
    return StudySpec(name, base, output, seeds, tune_seeds, _positive(data, "jobs", 1) or 1, arms, dict(data),
                     _target(data))


def _target(data: Mapping[str, Any]) -> float | None:
    """The optional ``target``: a positive number of points (finite)."""
    value = data.get("target")
    if value is None:
        return None
    try:
        return check_target(value)
    except ValueError as exc:
        raise ConfigError("target", str(exc)) from None


def load_study(path: str | Path) -> StudySpec:
    """Read and check a study file (:func:`parse_study`, then :func:`check_configs`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"study file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    spec = parse_study(data, path.resolve().parent, path.stem)
    return check_configs(spec)


def _checked(cfg: dict[str, Any], where: str) -> Any:
    """``cfg`` checked as a run config; an error names ``where`` and the run config's field."""
    from mutualrl.config.resolve import load_config

    try:
        return load_config(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{where}.{exc.field}" if where == "base" else where, exc.reason if where == "base"
                          else f"{exc.field}: {exc.reason}") from None
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None


def check_configs(spec: StudySpec) -> StudySpec:
    """Check the base run config and every arm's and candidate's run config (on the first final
    seed) and give each arm without a role the one its strategy has: ``sharing`` when it reads peer
    rows, else ``baseline``. A study needs one of each."""
    from mutualrl.algorithms.registry import parse_strategy

    seed = spec.seeds[0]
    _checked({**spec.base, "seed": seed}, "base")
    arms = []
    for arm in spec.arms:
        cfg = deep_merge({**spec.base, "seed": seed}, arm.overrides)
        strategy = _checked(cfg, f"arms.{arm.name}.overrides").sharing.strategy
        for c, over in arm.candidates.items():
            _checked(deep_merge(cfg, over), f"arms.{arm.name}.candidates.{c}")
        role = arm.role or ("sharing" if parse_strategy(strategy).reads else "baseline")
        arms.append(ArmSpec(arm.name, role, arm.overrides, arm.candidates, arm.grpo_from))
    roles = {a.role for a in arms}
    if not {"baseline", "sharing"} <= roles:
        raise ConfigError("arms", "the protocol compares sharing arms with single-model baselines: give at least one "
                          f"of each (the arms' roles now: {', '.join(f'{a.name} {a.role}' for a in arms)}); an arm's "
                          "role follows its strategy (independent, self_imitate: baseline; imitate, prp, sgt: "
                          "sharing) unless it sets role")
    return dataclasses.replace(spec, arms=arms)
