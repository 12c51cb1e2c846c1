"""The zoo's supervised warm start: train until every skill is inside its band.

Loss on the completion (answer + EOS) only; AdamW with a linear warm-up, then a constant
learning rate (a decay tied to a step budget would make the landing depend on that budget).
Every ``spec.sft_eval_every`` steps greedy accuracy is measured per task type on a validation
slice of the training problems, and SFT stops at the first check where every type is inside its
band, with a margin.

A tiny model learns a skill like carrying in a sudden jump, whose timing moves with anything
that changes floating-point rounding (the number of torch threads, above all): between two
checks it can jump over its whole band while another skill is still below its own. So the warm
start is steered by its mixture, not just stopped: once two checks in a row find a type above
its band (one check above is often a swing the next one undoes), checks come every
:data:`STEER_EVERY` steps and each one that finds a type outside its band (with the wider margin
:data:`STEER_MARGIN`) halves the share of every type above it and gives 1.5x to every type below
it (renormalised, no type under :data:`MIN_SHARE`: taking a type out makes a tiny model forget it
within a few dozen steps). A skill fed less is forgotten quickly, one fed more grows, so the two
meet inside their bands; a steered warm start lands at the second check in a row with every type
inside that wider margin (one check can catch a skill on its way through, and a fast-moving
model's validation figure says less about its test one). Each steering check is recorded. A warm
start that never goes above its band twice in a row is exactly the plain one. Deterministic in
the seed and the thread count.

Every phase (the generalist one, the specialisation, the banded warm start) is watched for a
stall (:mod:`mutualrl.zoo.stall`): a type that comes no closer to its goal for ``stall_patience``
checks is nudged (the generalist phase feeds a lagging type more once another has reached the
target; the specialisation raises its learning rate when a type stays above its band, and shifts
the shares of the types it feeds), and one that comes no closer for ``stall_checks`` checks stops
the warm start with ``res.stall`` set, long before the phase's cap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.errors import UserError
from mutualrl.zoo.evaluate import accuracy
from mutualrl.zoo.specs import ZooSpec, rate_levers
from mutualrl.zoo.stall import Stall, StallWatch, landing_edges, stall_message
from mutualrl.zoo.steps import Steps, warm_start_split

StepHook = Callable[[int, float, dict[str, Any] | None], None]
"""``on_step(step, loss, check)`` after every optimizer step: the step's index in the attempt, its
loss, and the history entry when the step ended with a validation check (else None)."""
PhaseHook = Callable[[str, int, int], None]
"""``on_phase(phase, cap, done)`` when a phase starts: its name (``generalist``, ``specialise`` or
``banded``), its step cap, and the steps the attempt has done before it."""


@dataclass
class SFTResult:
    """What a warm start did: per-step losses, the validation checks and whether it landed."""

    losses: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per check: ``step`` (steps trained so far) and validation accuracy per type (``val``)."""
    landed: bool = False
    steering: list[dict[str, Any]] = field(default_factory=list)
    """One entry per check that shifted the mixture: ``step``, ``val``, the types ``above`` and
    ``below`` their band, and the ``mixture`` trained on from there."""
    mixture: dict[str, float] = field(default_factory=dict)
    """The skill mixture at the end (the spec's, unless steering shifted it)."""
    gave_up: str = ""
    """Why the warm start stopped before ``sft_max_steps`` without landing (empty otherwise)."""
    generalist_steps: int = 0
    """Steps of the generalist phase (0 without one)."""
    stall: Stall | None = None
    """The stall that stopped the warm start (:mod:`mutualrl.zoo.stall`), if one did."""
    phase_steps: dict[str, int] = field(default_factory=dict)
    """Steps per phase, in the order they ran."""
    check_s: float = 0.0
    """Seconds spent in validation checks (the rest of the warm start is optimizer steps)."""
    lr_scale: float = 1.0
    """The learning rate at the end, relative to the spec's (specialisation and its nudges)."""

    @property
    def val_accuracy(self) -> dict[str, float]:
        """The last measured validation accuracy per type."""
        return dict(self.history[-1]["val"]) if self.history else {}


def outside_band(spec: ZooSpec, acc: dict[str, float], margin: float = 0.0) -> tuple[list[str], list[str]]:
    """(types above, types below) their band with ``margin`` (a share of the band's width) inside
    both edges; an edge at 0 or 1 has no margin (no accuracy lies beyond it)."""
    edges = landing_edges(spec.bands, margin)
    high = [k for k in spec.bands if acc.get(k, 0.0) > edges[k][1]]
    low = [k for k in spec.bands if acc.get(k, 0.0) < edges[k][0]]
    return high, low


