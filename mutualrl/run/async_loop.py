"""The ``sync: async`` step loop: bounded staleness instead of per-phase barriers (MWRA).

Each policy walks its own lane: rollout(s) -> update(s) -> rollout(s+1) ... It may start step ``s``
while the slowest policy has finished ``lo`` steps only if ``s - lo <= sharing.max_staleness``; its
queries ignore peer rows older than that. When the strategy shares, a policy's update of step ``s``
waits until every peer has published its rollouts of step ``s`` (a stalled peer fails the run after
``step_timeout_s``), so sharing stays two-way and independent of timing: what a faster policy gains
is that its next rollout overlaps a slower peer's update. Evaluation and checkpoint steps are
barriers (nobody starts one before everyone reached it), so checkpoints stay exact. A step is
*settled* (logged, checkpointed when due) once every policy finished it.

A lane's states (:class:`Phase`)::

    IDLE --start--> ROLLOUT --rolled out--> WAIT --peers rolled out--> UPDATE --updated--> IDLE (next step)

A strategy that serves its peers (``distill``'s scores) adds a phase between: once every peer has
rolled out the step, a lane serves (SERVE), then waits until every peer has served it (SERVED)::

    WAIT --peers rolled out--> SERVE --served--> SERVED --peers served--> UPDATE
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mutualrl.algorithms.sharing import parse_strategy
from mutualrl.allocation.base import Scheduler
from mutualrl.config import RunConfig
from mutualrl.run.worker_api import WorkerAPI

Row = dict[str, Any]


class Phase(Enum):
    """Where a policy's lane is within its current step."""

    IDLE = "idle"
    """Between steps: it may start its next rollout once staleness and barriers allow."""
    ROLLOUT = "rollout"
    """Its rollout is submitted."""
    WAIT = "wait"
    """Rolled out; its update waits for every peer's rollouts of the same step (when sharing)."""
    SERVE = "serve"
    """Its work for the peers (scoring their samples) is submitted."""
    SERVED = "served"
    """Served; its update waits for every peer's service of the same step."""
    UPDATE = "update"
    """Its update is submitted."""


@dataclass
class Lane:
    """One policy's way through the run."""

    index: int
    name: str
    done: int
    """Steps it has finished; also the step it works on now."""
    phase: Phase = Phase.IDLE
    started: float = 0.0
    """``perf_counter`` when its current step's rollout was submitted."""
    rollout: Row = field(default_factory=dict)
    """Its current step's rollout result (from ROLLOUT until the step is finished)."""
    rollout_s: float = 0.0
    """Seconds its current step's rollout took."""

    @property
    def busy(self) -> bool:
        """A call of it is in flight."""
        return self.phase in (Phase.ROLLOUT, Phase.SERVE, Phase.UPDATE)


