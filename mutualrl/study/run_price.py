"""The memory a study's running run is priced at, read from its metrics as they land.

Each step of a run reports, per policy, MWRA's predicted peak for that policy's worker
(``mem_predicted_peak_mb``, :mod:`mutualrl.allocation.memory`), the part of it held between phases
(``mem_predicted_resident_mb``), the worker's measured peak so far (``rss_peak_mb``) and its
processes (``worker_processes``: its ranks). The prediction covers an update that has not happened
yet (a policy whose first optimizer step comes late allocates its gradients and optimizer state only
then); the measurement covers what the prediction leaves out. A run's price is the larger of the two:

* under the sequential scheduler every policy lives in the run's one process, which holds every
  policy's resident bytes (one process's own overhead, :data:`PROCESS_BYTES`, once) and one
  policy's transient at a time (sampling and the updates take turns): the predicted sum of residents
  plus the largest predicted transient, or the measured process peak. A step that reports no resident
  figure (a run of an older revision) counts each policy's whole predicted peak, which is more;
* otherwise each policy's workers are processes of their own: the sum over policies of the larger of
  predicted and measured, times the policy's processes.

A run is unpriced until its first step's record lands (its step-0 evaluation comes before): a study
holds back another run until then (:meth:`mutualrl.study.Study.run`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutualrl.allocation.memory import PROCESS_BYTES

MIB = 2**20


@dataclass
class _Seen:
    """The largest of each figure one policy reported (bytes)."""

    peak: int = 0
    resident: int | None = None
    measured: int = 0
    processes: int = 1


def _figure(rec: dict[str, Any], key: str) -> int | None:
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return int(value * MIB)


@dataclass
class RunPrice:
    """A run's memory price, read incrementally from ``<run_dir>/metrics.jsonl`` (a file the run
    rewrites on resuming is read again from its start)."""

    run_dir: Path
    one_process: bool = True
    """Every policy in the run's own process (the sequential scheduler)."""
    _offset: int = 0
    _inode: int | None = None
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def bytes(self) -> int | None:
        """The run's price in bytes (module doc); None until its first step's record lands. A step that
        reports no memory figure prices its policy at 0 (nothing to go on: the study's reactive guard
        remains)."""
        self._read()
        if not self._seen:
            return None
        seen = list(self._seen.values())
        if not self.one_process:
            return sum(max(s.peak, s.measured) * s.processes for s in seen)
        predicted = 0
        known = [s for s in seen if s.peak]  # a policy the plan could not price is left to the measurement
        if known and all(s.resident is not None for s in known):
            predicted = sum(s.resident or 0 for s in known) + max(s.peak - (s.resident or 0) for s in known)
        elif known:
            predicted = sum(s.peak for s in known)
        predicted -= PROCESS_BYTES * max(0, len(known) - 1)  # one process: its own overhead once
        return max(predicted, max(s.measured for s in seen))

    def _read(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:  # rewritten (a resume): anew
                    self._inode, self._offset = st.st_ino, 0
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
            s = self._seen.setdefault(rec["policy"], _Seen())
            peak, resident = _figure(rec, "mem_predicted_peak_mb"), _figure(rec, "mem_predicted_resident_mb")
            measured, processes = _figure(rec, "rss_peak_mb"), rec.get("worker_processes")
            s.peak = max(s.peak, peak or 0)
            if resident is not None:
                s.resident = max(s.resident or 0, resident)
            s.measured = max(s.measured, measured or 0)
            if isinstance(processes, int) and not isinstance(processes, bool) and 1 <= processes <= 4096:
                s.processes = max(s.processes, processes)
