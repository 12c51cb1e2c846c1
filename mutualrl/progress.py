"""A progress bar for training steps (rich), quiet when disabled or not a terminal."""

from __future__ import annotations

from typing import Any


class StepProgress:
    """Shows step, mean train reward and last test accuracy per policy."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, names: list[str] | None = None,
                 description: str = "train") -> None:
        self.total = total
        self.start = start
        self.enabled = enabled
        self.names = names or []
        self.description = description
        self._acc: dict[str, float] = {}
        self._reward: dict[str, float] = {}
        self._progress = None
        self._task = None

    def __enter__(self) -> StepProgress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                      transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.start, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def _info(self) -> str:
        parts = []
        for n in self.names:
            r = self._reward.get(n)
            a = self._acc.get(n)
            s = n
            if r is not None:
                s += f" r={r:.2f}"
            if a is not None:
                s += f" acc={a:.3f}"
            parts.append(s)
        return " | ".join(parts)

    def advance(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            if "reward_mean" in r:
                self._reward[r["policy"]] = r["reward_mean"]
        if self._progress is not None:
            self._progress.update(self._task, advance=1, info=self._info())

    def set_eval(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self._acc[r["policy"]] = r["test_acc"]
        if self._progress is not None:
            self._progress.update(self._task, info=self._info())