@dataclass
class AsyncLoop:
    """The async loop's state and its transitions; :meth:`run` drives it to the last step.

    Args:
        scheduler: submits calls and collects the next finished one.
        steps, eval_every, checkpoint_every, max_staleness, step_timeout_s: the run's settings.
        wait_for_peers: an update waits for every peer's rollouts of its step (the strategy shares).
        lanes: one per policy, in policy order.
        settled: steps every policy has finished and that were handed to ``step_done``.
        observe: ``(policy index, "rollout" | "update", result)`` for every collected result.
        step_done: ``(step, rows)`` once every policy finished ``step`` (one row per policy, in order).
        evaluate: ``(step)`` when an evaluation is due before ``step``.
    """

    scheduler: Scheduler
    steps: int
    eval_every: int
    checkpoint_every: int
    max_staleness: int
    step_timeout_s: float
    wait_for_peers: bool
    lanes: list[Lane]
    settled: int
    observe: Callable[[int, str, Any], None]
    step_done: Callable[[int, list[Row]], None]
    evaluate: Callable[[int], None]
    serves: bool = False
    """Every lane serves its peers between its peers' rollouts and its update (the strategy serves)."""
    rolled: dict[int, set[int]] = field(default_factory=dict)
    """Per step not yet settled: the policies that have rolled it out."""
    served: dict[int, set[int]] = field(default_factory=dict)
    """Per step not yet settled: the policies that have served it."""
    finished: dict[int, dict[int, Row]] = field(default_factory=dict)
    """Per step not yet settled: the metric rows of the policies that finished it."""

    @classmethod
    def for_run(cls, cfg: RunConfig, scheduler: Scheduler, start_step: int, *,
                observe: Callable[[int, str, Any], None], step_done: Callable[[int, list[Row]], None],
                evaluate: Callable[[int], None]) -> AsyncLoop:
        """The loop of ``cfg``'s policies from ``start_step`` on."""
        return cls(scheduler, cfg.steps, cfg.eval_every, cfg.checkpoint_every, cfg.sharing.max_staleness,
                   cfg.step_timeout_s, parse_strategy(cfg.sharing.strategy).shares,
                   [Lane(i, p.name, start_step) for i, p in enumerate(cfg.policies)], start_step,
                   observe, step_done, evaluate, serves=parse_strategy(cfg.sharing.strategy).serves)

    # ------------------------------------------------------------------ driving
    def run(self) -> None:
        """Evaluate when due, then start, collect and settle until every lane has done every step."""
        self._evaluate_when_due()
        while True:
            self._start_rollouts()
            if not any(lane.busy for lane in self.lanes):
                return
            index, result = self.scheduler.collect(self.step_timeout_s)
            lane = self.lanes[index]
            self.observe(index, lane.phase.value, result)
            now = time.perf_counter()
            if lane.phase is Phase.ROLLOUT:
                self._rolled_out(lane, result, now)
            elif lane.phase is Phase.SERVE:
                self._served(lane, result)
            else:
                self._updated(lane, result, now)
                self._settle()

    def _slowest(self) -> int:
        return min(lane.done for lane in self.lanes)

    def _barrier(self, step: int) -> bool:
        """Nobody starts an evaluation or checkpoint step before everyone reached it."""
        return step % self.eval_every == 0 or step % self.checkpoint_every == 0

    def _may_start(self, lane: Lane, lo: int) -> bool:
        s = lane.done
        return (lane.phase is Phase.IDLE and s < self.steps and s - lo <= self.max_staleness
                and not (s > lo and self._barrier(s)))

    # ------------------------------------------------------------------ transitions
    def _start_rollouts(self) -> None:
        """IDLE -> ROLLOUT for every lane that staleness and barriers let start its next step."""
        lo = self._slowest()
        for lane in self.lanes:
            if self._may_start(lane, lo):
                lane.started = time.perf_counter()
                lane.phase = Phase.ROLLOUT
                self.scheduler.submit(lane.index, WorkerAPI.rollout, lane.done)

    def _rolled_out(self, lane: Lane, result: Row, now: float) -> None:
        """ROLLOUT -> WAIT; then every waiting lane whose peers have all rolled out its step updates."""
        lane.rollout, lane.rollout_s = result, now - lane.started
        self.rolled.setdefault(lane.done, set()).add(lane.index)
        lane.phase = Phase.WAIT
        self._start_updates()

    def _start_updates(self) -> None:
        """WAIT -> UPDATE (or SERVE, when the strategy serves) where the lane need not, or need no
        longer, wait for its peers' rollouts; SERVED -> UPDATE once every peer has served the step."""
        everyone = len(self.lanes)
        for lane in self.lanes:
            if lane.phase is Phase.WAIT and (not self.wait_for_peers or len(self.rolled.get(lane.done, ())) == everyone):
                lane.phase = Phase.SERVE if self.serves else Phase.UPDATE
                self.scheduler.submit(lane.index, WorkerAPI.serve if self.serves else WorkerAPI.update, lane.done)
            elif lane.phase is Phase.SERVED and len(self.served.get(lane.done, ())) == everyone:
                lane.phase = Phase.UPDATE
                self.scheduler.submit(lane.index, WorkerAPI.update, lane.done)

    def _served(self, lane: Lane, result: Row) -> None:
        """SERVE -> SERVED; its metrics join the step's row; then updates whose peers all served start."""
        lane.rollout = {**lane.rollout, **result}
        self.served.setdefault(lane.done, set()).add(lane.index)
        lane.phase = Phase.SERVED
        self._start_updates()

    def _updated(self, lane: Lane, result: Row, now: float) -> None:
        """UPDATE -> IDLE at the next step; the finished step's row waits for the step to settle."""
        s = lane.done
        self.finished.setdefault(s, {})[lane.index] = {
            "step": s, "policy": lane.name, **lane.rollout, **result, "step_rollout_s": lane.rollout_s,
            "step_update_s": now - lane.started - lane.rollout_s, "step_s": now - lane.started,
            "ahead": s - self._slowest()}
        lane.rollout, lane.rollout_s = {}, 0.0
        lane.phase = Phase.IDLE
        lane.done += 1

    def _settle(self) -> None:
        """Hand on every step all lanes have finished, evaluating after it when due."""
        while self.settled < self._slowest():
            s = self.settled
            self.step_done(s, [self.finished[s][j] for j in range(len(self.lanes))])
            del self.finished[s]
            self.rolled.pop(s, None)
            self.served.pop(s, None)
            self.settled += 1
            self._evaluate_when_due()

    def _evaluate_when_due(self) -> None:
        if self.settled < self.steps and self.settled % self.eval_every == 0:
            self.evaluate(self.settled)
