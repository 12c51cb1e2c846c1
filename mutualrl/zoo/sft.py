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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mutualrl.errors import UserError
from mutualrl.zoo.evaluate import accuracy
from mutualrl.zoo.specs import ZooSpec
from mutualrl.zoo.task import format_prompt

VAL_SIZE = 500
"""Training problems per type held out of SFT to measure the band (the last ones of the split)."""
MIN_SFT_POOL = 200
"""Fewest training problems per type left for SFT after :data:`VAL_SIZE` are held out (fewer are
memorised, not learned: a 3-digit task of 360 training problems left one example to train on)."""


class TooFewProblems(ValueError):
    """A task type has fewer training problems than a zoo build needs (:func:`check_task_size`)."""

    def __init__(self, index: int, alias: str, count: int) -> None:
        self.index, self.alias, self.count = index, alias, count
        super().__init__(f"task type {alias!r} has {count} training problems; a zoo build holds {VAL_SIZE} out "
                         f"for validation and needs at least {MIN_SFT_POOL} more to train on "
                         f"({VAL_SIZE + MIN_SFT_POOL} in all): give a larger problem space, or a smaller "
                         "test_fraction / test_size")


def check_task_size(task: Any) -> None:
    """Raise :class:`TooFewProblems` for the first task type with under ``VAL_SIZE + MIN_SFT_POOL``
    training problems (its index in ``task.train``'s order, the task's datasets' order)."""
    for i, (alias, problems) in enumerate(task.train.items()):
        if len(problems) < VAL_SIZE + MIN_SFT_POOL:
            raise TooFewProblems(i, alias, len(problems))


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

    @property
    def val_accuracy(self) -> dict[str, float]:
        """The last measured validation accuracy per type."""
        return dict(self.history[-1]["val"]) if self.history else {}


def encode_examples(tokenizer: Any, problems: Sequence[Any]) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per problem: prompt ids + answer ids + EOS."""
    prompts = tokenizer([format_prompt(p.question) for p in problems], add_special_tokens=False)["input_ids"]
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(list(p) + list(a) + [eos], len(p)) for p, a in zip(prompts, answers, strict=True)]


def collate(examples: Sequence[tuple[list[int], int]], pad_id: int):
    """Right-padded ids, attention mask and labels (-100 outside the completion)."""
    width = max(len(ids) for ids, _ in examples)
    n = len(examples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (ids, plen) in enumerate(examples):
        t = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = t
        mask[i, : len(ids)] = 1
        labels[i, plen: len(ids)] = t[plen:]
    return input_ids, mask, labels


def outside_band(spec: ZooSpec, acc: dict[str, float], margin: float = 0.0) -> tuple[list[str], list[str]]:
    """(types above, types below) their band with ``margin`` (a share of the band's width) inside
    both edges; an edge at 0 or 1 has no margin (no accuracy lies beyond it)."""
    def edges(lo: float, hi: float) -> tuple[float, float]:
        m = margin * (hi - lo)
        return (lo + m if lo > 0 else lo), (hi - m if hi < 1 else hi)

    high = [k for k, b in spec.bands.items() if acc.get(k, 0.0) > edges(*b)[1]]
    low = [k for k, b in spec.bands.items() if acc.get(k, 0.0) < edges(*b)[0]]
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
    floor = min(MIN_SHARE, 0.5 / len(mixture))
    out = {k: v * (0.5 if k in above else 1.5 if k in below else 1.0) for k, v in mixture.items()}
    floored: set[str] = set()
    while True:  # types under the floor get it; the others share the rest in proportion
        free = sum(v for k, v in out.items() if k not in floored)
        rest = 1.0 - floor * len(floored)
        low = {k for k, v in out.items() if k not in floored and v / free * rest < floor}
        if not low:
            return {k: floor if k in floored else v / free * rest for k, v in out.items()}
        floored |= low


def warm_start_split(task: Any, types: Iterable[str]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(the problems a warm start trains on, those it validates on) per type of ``task``: of each
    type's training list, the last :data:`VAL_SIZE` are validation, the rest training. A run on the
    same task with ``task.val_size`` = ``VAL_SIZE`` x the number of types (equal weights) holds out
    the same validation problems, and the test split is never in either."""
    names = list(types)
    train = {k: task.train[k][: max(1, len(task.train[k]) - VAL_SIZE)] for k in names}
    return train, {k: task.train[k][-VAL_SIZE:] for k in names}


class _Steps:
    """The warm start's optimizer steps: AdamW with a linear warm-up, then a constant learning rate;
    each batch drawn from the per-type example pools by a mixture."""

    def __init__(self, model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int) -> None:
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.pools = {k: encode_examples(tokenizer, problems)
                      for k, problems in warm_start_split(task, spec.bands)[0].items()}
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)
        self.done = 0
        self.lr_scale = 1.0

    def step(self, mixture: dict[str, float]) -> float:
        """One optimizer step on a batch drawn by ``mixture``; returns the loss."""
        spec, types = self.spec, list(mixture)
        for group in self.opt.param_groups:
            group["lr"] = spec.lr * self.lr_scale * min(1.0, (self.done + 1) / max(1, spec.warmup_steps))
        w = torch.tensor([mixture[k] for k in types], dtype=torch.float)
        kinds = torch.multinomial(w, spec.batch, replacement=True, generator=self.gen).tolist()
        batch = []
        for k in kinds:
            pool = self.pools[types[k]]
            batch.append(pool[int(torch.randint(len(pool), (1,), generator=self.gen))])
        input_ids, mask, labels = collate(batch, self.tokenizer.pad_token_id)
        self.model.train()
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.done += 1
        return float(loss.detach())


