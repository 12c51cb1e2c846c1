"""reasoning-gym datasets as task sources (offline, procedural, seeded; their own verifiers)."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from mutualrl.tasks.base import Problem, problem_id


def available_datasets() -> list[str]:
    """Names of all registered reasoning-gym datasets."""
    from reasoning_gym import factory

    return sorted(factory.DATASETS)


def check_dataset(name: str, config: dict[str, Any]) -> str | None:
    """An error message if ``name``/``config`` is not a valid reasoning-gym dataset config."""
    from reasoning_gym import factory

    if name not in factory.DATASETS:
        close = difflib.get_close_matches(name, factory.DATASETS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else " (run `mutualrl tasks list`)"
        return f"unknown reasoning-gym dataset {name!r}{hint}"
    _, config_cls = factory.DATASETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = set(config) - fields
    if unknown:
        return f"unknown option(s) {sorted(unknown)} for dataset {name!r}; valid: {sorted(fields)}"
    try:
        cfg = config_cls(**config)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except (AssertionError, TypeError, ValueError) as exc:
        return f"invalid config for dataset {name!r}: {exc}"
    return None


class GymSource:
    """One reasoning-gym dataset with a fixed config, under a short name (e.g. ``add``)."""

    def __init__(self, dataset: str, name: str | None = None, config: dict[str, Any] | None = None) -> None:
        self.dataset = dataset
        self.name = name or dataset
        self.config = dict(config or {})
        # normalise lists to tuples (reasoning-gym configs use tuples for operators)
        for k, v in list(self.config.items()):
            if isinstance(v, list):
                self.config[k] = tuple(v)
        err = check_dataset(dataset, self.config)
        if err:
            raise ValueError(err)
        self._scorer = None

    def _make(self, seed: int, size: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **self.config)

    def generate(self, split: str, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` distinct problems (by question), deterministic in ``seed``."""
        ds = self._make(seed, max(n * 2, 16))
        if self._scorer is None:
            self._scorer = ds
        seen: set[str] = set()
        out: list[Problem] = []
        for i in range(len(ds)):
            entry = ds[i]
            q = entry["question"]
            if q in seen:
                continue
            seen.add(q)
            out.append(Problem(problem_id(self.name, q), q, str(entry["answer"]), self.name, entry))
            if len(out) >= n:
                break
        return out

    def score(self, problem: Problem, answer: str | None) -> float:
        if self._scorer is None:
            self._scorer = self._make(0, 1)
        try:
            return float(self._scorer.score_answer(answer, problem.entry))
        except Exception:  # noqa: BLE001 -- a verifier crash on odd text is a failed answer, not a crashed run
            return 0.0