def in_band(spec: ZooSpec, acc: dict[str, float], margin: float = 0.0) -> bool:
    """Whether every type's accuracy lies inside its band, ``margin`` (a share of the band's width)
    inside both edges."""
    high, low = outside_band(spec, acc, margin)
    return not high and not low


STEER_EVERY = 10
"""Steps between validation checks once the warm start is steered."""
MIN_SHARE = 0.05
"""The smallest mixture share steering leaves a type."""
ALL_ABOVE_CHECKS = 10
"""Steering checks in a row with every type above its band, none of them coming down, after which
a warm start gives up: steering shifts shares *between* types, so when all are above it changes
nothing, and a skill that is still fed does not come back down by itself (one starved by the
mixture is forgotten, and then the excess falls)."""
MAX_STEER_CHECKS = 150
"""Steering checks after which a warm start that has not landed gives up (the default builds land
within 30)."""
STEER_MARGIN = 0.25
"""The landing margin (a share of each band's width) once steered: a steered model moves fast, so
its validation figure says less about its test one (30-50 %: 35-45 %)."""


def _steer(mixture: dict[str, float], above: list[str], below: list[str]) -> dict[str, float]:
    """``mixture`` with the shares of the types ``above`` their band halved and of those ``below``
    it multiplied by 1.5, renormalised, every share at least :data:`MIN_SHARE` (or half an even
    share, with more than ten types)."""
    return _floored({k: v * (0.5 if k in above else 1.5 if k in below else 1.0) for k, v in mixture.items()})


def _floored(weights: dict[str, float]) -> dict[str, float]:
    """``weights`` renormalised to shares, every share at least :data:`MIN_SHARE` (or half an even
    share, with more than ten types): the types under the floor get it, the others share the rest in
    proportion."""
    floor = min(MIN_SHARE, 0.5 / len(weights))
    floored: set[str] = set()
    while True:
        free = sum(v for k, v in weights.items() if k not in floored)
        rest = 1.0 - floor * len(floored)
        low = {k for k, v in weights.items() if k not in floored and v / free * rest < floor}
        if not low:
            return {k: floor if k in floored else v / free * rest for k, v in weights.items()}
        floored |= low


def sft(model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int, on_step: StepHook | None = None,
        on_phase: PhaseHook | None = None) -> SFTResult:
    """Warm-start ``model`` on ``task``'s training problems until :func:`in_band` (or the cap).

    With ``spec.generalist_target`` a generalist phase comes first (:func:`_generalist`), then the
    specialisation (:func:`_specialise`); without, the banded warm start (:func:`_banded`). Each
    phase is capped (``generalist_max_steps``, ``sft_max_steps``) and stops early once it has
    stalled (:mod:`mutualrl.zoo.stall`: ``res.stall`` is set; the caller may start over from another
    initialisation). ``on_step`` and ``on_phase`` report progress (:data:`StepHook`, :data:`PhaseHook`).
    """
    spec.check(list(task.train))
    run = _Run(Steps(model, tokenizer, task, spec, seed), task, warm_start_split(task, spec.bands)[1], SFTResult(),
               on_step, on_phase)
    if spec.generalist_target > 0:
        if _generalist(run):
            _specialise(run)
    else:
        _banded(run)
    run.res.lr_scale = run.steps.lr_scale
    model.eval()
    return run.res