def sft(model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int,
        on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None) -> SFTResult:
    """Warm-start ``model`` on ``task``'s training problems until :func:`in_band` (or the cap).

    With ``spec.generalist_target`` a generalist phase comes first (:func:`_generalist`). ``on_step(step,
    loss, check)`` is called after every step (``check`` is the history entry when the step ended
    with a validation check, else None). ``spec.sft_max_steps`` caps the banded phase's steps.
    """
    spec.check(list(task.train))
    val = warm_start_split(task, spec.bands)[1]
    steps = _Steps(model, tokenizer, task, spec, seed)
    res = SFTResult()
    if spec.generalist_target > 0:
        if _generalist(steps, task, val, res, on_step):
            _specialise(steps, task, val, res, on_step)
        model.eval()
        return res
    mixture = {k: float(spec.sft_mixture[k]) for k in spec.sft_mixture}
    every, was_above, was_inside, steering = spec.sft_eval_every, False, False, False
    all_above: list[float] = []  # the summed excess over the bands at each check of a streak of all-above
    steer_margin = max(spec.band_margin, STEER_MARGIN)
    for local in range(spec.sft_max_steps):
        res.losses.append(steps.step(mixture))
        check = None
        if (local + 1) % every == 0:
            acc = accuracy(model, tokenizer, task, val)
            check = {"step": steps.done, "val": acc}
            res.history.append(check)
            # stop with a margin: the first check past an edge flatters the model (a lucky swing of a
            # tiny model at a constant learning rate, plus validation noise), the test split regresses
            # a steered model moves fast (a skill fed less is forgotten within a few checks): it lands
            # only at the second check in a row inside the band
            inside_now = in_band(spec, acc, steer_margin if steering else spec.band_margin)
            res.landed, was_inside = inside_now and (not steering or was_inside), inside_now
            above, _ = outside_band(spec, acc)
            # above at two checks in a row: a jump over the band (one check above is often a swing
            # that the next check undoes, and training on through it is what lands most builds)
            over, was_above = bool(above) and was_above, bool(above)
            if not inside_now and (steering or over):  # then some type is outside the steered margin
                steering, every = True, min(every, STEER_EVERY)
                high, low = outside_band(spec, acc, steer_margin)
                mixture = _steer(mixture, high, low)
                res.steering.append({"step": steps.done, "val": acc, "above": high, "below": low,
                                     "mixture": dict(mixture)})
                check["mixture"] = dict(mixture)
                excess = sum(acc[k] - spec.bands[k][1] for k in above)
                if set(above) == set(spec.bands):
                    all_above.append(excess)
                else:
                    all_above.clear()
                res.gave_up = _hopeless(all_above, len(res.steering))
        if on_step is not None:
            on_step(steps.done - 1, res.losses[-1], check)
        if res.landed or res.gave_up:
            break
    res.mixture = mixture
    model.eval()
    return res


