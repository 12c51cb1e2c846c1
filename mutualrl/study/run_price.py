"""The memory a study's running run is priced at, read from its metrics as they land.

Each step of a run reports, per policy, MWRA's predicted peak for that policy's worker
(``mem_predicted_peak_mb``, :mod:`mutualrl.allocation.memory`) and the process's measured peak so far
(``rss_peak_mb``). A run's price is the larger of the two, over its steps so far: the prediction
covers an update that has not happened yet (a policy whose first optimizer step comes late allocates
its gradients and optimizer state only then), the measurement what the prediction leaves out. Every
policy of a run under the sequential scheduler lives in one process: its price is the largest of its
policies'; a run whose policies have processes of their own is priced at their sum.

A run is unpriced until its first step's record lands (its step-0 evaluation comes before): a study
holds back another run until then (:meth:`mutualrl.study.Study.run`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
MEMORY_KEYS = ("mem_predicted_peak_mb", "rss_peak_mb")
"""The step metrics a run's price is taken from (MiB)."""


@dataclass
class RunPrice:
    """A run's memory price, read incrementally from ``<run_dir>/metrics.jsonl``."""

    run_dir: Path
    one_process: bool = True
    """Every policy in the run's own process (the sequential scheduler): the largest policy's price,
    else their sum."""
    _offset: int = 0
    _per_policy: dict[str, int] = field(default_factory=dict)

    def bytes(self) -> int | None:
        """The run's price in bytes; None until its first step's record lands. A step that reports no
        memory figure prices its policy at 0 (nothing to go on: the study's reactive guard remains)."""
        self._read()
        if not self._per_policy:
            return None
        values = self._per_policy.values()
        return max(values) if self.one_process else sum(values)

    def _read(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or "event" in rec or not isinstance(rec.get("policy"), str) \
                    or "step" not in rec:
                continue
            seen = [float(rec[k]) * MIB for k in MEMORY_KEYS
                    if isinstance(rec.get(k), (int, float)) and math.isfinite(rec[k]) and rec[k] >= 0]
            policy = rec["policy"]
            self._per_policy[policy] = max(self._per_policy.get(policy, 0), int(max(seen, default=0)))
