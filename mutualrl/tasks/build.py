"""The run's task from its config: the zoo preset or the listed datasets, with its reward rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mutualrl.tasks.base import Problem, Source, Task
from mutualrl.tasks.gym import GymSource
from mutualrl.tasks.hf import DatasetSource
from mutualrl.tasks.jsonl import FileSource
from mutualrl.tasks.rewards import load_reward_function

if TYPE_CHECKING:
    from mutualrl.config import DatasetConfig, TaskConfig


def build_task(t: TaskConfig, sources: list[Source] | None = None, *, run_seed: int | None = None) -> Task:
    """The :class:`Task` that ``t`` describes (a ``task:`` section of a run config); ``sources``:
    its datasets' sources when the caller built them already; ``run_seed``: the run's seed, the
    prompt stream's when ``t.prompt_seed`` is not set (without either: ``t.seed``).

    ``preset: zoo`` replaces only the datasets (the zoo's addition + subtraction); answer
    extraction, the reward mode and extra reward functions still apply.
    """
    if t.preset == "zoo":
        from mutualrl.zoo.task import zoo_sources

        sources, weights = zoo_sources()
    else:
        sources = sources if sources is not None else [build_source(d) for d in t.datasets]
        weights = [d.weight for d in t.datasets]
    return Task(sources, weights, test_size=t.test_size, train_size=t.train_size, seed=t.seed,
                answer_extraction=t.answer_extraction,
                reward_functions=[load_reward_function(p) for p in t.reward_functions],
                reward_timeout_s=t.reward_timeout_s, reward=t.reward, val_size=t.val_size,
                prompt_seed=t.prompt_seed if t.prompt_seed is not None else run_seed,
                heldout_seed=t.heldout_seed, val_like_test=t.val_like_test)


def build_source(d: DatasetConfig) -> Source:
    """The task source one ``task.datasets[i]`` entry describes (a ``SourceFieldError`` names the
    entry's field at fault)."""
    if d.name is not None:
        return GymSource(d.name, d.alias, d.config)
    if d.path is not None:
        return FileSource(d.path, d.alias, d.question_field, d.answer_field, d.test_fraction,
                          answer_extractor=d.answer_extractor, verifier=d.verifier)

    return DatasetSource(d.dataset, d.alias, split=d.split, test_split=d.test_split, question_field=d.question_field,
                         answer_field=d.answer_field, answer_extractor=d.answer_extractor, verifier=d.verifier,
                         test_fraction=d.test_fraction)


def eval_problems(task: Task, n: int, split: str = "test") -> list[Problem]:
    """The first problems of ``split`` (``test`` or ``val``) of each source in proportion to its
    weight (``n`` in total)."""
    pools = task.split(split)
    out: list[Problem] = []
    for src, w in zip(task.source_names, task.weights, strict=True):
        out.extend(pools[src][: max(1, round(n * w))])
    return out
