"""A trainer that dies right after the checkpoint of step 2, for exact-resume tests."""

from __future__ import annotations

from mutualrl.trainer import MutualTrainer


class _Stop(Exception):
    pass


class _StopAfterStep2(MutualTrainer):
    """Dies right after the checkpoint of step 2 (as a crash there would)."""

    def _step_done(self, step, rows, bar):
        super()._step_done(step, rows, bar)
        if step + 1 == 2:
            raise _Stop
