"""When a phase of a zoo warm start has stalled, what it tries first, and what it tells the user.

The rule (settings on :class:`~mutualrl.zoo.specs.ZooSpec`, documented in ``docs/zoo.md``):

- every validation check of a phase measures each skill's **distance to its goal**: in the
  generalist phase how far it is below ``generalist_target``; in the specialisation and the banded
  warm start how far it is outside its band's landing edges (``band_margin`` of the band's width
  inside each edge that is not 0 or 1); 0 once it is there;
- a check is **progress** for a skill when that distance is 0, or at least ``stall_min_gain``
  below the smallest distance of the skill at the phase's earlier checks (the first check of a
  phase is progress). The best-so-far is what is compared, so validation noise does not count
  as progress: a skill that only swings around a plateau makes none;
- a skill outside its goal with no progress for ``stall_patience`` checks (counted from its last
  progress or its last nudge) is **nudged** (:mod:`mutualrl.zoo.sft` says how: shares of the
  mixture and, while specialising, the learning rate);
- a skill outside its goal with no progress for ``stall_checks`` checks has **stalled** the phase:
  the build starts over from another initialisation (``stall_restarts`` times, each init seed
  derived from the build seed by :func:`init_seed` and recorded in the card), and then stops with
  :class:`~mutualrl.zoo.sft.ZooBandError` (exit code 2 from the CLI) naming the policy, the
  skill, its validation figure, its band and the levers (:func:`stall_message`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.zoo.specs import rate_levers

_EPS = 1e-9
"""Slack for comparing accuracies (multiples of 1/500) after a subtraction."""


def init_seed(seed: int, attempt: int) -> int:
    """The initialisation seed of ``attempt`` (0 = the first) of a build of build ``seed``: ``seed``
    itself first (a build that never restarts is the build it always was), then a 31-bit number
    derived from both by sha256 (deterministic, and never another small build seed by accident)."""
    if attempt == 0:
        return seed
    digest = hashlib.sha256(f"mutualrl-zoo-restart:{seed}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def distance(value: float, goal: tuple[float, float]) -> float:
    """How far ``value`` lies outside ``goal`` = (low, high); 0 inside."""
    return max(0.0, goal[0] - value, value - goal[1])


def landing_edges(bands: dict[str, tuple[float, float]], margin: float) -> dict[str, tuple[float, float]]:
    """Each band's landing edges: ``margin`` of its width inside each edge that is not 0 or 1."""
    out = {}
    for k, (lo, hi) in bands.items():
        m = margin * (hi - lo)
        out[k] = (lo + m if lo > 0 else lo, hi - m if hi < 1 else hi)
    return out


@dataclass(frozen=True)
class Stall:
    """A stalled phase: the first skill that made no progress toward its goal for the window."""

    phase: str
    skill: str
    value: float
    """Its validation accuracy at the check that found the stall."""
    goal: tuple[float, float]
    """The edges it had to get inside (the generalist target, or its band's landing edges)."""
    checks: int
    """Checks of the phase since its last progress."""
    steps: int
    """Steps those checks span."""
    step: int
    """Steps of the attempt so far."""

    def describe(self, min_gain: float) -> str:
        """One line: which skill, where it is, where it had to go, for how long."""
        lo, hi = self.goal
        where = f"at least {lo:.1%}" if hi >= 1 else f"at most {hi:.1%}" if lo <= 0 else f"{lo:.1%}-{hi:.1%}"
        gain = f"{100 * min_gain:g} point{'' if 100 * min_gain == 1 else 's'}"
        return (f"{self.skill} at {self.value:.1%} on validation came no {gain} closer to {where} in "
                f"{self.checks} checks ({self.steps} steps) of the {self.phase} phase")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able record (the card's ``attempts``)."""
        return {"phase": self.phase, "skill": self.skill, "value": self.value, "goal": list(self.goal),
                "checks": self.checks, "steps": self.steps, "step": self.step}


@dataclass
class StallWatch:
    """The stall rule of one phase (module docstring): feed it every check with :meth:`observe`."""

    phase: str
    goals: dict[str, tuple[float, float]]
    checks: int
    """Checks without progress that stall the phase (0: never)."""
    min_gain: float
    patience: int
    """Checks without progress before a nudge (0: no nudges)."""
    _best: dict[str, float] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)
    _nudged: dict[str, int] = field(default_factory=dict)
    _steps: list[int] = field(default_factory=list)

    def observe(self, acc: dict[str, float], step: int) -> tuple[list[str], Stall | None]:
        """Record a check at ``step`` (steps of the attempt so far); return the skills due a nudge
        and the stall, if this check found one."""
        i = len(self._steps)
        self._steps.append(step)
        due: list[str] = []
        stall: Stall | None = None
        for k, goal in self.goals.items():
            d = distance(acc.get(k, 0.0), goal)
            if k not in self._best or d <= _EPS or d <= self._best[k] - self.min_gain + _EPS:
                self._since[k] = i
                self._nudged.pop(k, None)
            self._best[k] = min(self._best.get(k, d), d)
            if d <= _EPS:
                continue
            waited = i - self._since[k]
            if self.checks > 0 and waited >= self.checks and stall is None:
                stall = Stall(self.phase, k, acc.get(k, 0.0), goal, waited, step - self._steps[self._since[k]], step)
            if self.patience > 0 and i - self._nudged.get(k, self._since[k]) >= self.patience:
                self._nudged[k] = i
                due.append(k)
        return due, stall


def stall_message(spec: Any, stall: Stall, val: dict[str, float], attempts: Sequence[dict[str, Any]]) -> str:
    """The one-line error of a build stopped by a stall: the policy, the skill, its validation figure,
    its band, what was tried (restarts, init seeds) and the levers."""
    lo, hi = spec.bands[stall.skill]
    seeds = ", ".join(str(a["init_seed"]) for a in attempts)
    restarts = (f"after {len(attempts) - 1} restart{'s' if len(attempts) != 2 else ''} from another "
                f"initialisation (init seeds {seeds})" if len(attempts) > 1 else f"(init seed {seeds}, no restart left)")
    got = ", ".join(f"{k} {val.get(k, 0.0):.1%} (band {b[0]:.0%}-{b[1]:.0%})" for k, b in spec.bands.items())
    return (f"zoo policy {spec.name!r} stopped early: its {stall.phase} phase stalled at step {stall.step} "
            f"{restarts}: {stall.describe(spec.stall_min_gain)}; band of {stall.skill}: {lo:.0%}-{hi:.0%}; "
            f"validation accuracy {got}. Levers: another build seed (--seed), more steps before a stall "
            f"counts (--stall-checks, now {spec.stall_checks} checks), more restarts (--restarts, now "
            f"{spec.stall_restarts}), another learning rate ({rate_levers(spec)}), a looser band for "
            f"{stall.skill} (`bands:` in a zoo task file); nothing was written to the cache")
