"""Progress of long work (training steps, zoo builds) that reads on a terminal and in a log.

On a terminal a rich progress bar is shown. When the output is not a terminal (redirected to a
file, CI, ``nohup``), a plain line is printed every ``every`` units instead:
``train 120/300 (40%) | gpt2-add r=0.31 acc=0.412 | elapsed 1:02 eta 1:33``.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Self


def _clock(seconds: float) -> str:
    s = int(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A progress display for ``total`` units of work starting at ``start``.

    Args:
        title: what is progressing (``train``, ``zoo gpt2-add``).
        enabled: show anything at all.
        every: in plain mode, print a line every this many units (and at the end).
        stream: where plain lines go (default stderr); rich is used only when it is a terminal.
    """

    def __init__(self, title: str, total: int, *, start: int = 0, enabled: bool = True, every: int | None = None,
                 stream: IO[str] | None = None) -> None:
        self.title = title
        self.total = max(1, int(total))
        self.start = start
        self.done = start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every = max(1, every or max(1, self.total // 20))
        self.note = ""
        self.info = ""
        self._t0 = time.perf_counter()
        self._last_line = start
        self._rich: Any = None
        self._task: Any = None

    @property
    def plain(self) -> bool:
        """True when lines are printed instead of a bar (the stream is not a terminal)."""
        isatty = getattr(self.stream, "isatty", None)
        return not (isatty and isatty())

    def __enter__(self) -> Self:
        if self.enabled and not self.plain:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                      console=Console(file=self.stream), transient=False)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.title, total=self.total, completed=self.start, info="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def _text(self) -> str:
        return " | ".join(x for x in (self.info, self.note) if x)

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before the first unit)."""
        n = self.done - self.start
        if n <= 0:
            return None
        return (time.perf_counter() - self._t0) / n * (self.total - self.done)

    def line(self) -> str:
        """The plain progress line for the current state."""
        pct = 100.0 * self.done / self.total
        eta = self.eta_s()
        tail = f"elapsed {_clock(time.perf_counter() - self._t0)}" + (f" eta {_clock(eta)}" if eta is not None else "")
        parts = [f"{self.title} {self.done}/{self.total} ({pct:.0f}%)", self._text(), tail]
        return " | ".join(p for p in parts if p)

    def update(self, done: int, info: str | None = None) -> None:
        """Set the units done (and the info text)."""
        self.done = done
        if info is not None:
            self.info = info
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=done, info=self._text())
        elif done - self._last_line >= self.every or done >= self.total:
            self._last_line = done
            print(self.line(), file=self.stream, flush=True)

    def finish(self, message: str) -> None:
        """Print a closing message (both modes)."""
        if not self.enabled:
            return
        text = f"{self.title}: {message} ({_clock(time.perf_counter() - self._t0)})"
        if self._rich is not None:
            self._rich.update(self._task, info=message)
            self._rich.console.print(text)
        else:
            print(text, file=self.stream, flush=True)


class StepProgress(Progress):
    """Training progress: step, mean train reward and last test accuracy per policy."""

    def __init__(self, total: int, start: int = 0, *, enabled: bool = True, names: list[str] | None = None,
                 description: str = "train", every: int | None = None, stream: IO[str] | None = None) -> None:
        super().__init__(description, total, start=start, enabled=enabled, every=every, stream=stream)
        self.names = names or []
        self._acc: dict[str, float] = {}
        self._reward: dict[str, float] = {}

    def _policies(self) -> str:
        parts = []
        for n in self.names:
            s = n
            if n in self._reward:
                s += f" r={self._reward[n]:.2f}"
            if n in self._acc:
                s += f" acc={self._acc[n]:.3f}"
            parts.append(s)
        return " | ".join(parts)

    def advance(self, rows: list[dict[str, Any]]) -> None:
        """One step finished; ``rows`` are its metric rows (one per policy)."""
        for r in rows:
            if "reward_mean" in r:
                self._reward[r["policy"]] = r["reward_mean"]
        self.update(self.done + 1, self._policies())

    def set_eval(self, rows: list[dict[str, Any]]) -> None:
        """An evaluation finished; show its accuracies."""
        for r in rows:
            acc = r.get("test_acc", r.get("val_acc"))  # the test figure when read (a run's last evaluation)
            if acc is not None:
                self._acc[r["policy"]] = acc
        self.info = self._policies()
        if self._rich is not None:
            self._rich.update(self._task, info=self._text())
