"""LocalScheduler: one OS process per policy worker on this machine, JSON lines over pipes.

Each worker is ``python -m mutualrl.allocation.worker_main`` with its torch threads (and CPU
priority) from the MWRA plan. Requests to all workers are written first and the replies gathered
afterwards, so the workers compute concurrently; every call has a deadline
(``cfg.step_timeout_s``): a worker that exits, closes its pipe, raises or does not answer in
time raises :class:`~mutualrl.allocation.base.WorkerFailed` naming it (a hung process is killed).
Only JSON crosses the process boundary: the config as a dict, method names, step numbers and
metric dicts.

A policy with ``workers: N`` gets N processes, its ranks (:mod:`mutualrl.allocation.ranks`): a call
on the policy goes to all of them, their replies are merged into one, and they meet through a
``TCPStore`` this scheduler serves on the loopback interface (:mod:`mutualrl.run.distributed`). A rank
that dies or hangs fails the call naming the policy and the rank.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mutualrl.allocation.base import Scheduler, Venue, WorkerFailed, require_placed
from mutualrl.allocation.gpu_memory import allocator_env
from mutualrl.allocation.planner import Allocation, Resources
from mutualrl.allocation.ranks import PendingReplies, RankLayout, merge_replies
from mutualrl.config import RunConfig
from mutualrl.config.resolve import RunPlan
from mutualrl.run.distributed import lagging_rank, serve_store
from mutualrl.run.worker_api import WorkerAPI


def child_visible_devices(gpu: int, parent: str | None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of a worker process given GPU ``gpu`` as this process counts
    GPUs (its ``cuda:<gpu>``), where this process runs under ``parent`` (its own
    ``CUDA_VISIBLE_DEVICES``; ``None``: unset). Unset, the index is CUDA's own; set, this process's
    ``cuda:<gpu>`` is entry ``gpu`` of the parent's list (``2,3``; GPU UUIDs ``GPU-...``; MIG ids
    ``MIG-...``), which the child is given as it is.

    Raises:
        ValueError: ``gpu`` is not an entry of the parent's list (or the list is empty).
    """
    if gpu < 0:
        raise ValueError(f"a GPU index is >= 0, got {gpu}")
    if parent is None:
        return str(gpu)
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    if gpu >= len(entries):
        raise ValueError(f"GPU {gpu} asked for, but this process sees {len(entries)} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={parent!r}): the plan and the visible devices disagree")
    return entries[gpu]


@dataclass
class _Proc:
    index: int
    """The worker's position in the plan (one per rank)."""
    name: str
    """The policy's name, with the rank when it has several (what errors name)."""
    popen: subprocess.Popen
    log_path: Path
    log: IO[bytes]
    buf: bytes = b""
    next_id: int = 0
    inflight: tuple[int, str, float] | None = None
    """(request id, method, deadline) of the call in flight."""
    replies: list[dict[str, Any]] = field(default_factory=list)


