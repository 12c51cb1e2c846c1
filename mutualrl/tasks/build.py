"""The run's task from its config: the zoo preset or the listed datasets, with its reward rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mutualrl.tasks.base import Problem, Task

if TYPE_CHECKING:
    from mutualrl.config import TaskConfig


def build_task(t: TaskConfig) -> Task:
    """The :class:`Task` that ``t`` describes (a ``task:`` section of a run config).

    ``preset: zoo`` replaces only the datasets (the zoo's addition + subtraction); answer
    extraction, the reward mode and extra reward functions still apply.
    """
    from mutualrl.tasks.gym import GymSource
    from mutualrl.tasks.jsonl import FileSource
    from mutualrl.tasks.rewards import load_reward_function

    if t.preset == "zoo":
        from mutualrl.zoo.task import zoo_sources

        sources, weights = zoo_sources()
    else:
        sources, weights = [], []
        for d in t.datasets:
            if d.name is not None:
                sources.append(GymSource(d.name, d.alias, d.config))
            else:
                sources.append(FileSource(d.path, d.alias, d.question_field, d.answer_field, d.test_fraction))
            weights.append(d.weight)
    return Task(sources, weights, test_size=t.test_size, train_size=t.train_size, seed=t.seed,
                answer_extraction=t.answer_extraction,
                reward_functions=[load_reward_function(p) for p in t.reward_functions],
                reward_timeout_s=t.reward_timeout_s, reward=t.reward)


def eval_problems(task: Task, n: int) -> list[Problem]:
    """The first test problems of each source in proportion to its weight (``n`` in total)."""
    out: list[Problem] = []
    for src, w in zip(task.source_names, task.weights, strict=True):
        out.extend(task.test[src][: max(1, round(n * w))])
    return out
