"""Progress of long work (training steps, zoo builds) that reads on a terminal and in a log.

On a terminal a rich progress bar is shown. When the output is not a terminal (redirected to a
file, CI, ``nohup``), a plain line is printed every ``every`` units instead:
``train 120/300 (40%) | gpt2-add r=0.31 acc=0.412 | elapsed 1:02 eta 1:33``.

The count never passes the total: work that runs past its planned total turns the display
open-ended (``zoo x 4293 (past the planned 4000) | ... | elapsed 16:02``: no share, no ETA), and no
ETA is shown once the count has reached the total, nor an ETA under one second while work is left.
Work in stretches of their own (the phases of a zoo build) starts each with :meth:`Progress.begin`:
its own total, count, clock and so its own rate. With ``bound=True`` the total is a cap that the
work may stop short of (a zoo phase ends when its skills reach their goal): the ETA reads
``eta ≤1:33``, the time to the cap at the stretch's rate.
"""

from __future__ import annotations

import math
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
        bound: the total is a cap the work may stop short of (the ETA is printed as an upper bound).
    """

    def __init__(self, title: str, total: int, *, start: int = 0, enabled: bool = True, every: int | None = None,
                 stream: IO[str] | None = None, bound: bool = False) -> None:
        self.title = title
        self.total = max(1, int(total))
        self.start = start
        self.done = start
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.every = max(1, every or max(1, self.total // 20))
        self.note = ""
        self.info = ""
        self.bound = bound
        self.open_ended = False
        """True once the work went past ``total``: the count is shown without a share or an ETA."""
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
        """Seconds left at the rate so far: None before the first unit, once the count reached the
        total, and when the work went past it (then nothing honest can be said)."""
        n = self.done - self.start
        if n <= 0 or self.open_ended or self.done >= self.total:
            return None
        return (time.perf_counter() - self._t0) / n * (self.total - self.done)

    def line(self) -> str:
        """The plain progress line for the current state."""
        eta = self.eta_s()
        tail = f"elapsed {_clock(time.perf_counter() - self._t0)}"
        if eta is not None:  # rounded up: work that is left never reads 0:00
            tail += f" eta {'≤' if self.bound else ''}{_clock(max(1, math.ceil(eta)))}"
        count = (f"{self.title} {self.done} (past the planned {self.total})" if self.open_ended else
                 f"{self.title} {self.done}/{self.total} ({100.0 * self.done / self.total:.0f}%)")
        return " | ".join(p for p in (count, self._text(), tail) if p)

    def begin(self, title: str, total: int) -> None:
        """Start a new stretch of work (a phase): ``total`` units under ``title``, its count and clock
        from zero, so its share and ETA follow its own rate. On a terminal the last stretch's bar
        stays, closed at the count it reached (a stretch that counted nothing is reused)."""
        fresh = self.done == self.start
        if self._rich is not None and self._task is not None and not fresh:
            self._rich.update(self._task, total=max(1, self.done), completed=self.done)
        self.title, self.total, self.start, self.done = title, max(1, int(total)), 0, 0
        self.open_ended, self._last_line, self._t0 = False, 0, time.perf_counter()
        if self._rich is not None and self._task is not None and fresh:
            self._rich.reset(self._task, total=self.total, completed=0, description=title, info=self._text())
        elif self._rich is not None:
            self._task = self._rich.add_task(title, total=self.total, completed=0, info=self._text())

    def update(self, done: int, info: str | None = None) -> None:
        """Set the units done (and the info text). A count past the total makes the display
        open-ended instead of counting past it."""
        self.done = done
        if info is not None:
            self.info = info
        if done > self.total and not self.open_ended:
            self.open_ended = True
            if self._rich is not None:  # an indeterminate bar: no total, no share, no ETA
                self._rich.update(self._task, visible=False)
                self._task = self._rich.add_task(f"{self.title} (past the planned {self.total})", total=None,
                                                 completed=done, info=self._text())
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=done, info=self._text())
        elif done - self._last_line >= self.every or (done == self.total and not self.open_ended):
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
