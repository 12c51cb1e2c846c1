"""Building several zoo policies at once: one child process per policy, one torch thread each.

A zoo build is single-threaded by design (the thread count moves where a tiny model's skill
onset falls, so every default build runs on one thread), which leaves the other cores idle when
the default zoo is built: on two cores the two policies take the time of the slower one instead
of their sum. Each child is ``python -m mutualrl.zoo.child`` with the spec as JSON, the build
seed and the target directory on its command line (nothing is pickled); it builds into the
target exactly as an in-process build does (same code, same thread count: the same weights) and
prints its progress as plain lines on stdout, which the parent relays. A child whose build
misses its band exits with code 2 and the band message; the parent raises that as
:class:`~mutualrl.zoo.sft.ZooBandError` once every child has finished. A child whose parent is
gone (``zoo build`` killed) stops by itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from mutualrl.zoo.sft import ZooBandError
from mutualrl.zoo.specs import ZooSpec


def _relay(src: IO[str], dst: IO[str], keep: list[str] | None) -> None:
    for line in src:
        if keep is not None:
            keep.append(line.rstrip("\n"))
        else:
            print(line.rstrip("\n"), file=dst, flush=True)


def build_in_processes(jobs: Sequence[tuple[ZooSpec, Path]], seed: int, *, threads: int = 1,
                       progress: bool = True, stream: IO[str] | None = None,
                       task_section: dict[str, Any] | None = None) -> None:
    """Build every ``(spec, target)`` of ``jobs`` for the default zoo task of ``seed`` (or the task a
    run config's ``task:`` section ``task_section`` describes), all at once.

    Raises :class:`~mutualrl.zoo.sft.ZooBandError` with every failed policy's message when a build
    missed its band (the others are still built and cached), ``RuntimeError`` when a child failed
    otherwise."""
    out = stream or sys.stderr
    procs = []
    for spec, target in jobs:
        cmd = [sys.executable, "-m", "mutualrl.zoo.child", "--spec", json.dumps(spec.to_dict()),
               "--seed", str(seed), "--target", str(target), "--threads", str(threads), "--parent", str(os.getpid())]
        if not progress:
            cmd.append("--quiet")
        if task_section is not None:
            cmd += ["--task", json.dumps(task_section)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        err: list[str] = []
        relays = [threading.Thread(target=_relay, args=(p.stdout, out, None), daemon=True),
                  threading.Thread(target=_relay, args=(p.stderr, out, err), daemon=True)]
        for t in relays:
            t.start()
        procs.append((spec, p, relays, err))
    try:
        for _, p, relays, _ in procs:
            p.wait()
            for t in relays:
                t.join()
    except BaseException:
        for _, p, _, _ in procs:
            if p.poll() is None:
                p.terminate()
        for _, p, _, _ in procs:
            p.wait()
        raise
    band = [err[-1] for _, p, _, err in procs if p.returncode == 2 and err]
    crashed = [(spec.name, p.returncode, "\n".join(err[-20:])) for spec, p, _, err in procs
               if p.returncode not in (0, 2)]
    if crashed:
        name, rc, tail = crashed[0]
        raise RuntimeError(f"zoo build of {name!r} failed in its process (exit {rc}):\n{tail}")
    if band:
        raise ZooBandError(" | ".join(band))
