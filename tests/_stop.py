"""Trainers that die right after the checkpoint of a given step, for exact-resume tests."""

from __future__ import annotations

from mutualrl.run.trainer import MutualTrainer


class _Stop(Exception):
    pass


class _StopAfterStep2(MutualTrainer):
    """Dies right after the checkpoint of step ``stop_after`` (2; as a crash there would)."""

    stop_after = 2

    def _step_done(self, step, rows, bar):
        super()._step_done(step, rows, bar)
        if step + 1 == self.stop_after:
            raise _Stop


class _StopAfterStep3(_StopAfterStep2):
    """Dies right after the checkpoint of step 3 (a second crash of a resumed run)."""

    stop_after = 3
