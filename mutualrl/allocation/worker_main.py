"""The loop of one policy worker process (started by :class:`~mutualrl.allocation.local.LocalScheduler`).

Protocol: one JSON object per line. The controller writes ``{"id": n, "method": name, "args": [...]}``
to the process's stdin; the worker answers on its stdout with ``{"id": n, "ok": true, "result": ...}``
(plus ``wall_s`` and ``cpu_s``, the call's wall time and the CPU time of all the process's threads)
or ``{"id": n, "ok": false, "error": "...", "traceback": "..."}``. Nothing is pickled. Special
methods: ``__init__`` (the placed :class:`~mutualrl.config.resolve.RunPlan` as a dict, policy index, run_dir,
rank) creates the
:class:`~mutualrl.run.worker.PolicyWorker`; ``__nice__`` changes the CPU priority of all its threads;
``__exit__`` ends the loop. Anything the libraries print goes to stderr (the worker's log), so the
protocol stream stays clean. The worker exits when its stdin closes, or at once, mid-call, when its
controller process is gone (killed with ``kill -9``, say).

Run as ``python -m mutualrl.allocation.worker_main [--parent PID]``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from mutualrl.run.orphan import exit_when_orphaned
from mutualrl.run.worker_api import remote_name


def set_nice(level: int) -> int:
    """Set the nice level of every thread of this process (Linux); returns the level now in force."""
    level = max(-20, min(19, int(level)))
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, level)
        except (PermissionError, ProcessLookupError):  # lowering needs privileges; threads may end
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


class _Loop:
    def __init__(self) -> None:
        self.worker: Any = None

    def init(self, plan: dict[str, Any], index: int, run_dir: str | None, rank: int = 0) -> dict[str, Any]:
        import torch

        from mutualrl.config.resolve import RunPlan
        from mutualrl.run.worker import PolicyWorker

        run_plan = RunPlan.from_dict(plan)  # resolved and placed by the controller: nothing is decided here
        spec = run_plan.spec(index, rank)
        if spec.nice:
            set_nice(spec.nice)  # before torch starts its pool, so the pool threads inherit it
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set
            pass
        self.worker = PolicyWorker(run_plan, index, run_dir, rank=rank)
        return self.worker.info() | {"threads": torch.get_num_threads(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}

    def dispatch(self, method: str, args: list[Any]) -> Any:
        if method == "__init__":
            return self.init(*args)
        if method == "__nice__":
            return set_nice(*args)
        if self.worker is None:
            raise RuntimeError(f"{method}() before __init__")

        return getattr(self.worker, remote_name(method))(*args)


def main(argv: list[str] | None = None) -> int:
    """Serve requests from stdin until ``__exit__`` or end of input; exit once the controller is gone
    (``--parent PID``, default the parent now: :func:`~mutualrl.run.orphan.exit_when_orphaned`), even in
    the middle of a call, where the end of stdin would not be read."""
    args = sys.argv[1:] if argv is None else argv
    parent = int(args[args.index("--parent") + 1]) if "--parent" in args else os.getppid()
    exit_when_orphaned(parent)
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # stray prints from libraries go to the log, not into the protocol
    sys.stdout = sys.stderr
    loop = _Loop()
    for line in sys.stdin:
        if not line.strip():
            continue
        mid = None
        try:
            msg = json.loads(line)
            mid = msg.get("id")
            method = msg["method"]
            if method == "__exit__":
                proto.write(json.dumps({"id": mid, "ok": True, "result": None}) + "\n")
                break
            t0, c0 = time.perf_counter(), time.process_time()
            result = loop.dispatch(method, list(msg.get("args", [])))
            reply = {"id": mid, "ok": True, "result": result, "wall_s": time.perf_counter() - t0,
                     "cpu_s": time.process_time() - c0}
        except Exception as exc:  # noqa: BLE001 - every error goes back to the controller
            reply = {"id": mid, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()}
            print(reply["traceback"], file=sys.stderr, flush=True)
        try:
            text = json.dumps(reply)
        except (TypeError, ValueError) as exc:
            text = json.dumps({"id": mid, "ok": False, "error": f"result is not JSON-able: {exc}"})
        proto.write(text + "\n")
    if loop.worker is not None:
        loop.worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