def log_tail(path: Path, n_bytes: int = 1500) -> str:
    """The last bytes of a worker's log, for error messages."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_bytes))
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


class LocalScheduler(Scheduler):
    """One subprocess per policy worker; concurrent calls with a per-call timeout.

    Args:
        threads: torch threads per worker (default: the MWRA plan decides).
        resources: the resources to plan for (default: this machine).
        allocation: use this plan as is (no planning, no re-planning).
        replan_threshold: re-plan when calibrated busy times differ by more than this factor.
        verbose: print the plan (and re-plans) to stderr.
        start_timeout_s: deadline for starting the workers (at least ``step_timeout_s``).
    """

    name = "local"

    def __init__(self, threads: int | None = None, *, resources: Resources | None = None,
                 allocation: Allocation | None = None, replan_threshold: float = 1.25,
                 verbose: bool = True, start_timeout_s: float = 300.0) -> None:
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.resources = resources
        self.fixed_allocation = allocation
        self.replan_threshold = replan_threshold
        self.verbose = verbose
        self.procs: list[_Proc] = []
        self.plan: RunPlan | None = None
        """The placed plan being realised."""
        self.timeout = 600.0
        self.run_dir: Path | None = None
        self._scratch: Path | None = None
        self._last_method: dict[int, str] = {}
        self.last_cpu_s: dict[int, float | None] = {}
        """CPU time (all threads) of each worker process's last call, as the worker measured it."""
        self.last_wall_s: dict[int, float | None] = {}
        self.layout = RankLayout([])
        self._pending: PendingReplies | None = None
        self._store: object | None = None
        self._policy_names: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def open(self, cfg: RunConfig, run_dir: Path | None) -> Venue:
        """A scratch directory (the exchange file of a run without a directory) and, when a policy has
        several ranks, the store where they meet; this machine's resources (or the given ones)."""
        self.run_dir = Path(run_dir) if run_dir is not None else None
        # starting (imports, model load) may take longer than a step on a busy machine
        self.timeout = max(float(cfg.step_timeout_s), self.start_timeout_s)
        self._scratch = Path(tempfile.mkdtemp(prefix="mutualrl-local-"))
        rendezvous = None
        if any(p.workers != 1 for p in cfg.policies):  # the ranks of a policy meet here
            store = serve_store("127.0.0.1", self.timeout)
            self._store, rendezvous = store, f"tcp://127.0.0.1:{store.port}"
        return Venue("local", self.resources or Resources.detect(), self._scratch, rendezvous, movable=True)

    def start(self, plan: RunPlan, run_dir: Path | None) -> list[dict[str, Any]]:
        require_placed(plan, self.name)
        cfg = plan.config
        if self._scratch is None:
            raise ValueError("LocalScheduler.start before open(): start it with run_placement.launch")
        self.plan = plan
        self.layout = RankLayout.of(plan)
        self._policy_names = [p.name for p in cfg.policies]
        self._pending = PendingReplies(self.layout)
        logs = (self.run_dir / "logs") if self.run_dir is not None else self._scratch
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for pos, spec in enumerate(plan.workers):
                rank = f"-rank{spec.rank}" if spec.world > 1 else ""
                self.procs.append(self._spawn(pos, spec.label, spec.threads or 1,
                                              logs / f"worker-{spec.index}-{spec.name}{rank}.log", spec.visible_gpu,
                                              cfg.policies[spec.index].generation.engine))
            for p, spec in zip(self.procs, plan.workers, strict=True):
                self._send(p, "__init__", [plan.to_dict(), spec.index, str(self.run_dir) if self.run_dir else None,
                                           spec.rank])
            infos = self.layout.merge("info", self._gather(list(range(len(self.procs)))))
            self.timeout = float(cfg.step_timeout_s)
        except BaseException:
            self.close()
            raise
        return infos

    def _spawn(self, index: int, name: str, threads: int, log_path: Path, gpu: int | None = None,
               engine: str = "hf") -> _Proc:
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                    "OPENBLAS_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1", "MUTUALRL_WORKER": name})
        if gpu is not None:  # the parent's cuda:<gpu>, through its own CUDA_VISIBLE_DEVICES where it has one
            env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
            env.update(allocator_env(os.environ, engine))
        # idle OpenMP threads sleep instead of spinning: workers share cores with each other
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        log = open(log_path, "ab")  # noqa: SIM115 - the worker writes it for its whole life; closed in close()
        cmd = [sys.executable, "-m", "mutualrl.allocation.worker_main", "--parent", str(os.getpid())]
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                 close_fds=True)
        os.set_blocking(popen.stdout.fileno(), False)  # type: ignore[union-attr]
        return _Proc(index, name, popen, log_path, log)

    def close(self) -> None:
        """Ask every worker to exit, then stop what is left (idempotent)."""
        procs, self.procs = self.procs, []
        for p in procs:
            if p.popen.poll() is None and p.inflight is None:
                try:
                    self._send(p, "__exit__", [])
                except WorkerFailed:
                    pass
        deadline = time.monotonic() + 10.0
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()) if p.inflight is None else 0.1)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            for fh in (p.popen.stdin, p.popen.stdout, p.log):
                try:
                    fh.close()  # type: ignore[union-attr]
                except (OSError, AttributeError):
                    pass
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        self._store = None

    # ------------------------------------------------------------------ calls
    def _call(self, method: str, *args: Any) -> list[Any]:
        for p in self.procs:
            self._send(p, method, list(args))
        return self.layout.merge(method, self._gather(list(range(len(self.procs)))))

    def _call_one(self, index: int, method: str, *args: Any) -> Any:
        ranks = self.layout.members[index]
        for w in ranks:
            self._send(self.procs[w], method, list(args))
        return merge_replies(method, self._gather(ranks))

    def _submit(self, index: int, method: str, *args: Any) -> None:
        for w in self.layout.members[index]:
            self._send(self.procs[w], method, list(args))

    def collect(self, timeout: float) -> tuple[int, Any]:
        assert self._pending is not None
        while True:
            busy = [p.index for p in self.procs if p.inflight is not None]
            if not busy:
                raise WorkerFailed("?", "collect() called with no call in flight")
            deadline = min(time.monotonic() + timeout, *(self.procs[i].inflight[2] for i in busy))  # type: ignore[index]
            worker, result = self._next_reply(busy, deadline)
            index = self._pending.add(worker, result)
            if index is None:
                continue  # another rank of the policy is still at it
            method = self._last_method.get(worker, "")
            return index, self._pending.pop(index, method)

    # ------------------------------------------------------------------ plumbing
    def _send(self, p: _Proc, method: str, args: list[Any]) -> None:
        if p.inflight is not None:
            raise WorkerFailed(p.name, f"{method}() sent while {p.inflight[1]}() is still running")
        p.next_id += 1
        line = json.dumps({"id": p.next_id, "method": method, "args": args}) + "\n"
        try:
            p.popen.stdin.write(line.encode("utf-8"))  # type: ignore[union-attr]
            p.popen.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError, ValueError):
            raise WorkerFailed(p.name, self._death(p, method)) from None
        p.inflight = (p.next_id, method, time.monotonic() + self.timeout)
        self._last_method[p.index] = method

    def _gather(self, indices: list[int]) -> list[Any]:
        out: dict[int, Any] = {}
        pending = list(indices)
        while pending:
            deadline = min(self.procs[i].inflight[2] for i in pending)  # type: ignore[index]
            i, result = self._next_reply(pending, deadline)
            out[i] = result
            pending.remove(i)
        return [out[i] for i in indices]

    def _next_reply(self, indices: list[int], deadline: float) -> tuple[int, Any]:
        """The next reply among workers ``indices`` (raising WorkerFailed on death/error/timeout)."""
        procs = [self.procs[i] for i in indices]
        for p in procs:  # a reply may already be buffered
            if p.replies:
                return p.index, self._unwrap(p, p.replies.pop(0))
        sel = selectors.DefaultSelector()
        try:
            for p in procs:
                sel.register(p.popen.stdout, selectors.EVENT_READ, p)  # type: ignore[arg-type]
            while True:
                now = time.monotonic()
                if now >= deadline:
                    first = min(procs, key=lambda q: q.inflight[2] if q.inflight else float("inf"))
                    late = self._culprit(first, wait_s=0.0)  # of a policy's ranks: the one the others wait for
                    what = (late.inflight or first.inflight or (0, "call"))[1]
                    self._kill(late)
                    raise WorkerFailed(late.name, f"no reply to {what}() within {self.timeout:g}s (step_timeout_s); "
                                       f"process {late.popen.pid} was stopped. Log {late.log_path}:\n"
                                       f"{log_tail(late.log_path)}")
                for key, _ in sel.select(timeout=min(1.0, deadline - now)):
                    if self._read(key.data):
                        return key.data.index, self._unwrap(key.data, key.data.replies.pop(0))
                for p in procs:  # exited: drain what it wrote, then it is a death
                    if p.popen.poll() is not None:
                        if self._read(p):
                            return p.index, self._unwrap(p, p.replies.pop(0))
                        raise WorkerFailed(p.name, self._death(p, p.inflight[1] if p.inflight else "call"))
        finally:
            sel.close()

    def _read(self, p: _Proc) -> bool:
        """Read what ``p`` wrote; True when its reply is complete. Raises WorkerFailed at EOF."""
        while True:
            try:
                chunk = os.read(p.popen.stdout.fileno(), 1 << 20)  # type: ignore[union-attr]
            except BlockingIOError:
                break
            if not chunk:
                if p.replies:
                    break
                self._parse(p)
                if p.replies:
                    break
                raise WorkerFailed(p.name, self._death(p, p.inflight[1] if p.inflight else "call"))
            p.buf += chunk
            self._parse(p)
            if p.replies:
                break
        return bool(p.replies)

    def _parse(self, p: _Proc) -> None:
        while b"\n" in p.buf:
            line, p.buf = p.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                raise WorkerFailed(p.name, f"garbled reply {line[:200]!r}") from None
            if p.inflight and msg.get("id") == p.inflight[0]:
                p.replies.append(msg)

    def _unwrap(self, p: _Proc, msg: dict[str, Any]) -> Any:
        method = p.inflight[1] if p.inflight else "call"
        p.inflight = None
        self.last_cpu_s[p.index] = msg.get("cpu_s")
        self.last_wall_s[p.index] = msg.get("wall_s")
        if not msg.get("ok"):
            detail = f"{method}() raised {msg.get('error')}\n{msg.get('traceback', '')}".rstrip()
            culprit = self._culprit(p)
            if culprit is not p:  # a rank failed because another rank of its policy is gone or behind
                why = self._death(culprit, method) if culprit.popen.poll() is not None else (
                    f"process {culprit.popen.pid} fell behind its policy's other ranks in {method}()")
                raise WorkerFailed(culprit.name, f"{why}\n(then {p.name}: {msg.get('error')})")
            raise WorkerFailed(p.name, detail)
        return msg.get("result")

    def _culprit(self, p: _Proc, wait_s: float = 5.0) -> _Proc:
        """Of ``p``'s policy's ranks, the one to blame when ``p`` failed or hung: a rank whose process
        died (given ``wait_s`` to show it), else the rank behind the others in the collectives they
        reach (:func:`~mutualrl.run.distributed.progress`), else ``p`` itself."""
        i = self.layout.policy_of(p.index)
        ranks = [self.procs[w] for w in self.layout.members[i]]
        if len(ranks) == 1:
            return p
        end = time.monotonic() + wait_s
        while True:
            dead = [q for q in ranks if q.popen.poll() is not None]
            if dead:
                return p if p in dead else dead[0]
            if time.monotonic() >= end:
                break
            time.sleep(0.1)
        if self._store is not None:
            behind = lagging_rank(self._store, self._policy_names[i], len(ranks))  # type: ignore[arg-type]
            if behind is not None:
                return ranks[behind]
        return p

    def _death(self, p: _Proc, method: str) -> str:
        try:
            rc = p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        p.inflight = None
        how = ("closed its pipe" if rc is None else
               f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}")
        return (f"process {p.popen.pid} {how} during {method}(). Log {p.log_path}:\n{log_tail(p.log_path)}").rstrip()

    def _kill(self, p: _Proc) -> None:
        try:
            p.popen.kill()
            p.popen.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def realise(self, plan: RunPlan) -> None:
        """Give each running worker the threads and CPU priority of the re-placed ``plan``."""
        require_placed(plan, self.name)
        assert self.plan is not None
        keep = ("index", "rank", "world", "device", "visible_gpu", "gpu_fraction", "node", "exchange", "rendezvous")
        if len(self.plan.workers) != len(plan.workers) or any(
                [getattr(a, k) for k in keep] != [getattr(b, k) for k in keep]
                for a, b in zip(self.plan.workers, plan.workers, strict=True)):
            raise ValueError("a re-placed plan may change running workers' threads and nice levels only")
        for i in range(self.layout.policies):
            a, b = self.plan.spec(i), plan.spec(i)
            if a.threads != b.threads and b.threads:
                self.call_one(i, WorkerAPI.set_threads, b.threads)
            if a.nice != b.nice:
                self._call_one(i, "__nice__", b.nice)
        self.plan = plan

    def cpu_seconds(self, index: int) -> float | None:
        return self.layout.total(index, self.last_cpu_s)

    def pids(self) -> list[int]:
        """OS process ids of the workers, in policy order (rank by rank within a policy)."""
        return [p.popen.pid for p in self.procs]

    def rank_pids(self, index: int) -> list[int]:
        """OS process ids of policy ``index``'s ranks, in rank order."""
        return [self.procs[w].popen.pid for w in self.layout.members[index]]
