"""The learning-rate schedule: a pure function of the step, so a resumed run continues exactly."""

from __future__ import annotations

import math

from mutualrl.config import GRPOOptions


def learning_rate_at(options: GRPOOptions, step: int, total_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based) of a ``total_steps`` run.

    Linear warm-up over ``warmup_steps`` (or ``warmup_ratio * total_steps``) from
    ``learning_rate / warmup`` to ``learning_rate``, then ``lr_scheduler_type``: constant, or a
    linear or cosine decay to 0.1 % of ``learning_rate`` at the last step.
    """
    lr = options.learning_rate
    warm = options.warmup_steps or round(options.warmup_ratio * total_steps)
    if step < warm:
        return lr * (step + 1) / warm
    if options.lr_scheduler_type == "constant":
        return lr
    span = max(1, total_steps - warm)
    frac = min(1.0, (step - warm + 1) / span)
    if options.lr_scheduler_type == "linear":
        return lr * (1.0 - frac) + lr * 1e-3 * frac
    return lr * (1e-3 + (1 - 1e-3) * 0.5 * (1.0 + math.cos(math.pi * frac)))
