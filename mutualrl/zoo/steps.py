"""The zoo warm start's data and optimizer steps: validation held out of the training split,
examples encoded as prompt + answer + EOS with the loss on the completion only, and AdamW with a
linear warm-up, then a constant learning rate per phase (times ``lr_scale``), on batches drawn by a mixture."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

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


def warm_start_split(task: Any, types: Iterable[str]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """(the problems a warm start trains on, those it validates on) per type of ``task``: of each
    type's training list, the last :data:`VAL_SIZE` are validation, the rest training. A run on the
    same task with ``task.val_size`` = ``VAL_SIZE`` x the number of types (equal weights) holds out
    the same validation problems, and the test split is never in either."""
    names = list(types)
    train = {k: task.train[k][: max(1, len(task.train[k]) - VAL_SIZE)] for k in names}
    return train, {k: task.train[k][-VAL_SIZE:] for k in names}


class Steps:
    """The warm start's optimizer steps: AdamW with a linear warm-up, then the phase's constant rate;
    each batch drawn from the per-type example pools by a mixture."""

    def __init__(self, model: Any, tokenizer: Any, task: Any, spec: ZooSpec, seed: int) -> None:
        self.model, self.tokenizer, self.spec = model, tokenizer, spec
        self.pools = {k: encode_examples(tokenizer, problems)
                      for k, problems in warm_start_split(task, spec.bands)[0].items()}
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=spec.weight_decay)
        self.done = 0
        self.base_lr = spec.lr
        """The phase's learning rate (the spec's ``lr``, or ``generalist_lr`` in the generalist phase)."""
        self.lr_scale = 1.0

    def step(self, mixture: dict[str, float]) -> float:
        """One optimizer step on a batch drawn by ``mixture``; returns the loss."""
        spec, types = self.spec, list(mixture)
        for group in self.opt.param_groups:
            group["lr"] = self.base_lr * self.lr_scale * min(1.0, (self.done + 1) / max(1, spec.warmup_steps))
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
