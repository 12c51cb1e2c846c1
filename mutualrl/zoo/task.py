"""The zoo's task: 2-digit addition (``add``) and subtraction (``sub``) from reasoning-gym."""

from __future__ import annotations

from typing import Any

from mutualrl.tasks import GymSource, Task

PROMPT_TEMPLATE = "{question} Answer: "
"""How a question becomes a prompt; the completion is the answer followed by EOS."""

_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2,
               "allow_parentheses": False, "allow_negation": False}


def task_section(weights: dict[str, float] | None = None, **extra: Any) -> dict[str, Any]:
    """A run config ``task:`` section for the zoo task with the given type weights (default equal),
    e.g. ``task_section({"add": 0.8, "sub": 0.2})`` for a policy's own warm-start mixture."""
    weights = weights or {"add": 1.0, "sub": 1.0}
    ops = {"add": "+", "sub": "-"}
    datasets = [{"name": "basic_arithmetic", "alias": k, "config": dict(_ARITHMETIC, operators=[ops[k]]),
                 "weight": float(w)} for k, w in weights.items() if w > 0]
    return {"datasets": datasets, **extra}


def zoo_sources() -> tuple[list[Any], list[float]]:
    """The zoo task's sources and weights: ``add`` and ``sub``, equal weights."""
    return ([GymSource("basic_arithmetic", "add", dict(_ARITHMETIC, operators=["+"])),
             GymSource("basic_arithmetic", "sub", dict(_ARITHMETIC, operators=["-"]))], [1.0, 1.0])


def default_task(seed: int = 0, test_size: int = 1000, train_size: int = 20000, reward: str = "score"):
    """The demo task: 2-digit addition and subtraction from reasoning-gym.

    Two terms, no parentheses, no negated operands; equal weights, so ``test_size=1000`` gives
    500 held-out problems per type. Train and test are disjoint by question.
    """
    sources, weights = zoo_sources()
    return Task(sources, weights, test_size=test_size, train_size=train_size, seed=seed, reward=reward)


SPLIT_SEED = 0
"""The zoo task's split seed for every build seed: a build seed varies a warm start's initialisation
and data order, never which problems are validation or test (a build on ``default_task(N)`` would
train on most of the seed-0 test questions that runs of the shipped zoo are evaluated on)."""


def build_task_for_seed(seed: int):
    """The task a zoo build of build seed ``seed`` trains on: :func:`default_task` on the fixed
    :data:`SPLIT_SEED` splits whatever ``seed`` is (``seed`` still seeds the build itself)."""
    del seed  # the splits never follow the build seed
    return default_task(SPLIT_SEED)


def format_prompt(question: str) -> str:
    """The zoo's prompt for ``question`` (:data:`PROMPT_TEMPLATE`)."""
    return PROMPT_TEMPLATE.format(question=question)
