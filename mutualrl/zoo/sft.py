"""The zoo's supervised warm start: train until every skill is inside its band.

Loss on the completion (answer + EOS) only; AdamW with a linear warm-up, then a constant
learning rate (a decay tied to a step budget would make the landing depend on that budget).
Every ``spec.sft_eval_every`` steps greedy accuracy is measured per task type on a validation
slice of the training problems, and SFT stops at the first check where every type is inside its
band, with a margin.

A tiny model learns a skill like carrying in a sudden jump, whose timing moves with anything
that changes floating-point rounding (the number of torch threads, above all): between two
checks it can jump over its whole band. So the warm start is steered, not just stopped: the
state at every check where no type is above its band is kept, and a second check in a row that
finds a type above its band rolls back to that state and goes on at half the learning rate with
checks twice as often, giving 1.5x the mixture share to a type still below its band; from then on, a check
where one type is inside its band while another is below gives the one behind 1.25x its share
(the mixture always keeps every type: taking one out makes a tiny model forget it within a few
dozen steps). Each rollback is recorded. A warm start that never goes above its band is exactly
the plain one. Deterministic in the seed and the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mutualrl.errors import UserError
from mutualrl.zoo.specs import ZooSpec
from mutualrl.zoo.task import format_prompt

VAL_SIZE = 500
"""Training problems per type held out of SFT to measure the band (the last ones of the split)."""


@dataclass
class SFTResult:
    """What a warm start did: per-step losses, the validation checks and whether it landed."""

    losses: list[float] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per check: ``step`` (steps trained so far), ``position`` (in the rolled-back run)
    and validation accuracy per type (``val``)."""
    landed: bool = False
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """One entry per overshoot rolled back: where, to where, and the settings it continued with."""
    mixture: dict[str, float] = field(default_factory=dict)
    """The skill mixture at the end (the spec's, unless a rollback shifted it)."""

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
    import torch

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


def in_band(spec: ZooSpec, acc: dict[str, float], margin: float = 0.0) -> bool:
    """Whether every type's accuracy lies inside its band, ``margin`` (a share of the band's width)
    inside both edges."""
    return all(lo + margin * (hi - lo) <= acc.get(k, 0.0) <= hi - margin * (hi - lo)
               for k, (lo, hi) in spec.bands.items())


MAX_ROLLBACKS = 8
"""Overshoots a warm start may roll back before it fails."""


def _band_state(spec: ZooSpec, acc: dict[str, float]) -> tuple[list[str], list[str], list[str]]:
    """(types above their band, types below its lower margin edge, types inside with the margin)."""
    above, below, inside = [], [], []
    for k, (lo, hi) in spec.bands.items():
        m = spec.band_margin * (hi - lo)
        v = acc.get(k, 0.0)
        if v > hi:
            above.append(k)
        elif v < lo + m:
            below.append(k)
        elif v <= hi - m:
            inside.append(k)
    return above, below, inside


def _shift(mixture: dict[str, float], lagging: list[str], factor: float) -> dict[str, float]:
    """``mixture`` with the ``lagging`` types' shares multiplied by ``factor``, renormalised."""
    out = {k: v * (factor if k in lagging else 1.0) for k, v in mixture.items()}
    total = sum(out.values())
    return {k: v / total for k, v in out.items()}


def sft(model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int,
        on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None) -> SFTResult:
    """Warm-start ``model`` on ``task``'s training problems until :func:`in_band` (or the cap).

    ``on_step(step, loss, check)`` is called after every step (``check`` is the history entry when
    the step ended with a validation check, else None). ``spec.sft_max_steps`` caps every step
    trained, rolled-back ones included.
    """
    import copy

    import torch
    import torch.nn.functional as F

    from mutualrl.zoo.evaluate import accuracy

    spec.check(list(task.train))
    val = {k: task.train[k][-VAL_SIZE:] for k in spec.bands}
    pools = {k: encode_examples(tokenizer, task.train[k][: max(1, len(task.train[k]) - VAL_SIZE)])
             for k in spec.sft_mixture}
    types = list(pools)
    mixture = {k: float(spec.sft_mixture[k]) for k in types}
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)
    lr_scale, every, pos = 1.0, spec.sft_eval_every, 0  # pos: the position in the (rolled-back) run
    was_above = False

    def snapshot() -> dict[str, Any]:
        return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                "gen": gen.get_state(), "pos": pos}

    safe = snapshot()
    res = SFTResult()
    model.train()
    for step in range(spec.sft_max_steps):
        for group in opt.param_groups:
            group["lr"] = spec.lr * lr_scale * min(1.0, (pos + 1) / max(1, spec.warmup_steps))
        w = torch.tensor([mixture[k] for k in types], dtype=torch.float)
        kinds = torch.multinomial(w, spec.batch, replacement=True, generator=gen).tolist()
        batch = []
        for k in kinds:
            pool = pools[types[k]]
            batch.append(pool[int(torch.randint(len(pool), (1,), generator=gen))])
        input_ids, mask, labels = collate(batch, tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        pos += 1
        res.losses.append(float(loss.detach()))
        check = None
        if pos % every == 0:
            acc = accuracy(model, tokenizer, task, val)
            model.train()
            check = {"step": step + 1, "position": pos, "val": acc}
            res.history.append(check)
            # stop with a margin: the first check past an edge flatters the model (a lucky swing of a
            # tiny model at a constant learning rate, plus validation noise), the test split regresses
            res.landed = in_band(spec, acc, spec.band_margin)
            above, below, inside = _band_state(spec, acc)
            # above at two checks in a row: a jump over the band (one check above is often a swing
            # that the next check undoes, and training on through it is what lands most builds)
            over, was_above = bool(above) and was_above, bool(above)
            if res.landed:
                pass
            elif over and len(res.rollbacks) >= MAX_ROLLBACKS:
                break  # it keeps jumping over the band: fail now rather than at the cap
            elif over:
                was_above = False
                lr_scale, every = lr_scale / 2, max(5, every // 2)
                mixture = _shift(mixture, below, 1.5)  # a type still behind gets more of the batches
                res.rollbacks.append({"step": step + 1, "from_position": pos, "to_position": safe["pos"],
                                      "val": acc, "lr_scale": lr_scale, "eval_every": every,
                                      "mixture": dict(mixture)})
                model.load_state_dict(safe["model"])
                opt.load_state_dict(safe["opt"])
                gen.set_state(safe["gen"])
                pos = safe["pos"]
                check["rolled_back"] = True
            elif not above:
                if res.rollbacks and below and inside:  # steering after an overshoot: one type waits
                    mixture = _shift(mixture, below, 1.25)  # for another: feed the one behind
                    check["mixture"] = dict(mixture)
                safe = snapshot()
        if on_step is not None:
            on_step(step, res.losses[-1], check)
        if res.landed:
            break
    res.mixture = mixture
    model.eval()
    return res


class ZooBandError(UserError):
    """A zoo build that did not land inside its band within its step cap."""


def band_failure(spec: ZooSpec, res: SFTResult) -> ZooBandError:
    """The error for a build that missed its band: what it measured and what to try."""
    got = ", ".join(f"{k} {res.val_accuracy.get(k, 0):.1%} (band {lo:.0%}-{hi:.0%})"
                    for k, (lo, hi) in spec.bands.items())
    return ZooBandError(f"zoo policy {spec.name!r} did not land in its band after {len(res.losses)} SFT steps "
                        f"(sft_max_steps, {len(res.rollbacks)} overshoots rolled back): validation accuracy "
                        f"{got}. Raise sft_max_steps, widen the bands or change the mixture; nothing was "
                        f"written to the cache")