@dataclass
class _Run:
    """One warm start in progress: its steps, validation problems, result and progress hooks."""

    steps: Steps
    task: Any
    val: dict[str, Any]
    res: SFTResult
    on_step: StepHook | None
    on_phase: PhaseHook | None

    def begin(self, phase: str, cap: int, goals: dict[str, tuple[float, float]], patience: bool = True) -> StallWatch:
        """Announce ``phase`` (at most ``cap`` steps) and return its stall watch toward ``goals``."""
        if self.on_phase is not None:
            self.on_phase(phase, cap, self.steps.done)
        spec = self.steps.spec
        return StallWatch(phase, goals, spec.stall_checks, spec.stall_min_gain, spec.stall_patience if patience else 0)

    def step(self, mixture: dict[str, float]) -> None:
        """One optimizer step on ``mixture``."""
        self.res.losses.append(self.steps.step(mixture))

    def check(self, phase: str | None) -> dict[str, Any]:
        """Measure validation accuracy; append and return the history entry."""
        t = time.perf_counter()
        acc = accuracy(self.steps.model, self.steps.tokenizer, self.task, self.val)
        self.res.check_s += time.perf_counter() - t
        check: dict[str, Any] = {"step": self.steps.done, "val": acc}
        if phase is not None:
            check["phase"] = phase
        self.res.history.append(check)
        return check

    def tick(self, check: dict[str, Any] | None) -> None:
        """Report the step just taken."""
        if self.on_step is not None:
            self.on_step(self.steps.done - 1, self.res.losses[-1], check)

    def end(self, phase: str, start: int) -> None:
        """Record the steps ``phase`` took (it started ``start`` steps into the attempt)."""
        self.res.phase_steps[phase] = self.steps.done - start


@dataclass
class _Steering:
    """The banded warm start's steering state (:func:`_banded`)."""

    every: int
    was_above: bool = False
    was_inside: bool = False
    steering: bool = False
    all_above: list[float] = field(default_factory=list)
    """The summed excess over the bands at each check of a streak with every type above."""


def _banded(run: _Run) -> None:
    """The banded warm start: the spec's mixture, steered once a type overshoots its band (module
    docstring), until every type is inside its band, the cap, a hopeless steering or a stall."""
    spec, res = run.steps.spec, run.res
    mixture = {k: float(spec.sft_mixture[k]) for k in spec.sft_mixture}
    state = _Steering(every=spec.sft_eval_every)
    watch = run.begin("banded", spec.sft_max_steps, landing_edges(spec.bands, spec.band_margin), patience=False)
    for local in range(spec.sft_max_steps):
        run.step(mixture)
        check = None
        if (local + 1) % state.every == 0:
            check = run.check(None)
            mixture = _banded_check(spec, res, state, check, mixture)
            _, stall = watch.observe(check["val"], run.steps.done)
            if stall is not None and not res.landed and not res.gave_up:
                res.stall, res.gave_up = stall, stall.describe(spec.stall_min_gain)
        run.tick(check)
        if res.landed or res.gave_up:
            break
    run.end("banded", 0)
    res.mixture = mixture


def _banded_check(spec: ZooSpec, res: SFTResult, state: _Steering, check: dict[str, Any],
                  mixture: dict[str, float]) -> dict[str, float]:
    """One check of the banded warm start: whether it landed, and the mixture from here on."""
    acc = check["val"]
    steer_margin = max(spec.band_margin, STEER_MARGIN)
    # stop with a margin: the first check past an edge flatters the model (a lucky swing of a tiny
    # model at a constant learning rate, plus validation noise), the test split regresses; a steered
    # model moves fast (a skill fed less is forgotten within a few checks): it lands only at the
    # second check in a row inside the band
    inside_now = in_band(spec, acc, steer_margin if state.steering else spec.band_margin)
    res.landed, state.was_inside = inside_now and (not state.steering or state.was_inside), inside_now
    above, _ = outside_band(spec, acc)
    # above at two checks in a row: a jump over the band (one check above is often a swing that the
    # next check undoes, and training on through it is what lands most builds)
    over, state.was_above = bool(above) and state.was_above, bool(above)
    if inside_now or not (state.steering or over):
        return mixture
    state.steering, state.every = True, min(state.every, STEER_EVERY)  # some type is outside the steered margin
    high, low = outside_band(spec, acc, steer_margin)
    mixture = _steer(mixture, high, low)
    res.steering.append({"step": check["step"], "val": acc, "above": high, "below": low, "mixture": dict(mixture)})
    check["mixture"] = dict(mixture)
    if set(above) == set(spec.bands):
        state.all_above.append(sum(acc[k] - spec.bands[k][1] for k in above))
    else:
        state.all_above.clear()
    res.gave_up = _hopeless(state.all_above, len(res.steering))
    return mixture


