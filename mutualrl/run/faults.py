"""Fault injection and acknowledgement logging for crash tests (inert unless enabled by env vars).

* ``MUTUALRL_FAULT_POINT=<name>:<n>`` makes the process ``SIGKILL`` itself the ``n``-th time
  (1-based) it reaches the named point. Points: ``rollout`` (inside a worker's rollout, after
  generation, before publishing), ``publish`` (inside the exchange's write transaction, before
  it commits), ``published`` (just after a publish was acknowledged), ``update`` (inside a
  worker's update, before the optimizer step), ``checkpoint_write`` (a checkpoint half written),
  ``checkpoint_commit`` (a checkpoint renamed into place, ``LATEST`` not yet updated).
* ``MUTUALRL_ACK_LOG=<file>`` appends one JSON line per acknowledged publish
  (``{"policy", "step", "ids"}``), fsynced before the worker goes on, so a test knows exactly
  which records the exchange promised to keep.

* ``MUTUALRL_FAULT_WORKER=<label>`` limits the fault to the worker process of that label (the
  policy's name, or ``"<policy> rank <r>"`` for one rank of a policy on several workers).
* ``MUTUALRL_FAULT_ACTION=hang`` makes the process stop answering at the point (sleep forever)
  instead of killing itself: a hung worker, for the timeouts.

Both are read once per process; with neither set every call here is a cheap no-op.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable

POINTS: tuple[str, ...] = ("rollout", "publish", "published", "update", "checkpoint_write", "checkpoint_commit")
"""Names accepted in ``MUTUALRL_FAULT_POINT``."""

_HITS: Counter[str] = Counter()
_LOCK = threading.Lock()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("MUTUALRL_FAULT_POINT", "").strip()
    if not spec:
        return None
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"MUTUALRL_FAULT_POINT: unknown point {name!r}; known: {', '.join(POINTS)}")
    try:
        count = int(n or "1")
    except ValueError:
        raise ValueError(f"MUTUALRL_FAULT_POINT={spec!r}: the count after ':' must be an integer") from None
    return name, count


def fault_point(name: str) -> None:
    """Mark a named point; ``SIGKILL`` this process if ``MUTUALRL_FAULT_POINT`` selects this hit."""
    target = _target()
    if target is None or target[0] != name:
        return
    only = os.environ.get("MUTUALRL_FAULT_WORKER")
    if only and os.environ.get("MUTUALRL_WORKER") != only:
        return
    with _LOCK:
        _HITS[name] += 1
        hit = _HITS[name]
    if hit == target[1]:
        if os.environ.get("MUTUALRL_FAULT_ACTION") == "hang":
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


def log_acknowledged(policy: str, step: int, record_ids: Iterable[str]) -> None:
    """Append the ids of an acknowledged publish to ``MUTUALRL_ACK_LOG`` (durably), if set."""
    path = os.environ.get("MUTUALRL_ACK_LOG")
    if not path:
        return
    line = json.dumps({"policy": policy, "step": int(step), "ids": list(record_ids)}) + "\n"
    with _LOCK, open(path, "a", encoding="utf-8") as fh:
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())
