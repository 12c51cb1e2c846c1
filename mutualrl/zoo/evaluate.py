"""Greedy (or sampled) exact accuracy of a zoo model, through the same sampler training uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mutualrl.rollout.engines import HFEngine, SamplingParams
from mutualrl.tasks import SUCCESS_THRESHOLD
from mutualrl.zoo.task import format_prompt

MAX_NEW_TOKENS = 8
"""Completion budget when the zoo measures accuracy (answers have at most 4 characters)."""


def generate_answers(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = MAX_NEW_TOKENS,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 512) -> list[str]:
    """Complete each prompt with :class:`~mutualrl.rollout.engines.hf.HFEngine` (greedy when ``temperature``
    is 0, else plain sampling); returns the decoded completions without special tokens."""

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    engine = HFEngine(model, [eos], pad, torch.Generator().manual_seed(seed))
    params = SamplingParams(max_new_tokens, temperature if temperature > 0 else 1.0, 1.0, greedy=temperature <= 0)
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    out: list[str] = []
    for start in range(0, len(ids), batch_size):
        gen = engine.generate(ids[start:start + batch_size], 1, params)
        out.extend(tokenizer.decode(c, skip_special_tokens=True) for c in gen.ids)
    return out


def accuracy(model: Any, tokenizer: Any, task: Any, problems: dict[str, Sequence[Any]], *,
             temperature: float = 0.0, seed: int = 0) -> dict[str, float]:
    """Exact accuracy (verifier score >= the success threshold) per task type of ``problems``."""
    acc: dict[str, float] = {}
    for name, probs in problems.items():
        texts = generate_answers(model, tokenizer, [format_prompt(p.question) for p in probs],
                                 temperature=temperature, seed=seed)
        ok = sum(task.verify(p, t) >= SUCCESS_THRESHOLD for p, t in zip(probs, texts, strict=True))
        acc[name] = ok / max(1, len(probs))
    return acc


def evaluate(model: Any, tokenizer: Any, task: Any, *, temperature: float = 0.0, n_per_type: int | None = None,
             seed: int = 0) -> dict[str, float]:
    """:func:`accuracy` on ``task``'s test split (the first ``n_per_type`` problems of each type)."""
    return accuracy(model, tokenizer, task, {k: (v[:n_per_type] if n_per_type else v) for k, v in task.test.items()},
                    temperature=temperature, seed=seed)