def _generalist(run: _Run) -> bool:
    """The generalist phase: an even mixture of every type, at ``spec.generalist_rate``, until each
    reaches ``spec.generalist_target`` on validation (then the specialisation lets the other skills
    fade into their bands: a skill learned and partly forgotten comes back from far fewer examples
    than one never learned). From the first check a type is at or above the target while another is
    below, the batches feed it ``spec.generalist_catch_up`` of its share (:func:`catch_up`; the check's
    history entry records the mixture whenever it changes); a type that has reached the target while
    another makes no progress for ``stall_patience`` checks is fed less still (:func:`_steer`: half its
    share; the lagging one 1.5x). Returns False, with ``res.gave_up`` set, when the phase's cap is reached or it stalled."""
    spec, res = run.steps.spec, run.res
    target = spec.generalist_target
    mixture = {k: 1.0 for k in sorted(spec.bands)}
    fed = mixture  # what the batches are drawn by: ``mixture`` with the catch-up applied
    run.steps.base_lr = spec.generalist_rate
    watch = run.begin("generalist", spec.generalist_max_steps, {k: (target, 1.0) for k in spec.bands})
    for _ in range(spec.generalist_max_steps):
        run.step(fed)
        check = None
        if run.steps.done % spec.sft_eval_every == 0:
            check = run.check("generalist")
            res.generalist_steps = run.steps.done
            due, res.stall = watch.observe(check["val"], run.steps.done)
            reached = [k for k in mixture if check["val"][k] >= target]
            if due and reached and res.stall is None:
                mixture = _steer(mixture, reached, due)
                res.steering.append({"step": run.steps.done, "val": check["val"], "above": reached, "below": due,
                                     "mixture": dict(mixture), "phase": "generalist"})
            was, fed = fed, catch_up(mixture, reached, spec.generalist_catch_up)
            if fed != was:
                check["mixture"] = dict(fed)
        run.tick(check)
        if check is not None and min(check["val"].values()) >= target:
            run.end("generalist", 0)
            return True
        if res.stall is not None:
            res.gave_up = res.stall.describe(spec.stall_min_gain)
            break
    else:
        res.gave_up = (f"the generalist phase did not bring every skill to {target:.0%} within "
                       f"generalist_max_steps ({spec.generalist_max_steps})")
    run.end("generalist", 0)
    return False


def catch_up(mixture: dict[str, float], reached: Sequence[str], weight: float) -> dict[str, float]:
    """The generalist phase's batch mixture: ``mixture`` with the share of every type in ``reached``
    (at or above the target at the last check) times ``weight``, renormalised, while some type is
    still below it, no share under :data:`MIN_SHARE` (a skill taken out is forgotten within a few
    dozen steps); ``mixture`` itself when none or all have reached it, or ``weight`` is 1."""
    if weight >= 1.0 or not reached or len(reached) == len(mixture):
        return mixture
    return _floored({k: v * (weight if k in reached else 1.0) for k, v in mixture.items()})


SPECIALISE_LR_SCALE = 1 / 3
"""The specialisation's learning rate relative to the spec's: slower forgetting, fewer overshoots."""
NUDGE_LR_STEP = 1.5
"""A specialising skill above its band with no progress for ``stall_patience`` checks multiplies the
learning rate by this (a skill left out fades by interference, faster at a higher rate), up to the
spec's own (1/3 -> 1/2 -> 3/4 -> 1)."""


def _specialise(run: _Run) -> None:
    """After the generalist phase: train on ``sft_mixture`` (the own skill) at a third of the
    learning rate, checking every :data:`STEER_EVERY` steps, until every type is inside its band
    with the margin (the skills left out fade into theirs). A type that falls below its band
    cannot come back without its data: the warm start gives up then. A type outside its band with
    no progress for ``stall_patience`` checks is nudged (:func:`_nudge`); one with none for
    ``stall_checks`` stalls the phase."""
    spec, res, start = run.steps.spec, run.res, run.steps.done
    mixture = {k: float(v) for k, v in spec.sft_mixture.items()}
    run.steps.base_lr, run.steps.lr_scale = spec.lr, SPECIALISE_LR_SCALE
    watch = run.begin("specialise", spec.sft_max_steps, landing_edges(spec.bands, spec.band_margin))
    for local in range(spec.sft_max_steps):
        run.step(mixture)
        check = None
        if (local + 1) % STEER_EVERY == 0:
            check = run.check("specialise")
            res.landed = in_band(spec, check["val"], spec.band_margin)
            _, below = outside_band(spec, check["val"])
            lost = [k for k in below if mixture.get(k, 0.0) <= 0]
            due, stall = watch.observe(check["val"], run.steps.done)
            if lost:
                res.gave_up = f"{', '.join(lost)} fell below its band while specialising (it has no share to recover)"
            elif stall is not None and not res.landed:
                res.stall, res.gave_up = stall, stall.describe(spec.stall_min_gain)
            elif due and not res.landed:
                mixture = _nudge(run, check, mixture, due)
        run.tick(check)
        if res.landed or res.gave_up:
            break
    run.end("specialise", start)
    res.mixture = mixture


