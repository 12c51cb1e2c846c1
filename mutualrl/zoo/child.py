"""One zoo build in a child process of :func:`mutualrl.zoo.parallel.build_in_processes`.

``python -m mutualrl.zoo.child --spec JSON --seed N --target DIR [--task JSON]``: builds the policy
into ``DIR`` exactly as an in-process build does (same code, same thread count: the same weights),
prints its progress as plain lines on stdout, and exits 2 with the band message on stderr when the
build misses its band. It exits by itself when its parent process is gone (killed, even with
``kill -9``), so stopping ``zoo build`` never leaves builders running.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from mutualrl.config.resolve import resolve_task
from mutualrl.run.orphan import exit_when_orphaned
from mutualrl.tasks.build import build_task
from mutualrl.zoo.build import build_with_progress
from mutualrl.zoo.sft import ZooBandError
from mutualrl.zoo.specs import ZooSpec
from mutualrl.zoo.task import build_task_for_seed


def main(argv: Sequence[str] | None = None) -> int:
    """Child entry point: build one policy into ``--target``; exit 2 when it misses its band."""
    ap = argparse.ArgumentParser(prog="python -m mutualrl.zoo.child", description=__doc__)
    ap.add_argument("--spec", required=True, help="the ZooSpec as JSON (ZooSpec.to_dict)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--task", default=None, help="a run config's task: section as JSON (default: the zoo task)")
    ap.add_argument("--parent", type=int, default=None,
                    help="the pid of the process that started this one (default: the parent now): exit once "
                         "it is gone, even when it died before this process got this far")
    args = ap.parse_args(argv)
    exit_when_orphaned(args.parent if args.parent is not None else os.getppid())
    torch.set_num_threads(args.threads)
    spec = ZooSpec.from_dict(json.loads(args.spec))
    task = build_task_for_seed(args.seed) if args.task is None else build_task(resolve_task(json.loads(args.task)))
    try:
        build_with_progress(spec, args.seed, task, args.target, progress=not args.quiet, stream=sys.stdout)
    except ZooBandError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
