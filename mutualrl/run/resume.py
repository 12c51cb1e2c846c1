"""What a resumed run may change, and the record it keeps of what it was told.

A resumed run must compute the steps an uninterrupted run would. So a resume (``mutualrl train
--resume RUN --set ...`` or ``MutualTrainer(config, RUN, resume=True)`` from Python: the same check)
may change only the fields of :data:`~mutualrl.config.RESUMABLE` (how long it runs, how it
reports, whether it exports its final models), and ``steps`` only where no learning-rate schedule
depends on the run's total (``lr_scheduler_type`` linear or cosine, or a ``warmup_ratio``): there a
new total would change the learning rate of steps already trained, so it is refused. An accepted
change is written back to the run's ``config.yaml`` and appended to ``resumes.json`` (the step it
took effect at, each field's old and new value), so a later plain ``--resume``, ``eval`` and
``compare`` read what the run was last told.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from mutualrl.config import RESUMABLE, RunConfig
from mutualrl.errors import ConfigError
from mutualrl.paths import RUN_CONFIG
from mutualrl.run.checkpoint import atomic_write_text

RESUMES = "resumes.json"
"""The run directory's record of accepted changes on resume (a JSON list, oldest first)."""


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{prefix}.{i}"))
        return out
    return {prefix: value}


def config_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Every field (dotted path, list items by index) whose value differs between the configs."""
    a, b = _flat(old.to_dict()), _flat(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def schedule_depends_on_steps(cfg: RunConfig) -> str | None:
    """Why a change of ``steps`` would change already-trained steps' learning rate, or None."""
    for i, pol in enumerate(cfg.policies):
        o = cfg.policy_grpo(i)
        if o.lr_scheduler_type != "constant":
            return f"policy {pol.name!r} decays its learning rate over the run's steps (lr_scheduler_type: " \
                   f"{o.lr_scheduler_type})"
        if not o.warmup_steps and o.warmup_ratio > 0:
            return f"policy {pol.name!r} warms up over a share of the run's steps (warmup_ratio: {o.warmup_ratio})"
    return None


def check_resumable(old: RunConfig, new: RunConfig, run_dir: str | Path) -> dict[str, tuple[Any, Any]]:
    """The changes ``new`` makes to the config ``run_dir`` was trained with; ``ConfigError`` naming
    the first field a resume may not change (see the module docstring)."""
    changes = config_changes(old, new)
    for key in changes:
        if key.split(".")[0] not in RESUMABLE:
            raise ConfigError(key, f"cannot change when resuming {run_dir} (the resumed steps would differ from the "
                              f"ones already trained); a resumed run accepts {', '.join(sorted(RESUMABLE))} - "
                              "start a new run to change anything else")
    if "steps" in changes:
        why = schedule_depends_on_steps(old)
        if why:
            raise ConfigError("steps", f"cannot change from {changes['steps'][0]} to {changes['steps'][1]} when "
                              f"resuming {run_dir}: {why}, so a new total would change the learning rate of the "
                              "steps already trained. Use a constant schedule with warmup_steps, or start a new run")
    return changes


def record_resume(run_dir: str | Path, cfg: RunConfig, changes: dict[str, tuple[Any, Any]], step: int) -> None:
    """Write ``cfg`` back as the run's ``config.yaml`` and append the accepted ``changes`` (taking
    effect at ``step``) to ``resumes.json``; both atomically."""
    d = Path(run_dir)
    records = json.loads((d / RESUMES).read_text(encoding="utf-8")) if (d / RESUMES).is_file() else []
    records.append({"step": step, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()}})
    atomic_write_text(d / RESUMES, json.dumps(records, indent=1))
    atomic_write_text(d / RUN_CONFIG, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def resumes(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's record of accepted changes on resume (empty when it never resumed with one)."""
    p = Path(run_dir) / RESUMES
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else []