def _nudge(run: _Run, check: dict[str, Any], mixture: dict[str, float], due: list[str]) -> dict[str, float]:
    """Nudge a specialisation whose types ``due`` made no progress toward their bands: the learning
    rate up by :data:`NUDGE_LR_STEP` (to the spec's at most) when one is above its band, and among
    the types with a share, :func:`_steer` (half the share of one above, 1.5x of one below; a
    type without a share keeps none). Recorded in ``res.steering``; returns the mixture."""
    spec, steps = run.steps.spec, run.steps
    high, low = outside_band(spec, check["val"], spec.band_margin)
    high, low = [k for k in high if k in due], [k for k in low if k in due]
    if high:
        steps.lr_scale = min(1.0, steps.lr_scale * NUDGE_LR_STEP)
    fed = {k: v for k, v in mixture.items() if v > 0}
    if len(fed) > 1 and set(fed) & set(high + low):
        fed = _steer(fed, [k for k in high if k in fed], [k for k in low if k in fed])
        mixture = {k: fed.get(k, 0.0) for k in mixture}
    run.res.steering.append({"step": check["step"], "val": check["val"], "above": high, "below": low,
                             "mixture": dict(mixture), "lr_scale": steps.lr_scale, "phase": "specialise"})
    return mixture


def _hopeless(all_above: list[float], steer_checks: int) -> str:
    """Why a steered warm start cannot land any more, or ``""``: every skill above its band for
    :data:`ALL_ABOVE_CHECKS` checks with the summed excess not falling, or too long steered."""
    if len(all_above) >= ALL_ABOVE_CHECKS and all_above[-1] >= all_above[-ALL_ABOVE_CHECKS]:
        return (f"every skill was above its band at {len(all_above)} steering checks in a row, the excess not "
                f"falling ({100 * all_above[-ALL_ABOVE_CHECKS]:.0f} -> {100 * all_above[-1]:.0f} points)")
    if steer_checks >= MAX_STEER_CHECKS:
        return f"{steer_checks} steering checks without landing"
    return ""


class ZooBandError(UserError):
    """A zoo build that did not land inside its band: its cap, a hopeless steering or a stall.

    ``details`` (when the build ran in this process): ``policy``, ``steps`` (of the last attempt),
    ``steps_all_attempts``, ``val`` (the last validation accuracy per type), ``gave_up``, ``stall``
    and ``attempts`` (:func:`mutualrl.zoo.build.train`'s records)."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details: dict[str, Any] = details or {}


def band_failure(spec: ZooSpec, res: SFTResult, attempts: Sequence[dict[str, Any]] = ()) -> ZooBandError:
    """The error for a build that missed its band: what it measured and what to try (for a stall,
    :func:`~mutualrl.zoo.stall.stall_message`; ``attempts`` are the build's attempts, each with its
    ``init_seed``)."""
    details = {"policy": spec.name, "steps": len(res.losses), "val": res.val_accuracy, "gave_up": res.gave_up,
               "stall": res.stall.to_dict() if res.stall else None, "attempts": list(attempts),
               "steps_all_attempts": sum(a["steps"] for a in attempts) if attempts else len(res.losses)}
    if res.stall is not None:
        return ZooBandError(stall_message(spec, res.stall, res.val_accuracy, attempts or [{"init_seed": "?"}]),
                            details)
    got = ", ".join(f"{k} {res.val_accuracy.get(k, 0):.1%} (band {lo:.0%}-{hi:.0%})"
                    for k, (lo, hi) in spec.bands.items())
    why = f"stopped early: {res.gave_up}" if res.gave_up else "sft_max_steps"
    return ZooBandError(f"zoo policy {spec.name!r} did not land in its band after {len(res.losses)} SFT steps "
                        f"({why}; {len(res.steering)} steering checks): validation accuracy "
                        f"{got}. Levers: more steps (--max-steps: sft_max_steps {spec.sft_max_steps}, "
                        f"generalist_max_steps {spec.generalist_max_steps}), another build seed (--seed), another "
                        f"learning rate ({rate_levers(spec)}), wider bands or another mixture (a zoo task file); "
                        f"nothing was written to the cache", details)