def _generalist(steps: _Steps, task: Any, val: dict[str, Any], res: SFTResult,
                on_step: Callable[[int, float, dict[str, Any] | None], None] | None) -> bool:
    """The generalist phase: an even mixture of every type until each reaches
    ``spec.generalist_target`` on validation (then the specialisation lets the other skills fade
    into their bands: a skill learned and partly forgotten comes back from far fewer examples than
    one never learned). Returns False, with ``res.gave_up`` set, when the phase's cap is reached."""
    spec = steps.spec
    even = {k: 1.0 for k in sorted(spec.bands)}
    for _ in range(spec.generalist_max_steps):
        res.losses.append(steps.step(even))
        check = None
        if steps.done % spec.sft_eval_every == 0:
            acc = accuracy(steps.model, steps.tokenizer, task, val)
            check = {"step": steps.done, "val": acc, "phase": "generalist"}
            res.history.append(check)
            res.generalist_steps = steps.done
        if on_step is not None:
            on_step(steps.done - 1, res.losses[-1], check)
        if check is not None and min(check["val"].values()) >= spec.generalist_target:
            return True
    res.gave_up = (f"the generalist phase did not bring every skill to {spec.generalist_target:.0%} within "
                   f"generalist_max_steps ({spec.generalist_max_steps})")
    return False


SPECIALISE_LR_SCALE = 1 / 3
"""The specialisation's learning rate relative to the spec's: slower forgetting, fewer overshoots."""


def _specialise(steps: _Steps, task: Any, val: dict[str, Any], res: SFTResult,
                on_step: Callable[[int, float, dict[str, Any] | None], None] | None) -> None:
    """After the generalist phase: train on ``sft_mixture`` (the own skill) at a third of the
    learning rate, checking every :data:`STEER_EVERY` steps, until every type is inside its band
    with the margin (the skills left out fade into theirs). A type that falls below its band
    cannot come back without its data: the warm start gives up then."""
    spec = steps.spec
    mixture = {k: float(v) for k, v in spec.sft_mixture.items()}
    steps.lr_scale = SPECIALISE_LR_SCALE
    for local in range(spec.sft_max_steps):
        res.losses.append(steps.step(mixture))
        check = None
        if (local + 1) % STEER_EVERY == 0:
            acc = accuracy(steps.model, steps.tokenizer, task, val)
            check = {"step": steps.done, "val": acc, "phase": "specialise"}
            res.history.append(check)
            res.landed = in_band(spec, acc, spec.band_margin)
            _, below = outside_band(spec, acc)
            lost = [k for k in below if mixture.get(k, 0.0) <= 0]
            if lost:
                res.gave_up = f"{', '.join(lost)} fell below its band while specialising (it has no share to recover)"
        if on_step is not None:
            on_step(steps.done - 1, res.losses[-1], check)
        if res.landed or res.gave_up:
            break
    res.mixture = mixture


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
    """A zoo build that did not land inside its band within its step cap."""


def band_failure(spec: ZooSpec, res: SFTResult) -> ZooBandError:
    """The error for a build that missed its band: what it measured and what to try."""
    got = ", ".join(f"{k} {res.val_accuracy.get(k, 0):.1%} (band {lo:.0%}-{hi:.0%})"
                    for k, (lo, hi) in spec.bands.items())
    why = f"stopped early: {res.gave_up}" if res.gave_up else "sft_max_steps"
    return ZooBandError(f"zoo policy {spec.name!r} did not land in its band after {len(res.losses)} SFT steps "
                        f"({why}; {len(res.steering)} steering checks): validation accuracy "
                        f"{got}. Raise sft_max_steps, widen the bands or change the mixture; nothing was "
                        f"written to the cache")
